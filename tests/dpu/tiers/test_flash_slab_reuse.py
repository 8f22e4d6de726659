"""A released slab assigned again: its header table is zeroed only where it may hold
something (issue 17 item 3), and no record of its previous use ever comes back.

Real files, O_DIRECT, a device this process owns. Reusing a slab for the same slot size
after its records were invalidated writes no table and no slab header; a header still live
when its slot was freed, the old layout's payload area that a layout of smaller slots
turns into table entries, and a slab header the device may have lost (after a probe) are
all written again; a restart (a fresh ``FlashDevice``) finds exactly the new records.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from ctxmem_common.codecs import crc32c
from ctxmem_common.flash_format import SECTOR, RecordHeader, slab_base, slots_per_slab
from ctxmem_dpu import faults
from ctxmem_dpu.alloc import SlotRef
from ctxmem_dpu.tiers.flash import FlashDevice

NS = bytes(range(16))
SLOT = 16 * SECTOR  # 64 KiB slots
SLAB = 4 << 20


@pytest.fixture(autouse=True)
def _no_faults() -> None:
    faults.reset()
    yield
    faults.reset()


def _device(path: Path) -> FlashDevice:
    if not path.exists():
        with open(path, "wb") as f:
            f.truncate(24 << 20)
    return FlashDevice(0, "d", str(path), SLAB, o_direct=True)


def _write(dev: FlashDevice, slots: list[SlotRef], keys: list[bytes], payload: bytes = b""
           ) -> None:
    """Payloads, sync, headers, sync: one demotion of ``keys`` into ``slots``."""
    size = dev.alloc.slabs[slots[0].slab].slot_size
    bufs = []
    for _ in slots:
        buf = mmap.mmap(-1, size)
        buf[: len(payload)] = payload
        bufs.append(buf)
    assert dev.write_payloads([(s, memoryview(b)) for s, b in zip(slots, bufs, strict=True)],
                              None) == [None] * len(slots)
    dev.sync()
    hdrs = [RecordHeader(NS, k, size, crc32c(b), 7, False, 1)
            for k, b in zip(keys, bufs, strict=True)]
    assert dev.write_headers(list(zip(slots, hdrs, strict=True))) == [None] * len(slots)
    dev.sync()


def _keys_after_restart(dev: FlashDevice) -> set[bytes]:
    path = Path(dev.path)
    dev.close()
    with _device(path) as again:
        return {h.key for _slot, _size, h in again.scan()}


def _release(dev: FlashDevice, slots: list[SlotRef], invalidate: bool = True) -> None:
    if invalidate:
        dev.invalidate_many(slots)
        dev.sync()
    for s in slots:
        dev.alloc.free(s)
    assert dev.alloc.slabs[slots[0].slab].klass is None  # released


def _counting_writes(dev: FlashDevice, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    writes: list[tuple[int, int]] = []
    real = dev._pwrite

    def counting(buf: object, offset: int) -> None:
        bufs = buf if isinstance(buf, list) else [buf]
        writes.append((offset, sum(memoryview(b).nbytes for b in bufs)))  # type: ignore[arg-type]
        real(buf, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(dev, "_pwrite", counting)
    return writes


def test_first_assignment_zeroes_the_whole_table_in_one_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Stale bytes where the table goes: the first assignment in this process knows nothing.
    path = tmp_path / "d.img"
    _device(path).close()
    with open(path, "r+b") as f:
        f.seek(slab_base(0, SLAB) + SECTOR)
        f.write(b"\xff" * (64 * SECTOR))
    with _device(path) as dev:
        writes = _counting_writes(dev, monkeypatch)
        slots = dev.alloc.allocate(SECTOR, SECTOR, 1)  # 4 KiB slots: a 2 MiB table
        assert slots is not None
        cap = dev.alloc.slabs[slots[0].slab].capacity
        assert cap * SECTOR > 1 << 20
        _write(dev, slots, [b"k"])
        table = dev.slab_base(slots[0].slab) + SECTOR
        assert (table, cap * SECTOR) in writes  # one write of the whole table
        with open(path, "rb") as f:
            f.seek(table + SECTOR)
            assert f.read((cap - 1) * SECTOR) == bytes((cap - 1) * SECTOR)


def test_same_size_reuse_writes_no_table_and_no_slab_header(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dev = _device(tmp_path / "d.img")
    slots = dev.alloc.allocate(SLOT, SLOT, 8)
    assert slots is not None
    _write(dev, slots, [b"old-%d" % i for i in range(8)])
    _release(dev, slots)
    writes = _counting_writes(dev, monkeypatch)
    again = dev.alloc.allocate(SLOT, SLOT, 2)
    assert again is not None and again[0].slab == slots[0].slab
    _write(dev, again, [b"new-0", b"new-1"])
    # The two payloads (one write) and the two headers (one write), nothing else.
    assert writes == [(dev.payload_offset(again[0]), 2 * SLOT),
                      (dev.header_offset(again[0]), 2 * SECTOR)]
    assert _keys_after_restart(dev) == {b"new-0", b"new-1"}


def test_a_header_live_when_its_slot_was_freed_is_zeroed_on_reuse(tmp_path: Path) -> None:
    dev = _device(tmp_path / "d.img")
    slots = dev.alloc.allocate(SLOT, SLOT, 4)
    assert slots is not None
    _write(dev, slots, [b"old-%d" % i for i in range(4)])
    dev.invalidate_many(slots[:2])  # slots 2 and 3 keep their headers
    dev.sync()
    _release(dev, slots, invalidate=False)
    again = dev.alloc.allocate(SLOT, SLOT, 1)
    assert again is not None and again[0] == slots[0]
    _write(dev, again, [b"new"])
    assert _keys_after_restart(dev) == {b"new"}


def test_smaller_slots_zero_the_old_payload_area_their_table_now_covers(
        tmp_path: Path) -> None:
    dev = _device(tmp_path / "d.img")
    big = dev.alloc.allocate(SLOT, SLOT, 2)
    assert big is not None
    # Old payloads that read as valid record headers once the table grows over them.
    ghost = RecordHeader(NS, b"ghost", SECTOR, crc32c(bytes(SECTOR)), 1, False, 1).pack()
    _write(dev, big, [b"old-0", b"old-1"], payload=ghost * (SLOT // SECTOR))
    _release(dev, big)
    small = dev.alloc.allocate(SECTOR, SECTOR, 1)
    assert small is not None and small[0].slab == big[0].slab
    # The new table reaches past the old one, over the old slots' payloads.
    old_cap = slots_per_slab(SLAB, SLOT)
    assert dev.alloc.slabs[small[0].slab].capacity >= old_cap + 2 * SLOT // SECTOR
    _write(dev, small, [b"new"])
    assert _keys_after_restart(dev) == {b"new"}


def test_after_a_probe_a_reused_slab_gets_its_header_and_table_again(
        tmp_path: Path) -> None:
    dev = _device(tmp_path / "d.img")
    slots = dev.alloc.allocate(SLOT, SLOT, 2)
    assert slots is not None
    _write(dev, slots, [b"old-0", b"old-1"])
    _release(dev, slots)
    # The device lost what was written to the free slab (grown back as zeros, say).
    fd = os.open(dev.path, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(SECTOR), dev.slab_base(slots[0].slab))
        os.fsync(fd)
    finally:
        os.close(fd)
    dev.probe()
    again = dev.alloc.allocate(SLOT, SLOT, 1)
    assert again is not None and again[0].slab == slots[0].slab
    _write(dev, again, [b"new"])
    assert _keys_after_restart(dev) == {b"new"}
