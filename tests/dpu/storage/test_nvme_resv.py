"""NVMe persistent reservations (ctxmem_dpu.storage.nvme_resv) on the host: the
passthrough structure against an independent ctypes copy of ``struct nvme_passthru_cmd``
(linux/nvme_ioctl.h), each command's dwords and data as the NVMe base specification lays
them out, the status decoding, the Report parser, and the fallback where there are no
reservations (a plain file, a character device, a block device that is not an NVMe
namespace). Real reservations are exercised in the guest (tests/vm/test_nvme_resv_vm.py)."""

from __future__ import annotations

import ctypes
import errno
import struct
from pathlib import Path

import pytest

from ctxmem_dpu.storage import nvme_resv as nr
from ctxmem_dpu.tiers.flash import FlashDevice
from ctxmem_dpu.tiers.flash_fence import SlabFence, SlabFenced
from tests.dpu.pod.podkit import format_shared


class _Passthru(ctypes.Structure):
    """linux/nvme_ioctl.h, field for field (natural alignment, as the kernel's)."""

    _fields_ = [("opcode", ctypes.c_uint8), ("flags", ctypes.c_uint8),
                ("rsvd1", ctypes.c_uint16), ("nsid", ctypes.c_uint32),
                ("cdw2", ctypes.c_uint32), ("cdw3", ctypes.c_uint32),
                ("metadata", ctypes.c_uint64), ("addr", ctypes.c_uint64),
                ("metadata_len", ctypes.c_uint32), ("data_len", ctypes.c_uint32),
                ("cdw10", ctypes.c_uint32), ("cdw11", ctypes.c_uint32),
                ("cdw12", ctypes.c_uint32), ("cdw13", ctypes.c_uint32),
                ("cdw14", ctypes.c_uint32), ("cdw15", ctypes.c_uint32),
                ("timeout_ms", ctypes.c_uint32), ("result", ctypes.c_uint32)]


def test_passthru_struct_matches_the_kernel_layout() -> None:
    assert ctypes.sizeof(_Passthru) == nr.PASSTHRU.size == 72
    raw = nr.pack_cmd(0x11, 7, 0x1122334455667788, 16, cdw10=0x0502, cdw11=1,
                      timeout_ms=30_000)
    c = _Passthru.from_buffer_copy(bytes(raw))
    assert (c.opcode, c.flags, c.nsid, c.addr, c.data_len, c.cdw10, c.cdw11,
            c.timeout_ms, c.result, c.metadata, c.metadata_len) == (
        0x11, 0, 7, 0x1122334455667788, 16, 0x0502, 1, 30_000, 0, 0, 0)
    assert isinstance(raw, bytearray)  # the kernel writes `result` back into it


def test_ioctl_numbers() -> None:
    # _IOWR('N', 0x43, struct nvme_passthru_cmd) and friends, as nvme-cli uses them.
    assert nr.NVME_IOCTL_IO_CMD == 0xC0484E43
    assert nr.NVME_IOCTL_ADMIN_CMD == 0xC0484E41
    assert nr.NVME_IOCTL_ID == 0x4E40


def test_command_dwords() -> None:
    # Register: RREGA 2:0, IEKEY 3, CPTPL 31:30.
    assert nr.register_cdw10(nr.RegisterAction.REPLACE, iekey=True) == 0x0A
    assert nr.register_cdw10(nr.RegisterAction.UNREGISTER) == 0x01
    assert nr.register_cdw10(nr.RegisterAction.REGISTER, cptpl=3) == 0xC000_0000
    # Acquire: RACQA 2:0, IEKEY 3, RTYPE 15:8; Write Exclusive - All Registrants is 5.
    assert nr.RESV_TYPE == 5
    assert nr.acquire_cdw10(nr.AcquireAction.ACQUIRE, nr.RESV_TYPE) == 0x0500
    assert nr.acquire_cdw10(nr.AcquireAction.PREEMPT_AND_ABORT, nr.RESV_TYPE) == 0x0502
    assert nr.acquire_cdw10(nr.AcquireAction.PREEMPT, nr.ResvType.WRITE_EXCLUSIVE,
                            iekey=True) == 0x0109
    # Release: RRELA 2:0, RTYPE 15:8.
    assert nr.release_cdw10(nr.ReleaseAction.CLEAR, nr.RESV_TYPE) == 0x0501
    # Report: NUMD is the dword count less one.
    assert nr.report_cdw10(4096) == 1023
    # Opcodes (NVM command set) and the key data: two little-endian 64-bit keys.
    assert (nr.Opcode.RESV_REGISTER, nr.Opcode.RESV_REPORT, nr.Opcode.RESV_ACQUIRE,
            nr.Opcode.RESV_RELEASE) == (0x0D, 0x0E, 0x11, 0x15)
    assert nr.key_pair(0x0102030405060708, 0xA0) == (
        bytes([8, 7, 6, 5, 4, 3, 2, 1]) + bytes([0xA0]) + bytes(7))


