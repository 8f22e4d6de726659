"""Issue 13 case 3 below the service: the slab-header extension and the key check
(format), the rebuild of a lost superblock, the refusal to format a device that holds
records, and an encrypted record read with a wrong key never being invalidated."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from ctxmem_common.codecs import XtsCipher, crc32c
from ctxmem_common.flash_format import (
    DATA_START,
    REC_BODY,
    SB_OFFSET,
    SECTOR,
    FlashReader,
    RecordHeader,
    SlabHeader,
    Superblock,
    slab_base,
    slots_per_slab,
)
from ctxmem_dpu.check import check_devices
from ctxmem_dpu.check_superblock import format_device, rebuild
from ctxmem_dpu.tiers.flash import FlashDevice, FlashIOError

from .storekit import MASTER, get, make_flash, open_store, payload, put, session, store_config

SLAB = 1 << 20


def test_slab_header_extension_round_trips_and_old_headers_still_parse() -> None:
    sb = Superblock.new(SLAB, 64 << 20)
    new = SlabHeader(65536, slots_per_slab(SLAB, 65536)).for_device(sb)
    back = SlabHeader.unpack(new.pack())
    assert back == new and back is not None and back.superblock() == sb
    old = SlabHeader(65536, 14)
    legacy = SlabHeader.unpack(old.pack())  # written before the extension: still valid
    assert legacy == old and legacy is not None and legacy.superblock() is None
    raw = bytearray(new.pack())
    raw[40] ^= 1  # a damaged extension: the header itself is still good
    damaged = SlabHeader.unpack(bytes(raw))
    assert damaged == SlabHeader(new.slot_size, new.slots)


def test_record_header_carries_the_key_check() -> None:
    cipher = XtsCipher(hashlib.sha512(b"k").digest())
    hdr = RecordHeader(bytes(16), b"key", 10, 1, 2, True, 3, cipher.check_value)
    assert RecordHeader.unpack(hdr.pack()) == hdr and cipher.check_value & 1
    assert XtsCipher(hashlib.sha512(b"other").digest()).check_value != cipher.check_value


def _device_with_records(path: Path) -> tuple[list[tuple[str, str]], Superblock]:
    """A device a store wrote (encrypted records in several slabs), stopped cleanly."""
    import asyncio

    async def fill() -> Superblock:
        store = await open_store(store_config(), make_flash(path))
        s, ns = session(store)
        data = {hashlib.sha256(bytes([i])).digest(): payload(i + 1) for i in range(20)}
        await put(store, s, ns, data)
        assert await store.evict(ns, list(data), "dram") == 20
        sb = store.flash.devices[0].superblock
        await store.close()
        return sb

    return [("flash0", str(path))], asyncio.run(fill())


def _damage_superblocks(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(SB_OFFSET)
        f.write(bytes(2 * SECTOR))


def test_a_device_with_records_and_no_superblock_is_refused_not_formatted(
        tmp_path: Path) -> None:
    flash, _sb = _device_with_records(tmp_path / "f.img")
    _damage_superblocks(tmp_path / "f.img")
    before = (tmp_path / "f.img").read_bytes()
    with pytest.raises(FlashIOError, match=r"'flash0' .* both superblock copies are damaged.*"
                                           r"ctxmem check --repair") as err:
        FlashDevice(0, "flash0", flash[0][1], SLAB, o_direct=False)
    assert "ctxmem check --format --device flash0=" in str(err.value)
    assert (tmp_path / "f.img").read_bytes() == before  # not even the owner record stays


def test_a_device_with_records_under_another_slab_size_is_refused_too(tmp_path: Path) -> None:
    flash, _sb = _device_with_records(tmp_path / "f.img")
    _damage_superblocks(tmp_path / "f.img")
    with pytest.raises(FlashIOError, match="holds records"):  # config asks 2 MiB slabs
        FlashDevice(0, "flash0", flash[0][1], 2 * SLAB, o_direct=False)


def test_repair_rebuilds_the_superblock_uuid_included(tmp_path: Path) -> None:
    flash, sb = _device_with_records(tmp_path / "f.img")
    _damage_superblocks(tmp_path / "f.img")
    lines: list[str] = []
    report = check_devices(flash, MASTER, repair=True, log=lines)
    assert any("rebuilt from the slab headers" in line for line in lines)
    assert report.payloads_verified == 20 and report.errors == report.repaired == 1
    assert FlashReader(os.open(flash[0][1], os.O_RDONLY)).superblocks().current == sb
    assert check_devices(flash, MASTER).clean


def test_rebuild_without_the_extension_takes_a_new_uuid_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "f.img"
    with open(path, "wb") as f:
        f.truncate(DATA_START + 8 * SLAB)
        f.seek(slab_base(2, SLAB))
        f.write(SlabHeader(65536, slots_per_slab(SLAB, 65536)).pack())  # an older header
    found = FlashReader(os.open(path, os.O_RDONLY)).find_slab_headers(DATA_START + 8 * SLAB)
    assert [(s, z) for s, z, _h in found] == [(2, SLAB)]
    sb, known, basis = rebuild(found, DATA_START + 8 * SLAB)
    assert not known and sb.slab_size == SLAB and sb.num_slabs == 8
    assert "new UUID" in basis and "not invalidated" in basis


def test_format_discards_records_and_refuses_bad_slab_sizes(tmp_path: Path) -> None:
    flash, old = _device_with_records(tmp_path / "f.img")
    with pytest.raises(OSError, match="not a multiple of 4096"):
        format_device("flash0", flash[0][1], 5000)
    line = format_device("flash0", flash[0][1], 2 * SLAB)
    assert "discarded" in line
    fd = os.open(flash[0][1], os.O_RDONLY)
    try:
        reader = FlashReader(fd)
        sb = reader.superblocks().current
        assert sb is not None and sb.device_uuid != old.device_uuid and sb.slab_size == 2 * SLAB
        assert not reader.find_slab_headers(os.fstat(fd).st_size, [SLAB, 2 * SLAB])
    finally:
        os.close(fd)
    small = tmp_path / "small.img"
    small.write_bytes(bytes(SLAB))
    with pytest.raises(OSError, match="needs at least"):
        format_device("flash1", str(small), SLAB)


def _zero_key_checks(path: Path) -> int:
    """Rewrite every record header as an older version wrote it (no key check)."""
    fd = os.open(path, os.O_RDWR)
    n = 0
    try:
        reader = FlashReader(fd)
        sb = reader.superblocks().current
        assert sb is not None
        for scan in reader.walk(sb):
            for slot in scan.records.slot:
                off = slab_base(scan.slab, sb.slab_size) + SECTOR + slot * SECTOR
                raw = bytearray(os.pread(fd, SECTOR, off))
                raw[12:16] = bytes(4)
                raw[REC_BODY : REC_BODY + 4] = crc32c(bytes(raw[:REC_BODY])).to_bytes(4,
                                                                                      "little")
                os.pwrite(fd, bytes(raw), off)
                n += 1
    finally:
        os.close(fd)
    return n


async def test_older_encrypted_records_read_with_a_wrong_key_are_not_invalidated(
        tmp_path: Path) -> None:
    path = tmp_path / "f.img"
    flash = make_flash(path)
    store = await open_store(store_config(), flash)
    s, ns = session(store)
    data = {hashlib.sha256(bytes([i])).digest(): payload(i + 1) for i in range(6)}
    await put(store, s, ns, data)
    assert await store.evict(ns, list(data), "dram") == 6
    await store.close()
    assert _zero_key_checks(path) == 6
    from ctxmem_dpu.store import BlockStore

    wrong = BlockStore(store_config(), flash, bytes(32))
    await wrong.start()
    try:
        s, ns = session(wrong)
        for k in data:
            assert await get(wrong, s, ns, [k]) == []
    finally:
        await wrong.close()
    lines: list[str] = []
    check_devices(flash, bytes(32), repair=True, log=lines)  # the wrong key again
    assert any("may be a wrong master key" in line for line in lines)
    store = await open_store(store_config(), flash)
    try:
        s, ns = session(store)
        for k, v in data.items():
            assert await get(store, s, ns, [k]) == [v]
    finally:
        await store.close()
