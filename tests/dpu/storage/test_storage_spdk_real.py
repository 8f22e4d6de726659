"""`spdk` backend against a REAL SPDK (spdk_tgt built by deploy/ci/spdk-build.sh).

Runs inside the QEMU guest (tests/vm/run.sh), where SPDK is the DPU's storage stack and
the guest's kernel NVMe-oF target (nvmet) is the remote flash, as a separate process,
as on a DPU. (One SPDK acting as both target and initiator registers the namespace's
UUID twice and never creates the namespace bdev: that layout cannot work.)

- every method ctxmem sends is registered in this SPDK (ublk and crypto included);
- the backend attaches the nvmet subsystem over RDMA (Soft-RoCE) and over TCP with
  `bdev_nvme_attach_controller`, optionally stacks an AES-XTS crypto bdev (key from a
  0600 key file) on the namespace, exposes the top bdev through nbd (every kernel) or
  ublk (the backports 6.12 kernel), and a 1 MiB O_DIRECT round trip compares equal;
- with crypto, the bytes on the namespace (nvmet's backing file) are AES-XTS of what was
  written, under the key file's key: SPDK encrypted them, with no plaintext left.

ublk needs /dev/ublk-control (Debian 12's 6.1 kernel has none): those cases skip there
and run in CI's second, backports-kernel boot (CTXMEM_SPDK_REQUIRE_UBLK=1 turns the
skip into a failure). On a host without the guest everything skips.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import pytest

from ctxmem_dpu.storage import parse_device_spec
from ctxmem_dpu.storage.spdk import SpdkBackend
from ctxmem_dpu.storage.spdk_requests import SENDABLE_METHODS

IN_VM = os.environ.get("CTXMEM_VM") == "1"
RUN = ("bash deploy/ci/spdk-build.sh && bash tests/vm/run.sh .venv/bin/pytest -m vm "
       "tests/dpu/storage/test_storage_spdk_real.py")
pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(not IN_VM, reason="needs the QEMU guest (kernel nvmet target, nbd/ublk, "
                                         f"SPDK built from source); run: {RUN}"),
]

MIB = 1 << 20
ATTACH_TIMEOUT_S = 120.0  # TCG-emulated guest: bounds, never timings


def _env(name: str) -> str:
    value = os.environ.get(name)
    assert value, f"{name} is not set; tests/vm/run.sh must export it inside the guest"
    return value


def require_ublk() -> None:
    if os.path.exists("/dev/ublk-control"):
        return
    msg = (f"kernel {os.uname().release} has no ublk (/dev/ublk-control missing; Debian 12's "
           "6.1 has none): runs in the backports-kernel boot, CTXMEM_VM_KERNEL=backports")
    if os.environ.get("CTXMEM_SPDK_REQUIRE_UBLK") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


def device_raw(name: str, transport: str, expose: str, socket: str,
               key_file: Path | None = None) -> dict[str, Any]:
    port = _env("CTXMEM_NVMET_RDMA_PORT" if transport == "rdma" else "CTXMEM_NVMET_TCP_PORT")
    spdk: dict[str, Any] = {
        "rpc_socket": socket, "bdev_name": name, "trtype": transport,
        "traddr": _env("CTXMEM_NVMET_ADDR"), "trsvcid": port, "subnqn": _env("CTXMEM_NVMET_NQN"),
        "expose": expose, "ctrlr_loss_timeout_sec": 10, "reconnect_delay_sec": 1,
        "fast_io_fail_timeout_sec": 2}
    if key_file is not None:
        spdk["crypto"] = {"enabled": True, "key_name": f"{name}_key", "key_file": str(key_file)}
    return {"name": name.lower(), "backend": "spdk", "spdk": spdk}


def xts_decrypt(key: bytes, data: bytes, first_lba: int, block: int) -> bytes:
    """AES-XTS decrypt as SPDK's software accel module encrypts: one data unit per
    logical block, tweak = 8 zero bytes then the LBA as a little-endian u64
    (lib/accel/accel_sw.c). One call per block of a few blocks: test-side only."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    out = bytearray()
    for i in range(len(data) // block):
        tweak = bytes(8) + (first_lba + i).to_bytes(8, "little")
        dec = Cipher(algorithms.AES(key), modes.XTS(tweak)).decryptor()
        out += dec.update(data[i * block:(i + 1) * block]) + dec.finalize()
    return bytes(out)


def test_target_registers_every_method_ctxmem_sends(spdk_target: Any) -> None:
    registered = set(spdk_target.rpc("rpc_get_methods", {"current": True}))
    # This build has ublk, crypto and nbd: nothing ctxmem sends may be missing.
    assert not SENDABLE_METHODS - registered, sorted(SENDABLE_METHODS - registered)


@pytest.mark.parametrize(("transport", "expose", "crypto"), [
    ("rdma", "nbd", True), ("tcp", "nbd", False), ("tcp", "ublk", True)])
def test_attach_expose_round_trip(spdk_target: Any, transport: str, expose: str, crypto: bool,
                                  tmp_path: Path) -> None:
    if expose == "ublk":
        require_ublk()
    key = tmp_path / "xts.key" if crypto else None
    if key is not None:
        key.write_text(os.urandom(64).hex())  # AES-256-XTS: key || key2
        key.chmod(0o600)
    name = f"Real{transport.capitalize()}{expose.capitalize()}"
    dev = SpdkBackend(parse_device_spec(device_raw(name, transport, expose, spdk_target.socket,
                                                   key), "realtest"))
    offset = 8 * MIB
    try:
        path = dev.attach(timeout_s=ATTACH_TIMEOUT_S)
        assert dev.attach(timeout_s=ATTACH_TIMEOUT_S) == path  # idempotent: reused
        assert path.startswith("/dev/ublkb" if expose == "ublk" else "/dev/nbd"), path
        ctrls = [c for c in spdk_target.rpc("bdev_nvme_get_controllers") if c["name"] == name]
        assert len(ctrls) == 1 and len(ctrls[0]["ctrlrs"]) == 1, ctrls
        assert ctrls[0]["ctrlrs"][0]["trid"]["trtype"].lower() == transport
        assert dev.size_bytes is not None and dev.size_bytes >= 256 * MIB
        assert dev.is_healthy() and dev.offloads_encryption is crypto
        out, back = mmap.mmap(-1, MIB), mmap.mmap(-1, MIB)
        out.write(os.urandom(MIB))
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        try:
            assert os.pwritev(fd, [out], offset) == MIB
            os.fsync(fd)
            assert os.preadv(fd, [back], offset) == MIB
        finally:
            os.close(fd)
        assert back[:] == out[:], f"bytes read back through {path} differ"
        with open(_env("CTXMEM_NVMET_BACKING"), "rb") as f:  # the remote namespace itself
            f.seek(offset)
            raw = f.read(MIB)
        if not crypto:
            assert raw == out[:]
        else:
            assert key is not None
            assert out[:].find(raw[:64]) < 0 and raw.find(out[:64]) < 0, "plaintext on flash"
            block = int(next(b for b in spdk_target.rpc("bdev_get_bdevs")
                             if b["name"] == f"{name}n1")["block_size"])
            sample = 4 * block  # a few data units are enough to prove key and tweak
            plain = xts_decrypt(bytes.fromhex(key.read_text()), raw[:sample], offset // block,
                                block)
            assert plain == out[:sample], "namespace bytes are not AES-XTS under the key file"
    finally:
        dev.detach()
        dev.close()
    assert not any(c["name"] == name for c in spdk_target.rpc("bdev_nvme_get_controllers"))
    assert not any(b["name"].startswith(name) for b in spdk_target.rpc("bdev_get_bdevs"))