def test_status_decoding() -> None:
    assert nr.status_text(0x83) == "0x83 Reservation Conflict (SCT 0)"
    assert nr.status_text(0x4083).startswith("0x83 Reservation Conflict")  # with DNR
    assert nr.status_text(0x01) == "0x01 Invalid Command Opcode (SCT 0)"
    assert "SCT 1" in nr.status_text(0x10C)
    e = nr.ReservationConflict(errno.EBADE, "x", 0x4083)
    assert e.sc == 0x83 and e.errno == errno.EBADE
    assert nr.NvmeCommandError(errno.EIO, "x", 0x181).sc is None  # not generic


def _report(gen: int, rtype: int, regs: list[tuple[int, int, int, bytes]]) -> bytes:
    """An extended Reservation Status data structure, built from the specification's
    byte offsets (not from the parser's struct formats)."""
    head = bytearray(64)
    head[0:4] = gen.to_bytes(4, "little")
    head[4] = rtype
    head[5:7] = len(regs).to_bytes(2, "little")
    head[9] = 1  # PTPLS
    out = bytes(head)
    for cntlid, rcsts, key, hostid in regs:
        e = bytearray(64)
        e[0:2] = cntlid.to_bytes(2, "little")
        e[2] = rcsts
        e[8:16] = key.to_bytes(8, "little")
        e[16:32] = hostid
        out += bytes(e)
    return out


def test_report_parsing() -> None:
    h1, h2 = bytes(range(16)), bytes(range(16, 32))
    raw = _report(9, 5, [(1, 1, nr.node_key("a"), h1), (2, 1, nr.node_key("b"), h2)])
    st = nr.parse_report(raw + bytes(64))
    assert (st.generation, st.rtype, st.ptpls) == (9, 5, True)
    assert st.registrants == (nr.Registrant(1, True, nr.node_key("a"), h1),
                              nr.Registrant(2, True, nr.node_key("b"), h2))
    assert st.registered_keys() == {nr.node_key("a"), nr.node_key("b")}
    # More registrants than the buffer holds: only those that fit.
    assert len(nr.parse_report(raw[:64 + 64]).registrants) == 1


def test_node_keys() -> None:
    assert nr.node_key("node-1") == nr.node_key("node-1")
    assert nr.node_key("node-1") != nr.node_key("node-2")
    assert 0 < nr.node_key("") < 1 << 64
    assert struct.pack("<Q", nr.node_key("x"))  # fits a 64-bit key


def test_no_reservations_on_a_file_or_a_character_device(tmp_path: Path) -> None:
    f = tmp_path / "flash.img"
    f.write_bytes(bytes(4096))
    with nr.NvmeReservation.open(str(f), "n1") as r:
        s = r.probe()
        assert not s.ok and "not a block device" in s.reason
    assert r.fd == -1  # closed
    with nr.NvmeReservation.open("/dev/null", "n1") as r:
        assert "not a block device" in r.probe().reason


def test_no_reservations_on_a_block_device_that_is_not_nvme() -> None:
    for dev in ("/dev/loop0", "/dev/vda", "/dev/zram0", "/dev/sda"):
        try:
            r = nr.NvmeReservation.open(dev, "n1")
        except OSError:
            continue
        with r:
            s = r.probe()
        if not s.ok:
            assert "not an NVMe namespace" in s.reason, s.reason
            return
    pytest.skip("no openable non-NVMe block device here (needs root and /dev/loop0 or a "
                "virtio disk)")


def test_a_command_on_a_file_names_device_command_and_errno(tmp_path: Path) -> None:
    f = tmp_path / "flash.img"
    f.write_bytes(bytes(4096))
    with nr.NvmeReservation.open(str(f), "n1", device="shared0") as r:
        r.nsid = 1
        with pytest.raises(nr.NvmeCommandError) as err:
            r.register()
    text = str(err.value)
    assert "shared0" in text and "Reservation Register" in text and "ENOTTY" in text, text
    assert "not an NVMe namespace" in text
    assert err.value.status is None


def test_a_stopped_fence_refuses_every_slab_with_the_reason() -> None:
    fence = SlabFence("shared0", "n1")
    fence.grant(3, 7, 1e18)
    fence.check(3)
    fence.stop("its NVMe reservation key was preempted")
    fence.stop("a later reason")  # the first is kept
    with pytest.raises(SlabFenced) as err:
        fence.check(3)
    assert err.value.errno == errno.EBADE
    assert "preempted" in str(err.value) and "later" not in str(err.value)


def test_shared_device_on_a_file_is_fenced_by_the_epoch_alone(tmp_path: Path) -> None:
    path = str(tmp_path / "shared.img")
    format_shared(path, 1 << 20, size=(1 << 20) * 3)
    with FlashDevice(0, "shared0", path, 1 << 20, False, True,
                     SlabFence("shared0", "n1")) as dev:
        assert dev.resv is None
        assert dev.fencing == "epoch_only"
        assert "not a block device" in dev.resv_absent
        assert dev.fence_out("n2") == ""  # nothing to preempt: the epoch fences
        assert dev.check_registration()
    own = tmp_path / "own.img"
    with open(own, "wb") as f:
        f.truncate(3 << 20)
    with FlashDevice(0, "own", str(own), 1 << 20, False) as dev:
        assert dev.fencing == "" and dev.resv is None
