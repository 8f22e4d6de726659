"""On-device corruption is detected, served as a miss, quarantined and counted; never data.

In-process BlockStore on real files (fast); one test per corruption kind of issue 6: bit
flips, zeroed sectors, a truncated device, a device swapped with another, a stale extent of
a deleted block, a block of another namespace; plus the superblock and slab-header
copies, and ``ctxmem check`` finding and repairing what a restart would otherwise trip on.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ctxmem_common.flash_format import REC_SIZE, SECTOR
from ctxmem_dpu import faults
from ctxmem_dpu.check import check_command, check_devices
from ctxmem_dpu.store import BlockStore

from ..dpu.storekit import (
    FLASH,
    MASTER,
    get,
    make_flash,
    open_store,
    payload,
    put,
    session,
    store_config,
)
from ..kit import read_until_async, until_async
from .kit import patch_file, settled_audit

K = [bytes([i]) * 8 for i in range(1, 120)]


@pytest.fixture(autouse=True)
def _fast_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(FLASH, "probe_interval_s", 0.05)  # flash.probe_interval_s
    faults.reset()


def _read(path: Path, off: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(off)
        return f.read(n)


async def _durable(store: BlockStore, n: int, first: int = 0) -> tuple[object, object, dict]:
    s, ns = session(store)
    data = {K[first + i]: payload(first + i + 1) for i in range(n)}
    await put(store, s, ns, data)
    assert await store.evict(ns, list(data), "dram") == n  # on flash only
    return s, ns, data


def _where(store: BlockStore, ns: object, key: bytes) -> tuple[int, int]:
    b = store.index[ns.digest][key]  # type: ignore[attr-defined]
    assert b.flash is not None
    dev = store.flash.devices[b.flash.device]
    return dev.header_offset(b.flash.slot), dev.payload_offset(b.flash.slot)


async def _is_miss_counted_quarantined(store: BlockStore, s: object, ns: object,
                                       key: bytes, others: dict[bytes, bytes]) -> None:
    before = store.counters["integrity_failures"]
    assert await get(store, s, ns, [key]) == []  # a miss, never data
    assert store.counters["integrity_failures"] == before + 1
    assert store.stats()["flash_quarantined_slots"] >= 1
    assert store.lookup(ns, [key], prefix=True)[0] == 0  # gone from the index
    for k, v in others.items():  # the neighbours are untouched
        assert await get(store, s, ns, [k]) == [v]


@pytest.mark.parametrize("where", ["payload", "header"])
async def test_bit_flip_is_a_counted_quarantined_miss(tmp_path: Path, where: str) -> None:
    flash = make_flash(tmp_path / "f.img")
    store = await open_store(store_config(), flash)
    try:
        s, ns, data = await _durable(store, 6)
        hdr, pay = _where(store, ns, K[2])
        off = pay + 1000 if where == "payload" else hdr + 40  # inside the key field
        patch_file(tmp_path / "f.img", off, bytes([_read(tmp_path / "f.img", off, 1)[0] ^ 0x08]))
        others = {k: v for k, v in data.items() if k != K[2]}
        await _is_miss_counted_quarantined(store, s, ns, K[2], others)
        assert await settled_audit(store) == []
    finally:
        await store.close()
    # After a restart the damaged record is not served either, and nothing else is lost.
    store = await open_store(store_config(), flash)
    try:
        s, ns = session(store)
        assert store.lookup(ns, [K[2]], prefix=True)[0] == 0
        for k, v in others.items():
            assert await get(store, s, ns, [k]) == [v]
    finally:
        await store.close()
    assert check_devices(flash, MASTER).errors == 0


@pytest.mark.parametrize("where", ["payload", "header"])
async def test_zeroed_sector_is_a_counted_quarantined_miss(tmp_path: Path, where: str) -> None:
    store = await open_store(store_config(), make_flash(tmp_path / "f.img"))
    try:
        s, ns, data = await _durable(store, 4)
        hdr, pay = _where(store, ns, K[1])
        patch_file(tmp_path / "f.img", pay + SECTOR if where == "payload" else hdr, bytes(SECTOR))
        await _is_miss_counted_quarantined(store, s, ns, K[1],
                                           {k: v for k, v in data.items() if k != K[1]})
    finally:
        await store.close()


async def test_truncated_device_degrades_then_recovers(tmp_path: Path) -> None:
    path = tmp_path / "f.img"
    flash = make_flash(path)
    store = await open_store(store_config(), flash)
    try:
        s, ns, data = await _durable(store, 10)
        await put(store, s, ns, {K[50]: payload(51)})  # one block in DRAM
        size = path.stat().st_size
        _hdr, pay = _where(store, ns, K[9])
        os.truncate(path, pay + SECTOR)  # cuts K[9]'s payload short
        assert await get(store, s, ns, [K[9]]) == []  # detected: a miss
        dev = store.flash.devices[0]
        assert not dev.healthy and dev.health_reason == "truncated"
        assert store.counters["flash_read_errors"] == 1
        assert store.counters["flash_device_failures"] == 1
        assert await get(store, s, ns, [K[50]]) == [payload(51)]  # DRAM keeps serving
        assert await get(store, s, ns, [K[0]]) == []  # flash blocks are misses meanwhile
        os.truncate(path, size)  # the device is whole again (the cut bytes are zeros)
        await until_async(lambda: dev.healthy, 2, "the device's probe to find it whole", 0.02)
        assert store.counters["flash_device_recoveries"] == 1
        assert await get(store, s, ns, [K[0]]) == [data[K[0]]]
        # K[9]'s payload came back as zeros: now a record that fails its check.
        await _is_miss_counted_quarantined(store, s, ns, K[9], {K[1]: data[K[1]]})
    finally:
        await store.close()


async def test_device_truncated_while_stopped_loses_only_the_cut_blocks(tmp_path: Path) -> None:
    path = tmp_path / "f.img"
    flash = make_flash(path, 8 << 20)
    cfg = store_config()
    store = await open_store(cfg, flash)
    s, ns, data = await _durable(store, 40)  # 64 KiB blocks, 15 per 1 MiB slab: 3 slabs
    await store.close()
    os.truncate(path, (1 << 20) + 2 * (1 << 20))  # keeps slabs 0 and 1 only
    store = await open_store(cfg, flash)
    try:
        s, ns = session(store)
        assert store.counters["recovered_blocks"] == 30
        got = {k: await get(store, s, ns, [k]) for k in data}
        assert all(v in ([], [data[k]]) for k, v in got.items())  # exact or a miss
        assert sum(1 for v in got.values() if v) == 30
    finally:
        await store.close()


async def test_device_swapped_under_the_service_is_detected(tmp_path: Path) -> None:
    a, b = tmp_path / "a.img", tmp_path / "b.img"
    flash = [*make_flash(a), ("flash1", str(make_flash(b)[0][1]))]
    store = await open_store(store_config(), flash)
    try:
        s, ns, data = await _durable(store, 12)
        on_a = [k for k in data if store.index[ns.digest][k].flash.device == 0]
        da, db = a.read_bytes(), b.read_bytes()
        patch_file(a, 0, db)  # each file now holds the other device
        patch_file(b, 0, da)
        assert await get(store, s, ns, [on_a[0]]) == []  # a miss, never the other's data
        dev = store.flash.devices[0]
        assert not dev.healthy and dev.health_reason == "swapped or unreadable"
        assert store.stats()["flash_quarantined_slots"] == 0  # nothing of its is touched
        patch_file(a, 0, da)
        patch_file(b, 0, db)
        # Bounded; the gets below say whether they came back.
        await read_until_async(lambda: all(d.healthy for d in store.flash.devices), bool,
                               2, 0.02)
        for k, v in data.items():
            assert await get(store, s, ns, [k]) == [v]
    finally:
        await store.close()
    # Swapped while stopped: each device is recognised by its own superblock.
    swapped = [("flash0", str(b)), ("flash1", str(a))]
    store = await open_store(store_config(), swapped)
    try:
        s, ns = session(store)
        for k, v in data.items():
            assert await get(store, s, ns, [k]) == [v]
    finally:
        await store.close()


async def test_stale_extent_of_a_deleted_block_is_a_miss(tmp_path: Path) -> None:
    path = tmp_path / "f.img"
    flash = make_flash(path)
    store = await open_store(store_config(), flash)
    try:
        s, ns, data = await _durable(store, 6)
        hdr, pay = _where(store, ns, K[0])
        stale_hdr, stale_pay = _read(path, hdr, SECTOR), _read(path, pay, 64 << 10)
        assert await store.delete(ns, [K[0]]) == 1
        # The deleted block's record written back over another live block's extent.
        hdr3, pay3 = _where(store, ns, K[3])
        patch_file(path, hdr3, stale_hdr)
        patch_file(path, pay3, stale_pay)
        await _is_miss_counted_quarantined(store, s, ns, K[3], {K[4]: data[K[4]]})
        assert await get(store, s, ns, [K[0]]) == []  # the deleted key stays deleted
    finally:
        await store.close()
    store = await open_store(store_config(), flash)
    try:
        s, ns = session(store)
        # A restart finds the stale record, but its ciphertext was made for another
        # extent (XTS tweak): it fails its CRC and is never served.
        assert await get(store, s, ns, [K[0]]) == []
        assert await get(store, s, ns, [K[3]]) == []
        assert await get(store, s, ns, [K[4]]) == [data[K[4]]]
    finally:
        await store.close()


async def test_block_from_another_namespace_is_a_miss(tmp_path: Path) -> None:
    path = tmp_path / "f.img"
    store = await open_store(store_config(), make_flash(path))
    try:
        sa, na = session(store, "alice")
        sb, nb = session(store, "bob")
        await put(store, sa, na, {K[0]: payload(1), K[1]: payload(2)})
        await put(store, sb, nb, {K[0]: payload(9)})
        assert await store.evict(na, [K[0], K[1]], "dram") == 2
        assert await store.evict(nb, [K[0]], "dram") == 1
        hb, pb_ = _where(store, nb, K[0])
        ha, pa = _where(store, na, K[0])
        patch_file(path, ha, _read(path, hb, SECTOR))  # bob's record over alice's extent
        patch_file(path, pa, _read(path, pb_, 64 << 10))
        await _is_miss_counted_quarantined(store, sa, na, K[0], {K[1]: payload(2)})
        assert await get(store, sb, nb, [K[0]]) == [payload(9)]  # bob's own is intact
    finally:
        await store.close()


async def test_damaged_superblock_copy_is_restored(tmp_path: Path) -> None:
    path = tmp_path / "f.img"
    flash = make_flash(path)
    store = await open_store(store_config(), flash)
    s, ns, data = await _durable(store, 3)
    await store.close()
    patch_file(path, 8, b"\xff")  # the primary superblock's version field
    report = check_devices(flash, MASTER)
    assert [p.kind for d in report.devices for p in d.problems] == ["superblock_copy_damaged"]
    store = await open_store(store_config(), flash)  # restores it from the backup copy
    try:
        s, ns = session(store)
        for k, v in data.items():
            assert await get(store, s, ns, [k]) == [v]
    finally:
        await store.close()
    assert check_devices(flash, MASTER).errors == 0


async def test_check_repairs_a_damaged_slab_header(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "f.img"
    flash = make_flash(path)
    store = await open_store(store_config(), flash)
    s, ns, data = await _durable(store, 5)
    await store.close()
    patch_file(path, 1 << 20, bytes(SECTOR))  # slab 0's header
    store = await open_store(store_config(), flash)
    try:
        s, ns = session(store)
        assert store.counters["recovered_blocks"] == 0  # invisible: lost, never wrong
    finally:
        await store.close()
    dev = f"--device=flash0={path}"
    env_key = MASTER.hex()
    os.environ["CTXMEM_MASTER_KEY"] = env_key
    try:
        assert check_command([dev]) == 4  # found, not repaired
        assert "slab_header_damaged" in capsys.readouterr().out
        assert check_command([dev, "--repair"]) == 1  # found and repaired
        assert check_command([dev]) == 0
    finally:
        del os.environ["CTXMEM_MASTER_KEY"]
    store = await open_store(store_config(), flash)
    try:
        s, ns = session(store)
        for k, v in data.items():
            assert await get(store, s, ns, [k]) == [v]
    finally:
        await store.close()


async def test_check_finds_and_repairs_bad_and_duplicate_records(tmp_path: Path) -> None:
    path = tmp_path / "f.img"
    flash = make_flash(path)
    store = await open_store(store_config(), flash)
    s, ns, data = await _durable(store, 6)
    _h0, p0 = _where(store, ns, K[0])
    h1, _p1 = _where(store, ns, K[1])
    h2, _p2 = _where(store, ns, K[2])
    await store.close()
    patch_file(path, p0 + 5, b"\x00\x01")  # K[0]: payload CRC fails
    patch_file(path, h2, _read(path, h1, SECTOR))  # K[1]'s header over K[2]'s (K[2] lost)...
    patch_file(path, h2 + REC_SIZE - 1, b"\x00")  # ...and torn: its header CRC fails
    report = check_devices(flash, MASTER)
    kinds = sorted(p.kind for d in report.devices for p in d.problems)
    assert kinds == ["payload_crc", "record_header_corrupt"], kinds
    assert report.errors == 1 and report.warnings == 1
    patch_file(path, h2, _read(path, h1, SECTOR))  # an intact copy of K[1]'s header
    report = check_devices(flash, MASTER)
    kinds = sorted(p.kind for d in report.devices for p in d.problems)
    # The copy names K[1], but the payload in that extent is K[2]'s: its CRC fails.
    assert kinds == ["payload_crc", "payload_crc"], kinds
    repaired = check_devices(flash, MASTER, repair=True)
    assert repaired.repaired == 2
    after = check_devices(flash, MASTER)
    assert after.errors == 0 and after.blocks == 4  # K[1], K[3..5]
    store = await open_store(store_config(), flash)
    try:
        s, ns = session(store)
        assert store.stats()["flash_used_bytes"] == sum(d.used_bytes for d in after.devices)
        for k in (K[1], K[3], K[4], K[5]):
            assert await get(store, s, ns, [k]) == [data[k]]
        assert store.lookup(ns, [K[0]], prefix=True)[0] == 0
    finally:
        await store.close()

