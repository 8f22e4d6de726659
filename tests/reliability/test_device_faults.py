"""ENOSPC, EIO and a slow device, through the fault-injecting file layer: the service
degrades (flash blocks are misses, new blocks stay in DRAM, DRAM keeps serving), never
blocks or crashes, and recovers when the device is healthy again."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ctxmem_common.errors import Unavailable
from ctxmem_dpu import faults
from ctxmem_dpu.store import BlockStore
from tests.kit import read_until_async, until_async

from ..dpu.storekit import FLASH, get, make_flash, open_store, payload, put, session, store_config
from .kit import FaultyService, content, keys, served, settled_audit, tiers
from .kit import put as put_live

K = [bytes([i]) * 8 for i in range(1, 200)]


@pytest.fixture(autouse=True)
def _fast(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(FLASH, "probe_interval_s", 0.05)  # flash.probe_interval_s
    monkeypatch.setitem(FLASH, "slow_io_s", 0.2)  # flash.slow_io_s
    faults.reset()
    yield
    faults.reset()


async def _healthy(store: BlockStore, timeout: float = 5.0) -> None:
    await until_async(lambda: all(d.healthy for d in store.flash.devices), timeout,
                      "every flash device to be healthy again")


@pytest.mark.parametrize("fault", [{"read": "eio"}, {"read": "eio", "prob": 0.5}])
async def test_read_errors_are_misses_and_the_device_recovers(tmp_path: Path,
                                                              fault: dict) -> None:
    store = await open_store(store_config(), make_flash(tmp_path / "f.img"))
    try:
        s, ns = session(store)
        on_flash = {K[i]: payload(i + 1) for i in range(8)}
        await put(store, s, ns, on_flash)
        assert await store.evict(ns, list(on_flash), "dram") == 8
        in_dram = {K[20]: payload(21)}
        await put(store, s, ns, in_dram)
        faults.configure(devices={"flash0": fault})
        t = time.monotonic()
        got = await get(store, s, ns, list(on_flash))
        assert got == [on_flash[k] for k in list(on_flash)[: len(got)]]  # exact or cut short
        assert time.monotonic() - t < 5  # degraded, not stuck
        dev = store.flash.devices[0]
        if len(got) < 8:
            assert not dev.healthy and store.counters["flash_read_errors"] >= 1
        assert await get(store, s, ns, [K[20]]) == [payload(21)]  # DRAM still serves
        await put(store, s, ns, {K[21]: payload(22)})  # and takes new blocks
        assert store.counters["integrity_failures"] == 0  # an I/O error is not corruption
        faults.configure(devices={})
        await _healthy(store)
        assert await get(store, s, ns, list(on_flash)) == list(on_flash.values())
        assert await settled_audit(store) == []
    finally:
        await store.close()


@pytest.mark.parametrize("fault", [{"write": "enospc"}, {"write": "eio"}, {"sync": "eio"}])
async def test_write_errors_keep_blocks_in_dram_until_the_device_is_back(
        tmp_path: Path, fault: dict) -> None:
    store = await open_store(store_config(), make_flash(tmp_path / "f.img"))
    try:
        s, ns = session(store)
        faults.configure(devices={"flash0": fault})
        data = {K[i]: payload(i + 1) for i in range(8)}
        await put(store, s, ns, data)
        assert await store.evict(ns, list(data), "dram") == 0  # cannot be made durable
        # ENOSPC on a file-backed device is a full filesystem, not a failed device.
        assert store.flash.devices[0].healthy == (fault == {"write": "enospc"})
        assert store.counters["flash_write_errors"] >= 1
        assert store.lookup(ns, list(data), prefix=True) == (8, ["dram"] * 8)
        assert await get(store, s, ns, list(data)) == list(data.values())
        faults.configure(devices={})
        await _healthy(store)
        # Parked extents get their headers zeroed, then freed (bounded; the evict says).
        await read_until_async(store.parked_extents, lambda parked: not parked, 2, 0.02)
        assert await store.evict(ns, list(data), "dram") == 8  # durable now
        assert await get(store, s, ns, list(data)) == list(data.values())
        assert await settled_audit(store) == []
    finally:
        await store.close()


async def test_all_flash_failed_degrades_to_a_dram_only_cache(tmp_path: Path) -> None:
    """With every flash device failed, a full DRAM tier drops its oldest non-durable
    blocks (counted) instead of refusing every put."""
    store = await open_store(store_config(dram_size="2MiB"), make_flash(tmp_path / "f.img"))
    try:
        s, ns = session(store)
        faults.configure(devices={"flash0": {"write": "eio", "read": "eio"}})
        await put(store, s, ns, {K[0]: payload(1)})
        await store.evict(ns, [K[0]], "dram")  # fails: marks the device failed
        assert not store.flash.devices[0].healthy
        for i in range(1, 60):  # 2 MiB of DRAM holds 32 blocks of 64 KiB
            await put(store, s, ns, {K[i]: payload(i + 1)})
        assert store.counters["dirty_dropped"] > 0
        assert await get(store, s, ns, [K[59]]) == [payload(60)]
    finally:
        await store.close()


async def test_slow_device_is_taken_out_and_comes_back(tmp_path: Path) -> None:
    store = await open_store(store_config(), make_flash(tmp_path / "f.img"))
    try:
        s, ns = session(store)
        data = {K[i]: payload(i + 1) for i in range(4)}
        await put(store, s, ns, data)
        assert await store.evict(ns, list(data), "dram") == 4
        faults.configure(devices={"flash0": {"delay_s": 0.3}})
        got = await get(store, s, ns, [K[0]])
        assert got in ([], [data[K[0]]])  # slow, but exact
        dev = store.flash.devices[0]
        assert not dev.healthy and dev.health_reason == "slow"
        t = time.monotonic()
        assert await get(store, s, ns, [K[1]]) == []  # no more waits on it: a miss
        assert time.monotonic() - t < 0.2
        faults.configure(devices={})
        await _healthy(store)
        assert await get(store, s, ns, list(data)) == list(data.values())
    finally:
        await store.close()


def test_enospc_on_a_live_service_degrades_and_recovers(tmp_path: Path) -> None:
    """End to end through the shim: health says degraded while the device refuses writes,
    puts and gets keep working from DRAM, and it serves again once space is back."""
    svc = FaultyService(tmp_path / "svc")
    svc.start()
    try:
        ns = svc.ns()
        assert svc.client is not None
        before = keys("enospc/before", 8)
        put_live(ns, before)
        assert ns.evict(before) == 8
        svc.faults(devices={"flash0": {"write": "enospc"}})
        during = keys("enospc/during", 8)
        put_live(ns, during)
        ns.evict(during)  # cannot make them durable
        # A full filesystem is "full", not a failed device: it stays in service.
        assert svc.client.health().status == "degraded: flash device(s) flash0 full"
        assert set(tiers(ns, during)) == {"dram"}
        assert all(served(ns, during).values())
        assert svc.wait_injected("write:enospc") >= 1
        assert svc.stats()["flash_devices_healthy"] == 1
        svc.faults()
        assert ns.evict(during) == 8
        assert svc.client.health().status == "serving"
        assert all(served(ns, before + during).values())
    finally:
        svc.close()


async def test_demoter_does_not_spin_on_failed_or_full_flash(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No demotion attempts while every device is failed; while the flash tier is full of
    pinned blocks, tries back off (at most a few per second) and the warning is logged
    once, not every 20 ms."""
    store = await open_store(store_config(), make_flash(tmp_path / "f.img", size=3 << 20))
    try:
        s, ns = session(store)
        # Full: as many blocks as flash holds, each made durable and then pinned by a lease
        # (a pinned block is never evicted from flash to make room).
        leases = []
        for n in range(40):
            await put(store, s, ns, {K[n]: payload(n + 1)})
            if await store.evict(ns, [K[n]], "dram") != 1:
                break
            leases.append((await store.acquire(s, ns, [K[n]]))[0].id)
        else:
            pytest.fail("a 3 MiB flash file should fill before 40 blocks of 64 KiB")
        assert n >= 1, "the flash file should hold at least one block"
        await put(store, s, ns, {K[i]: payload(i + 1) for i in range(n + 1, n + 9)})
        await asyncio.sleep(0.3)  # the demoter's first tries
        caplog.clear()
        before = store.counters["flash_full"]
        await asyncio.sleep(2.0)
        tries = store.counters["flash_full"] - before
        assert tries <= 4, f"{tries} demotion tries in 2 s on a full flash tier"
        warned = [r for r in caplog.records if "flash tier full" in r.getMessage()]
        assert len(warned) <= 1
        store.release(s, leases)

        # Failed: every device refuses writes; the demoter does not try at all.
        faults.configure(devices={"flash0": {"write": "eio", "read": "eio"}})
        await put(store, s, ns, {K[150]: payload(151)})
        await store.evict(ns, [K[150]], "dram")  # fails: marks the device failed
        assert not store.flash.devices[0].healthy
        before = store.counters["flash_full"]
        await asyncio.sleep(1.0)
        assert store.counters["flash_full"] == before
        assert store.lookup(ns, [K[150]], prefix=True) == (1, ["dram"])
        faults.configure(devices={})
        await _healthy(store)
    finally:
        await store.close()


async def test_a_device_that_moved_is_reopened_where_it_is_now(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A failed device whose probe fails is looked up again through its locator (the
    storage backend's attach(), which finds e.g. a re-added NVMe namespace's new node)
    and reopened there — only if the superblock there is this device's."""
    old, new, other = tmp_path / "old.img", tmp_path / "new.img", tmp_path / "other.img"
    store = await open_store(store_config(), make_flash(old))
    try:
        s, ns = session(store)
        data = {K[i]: payload(i + 1) for i in range(6)}
        await put(store, s, ns, data)
        assert await store.evict(ns, list(data), "dram") == 6  # durable, flash only
        shutil.copyfile(old, new)  # the device, as it will reappear under a new node
        foreign = await open_store(store_config(), make_flash(other))  # another device
        await foreign.close()
        where = {"path": str(other)}
        store.locators["flash0"] = lambda: where["path"]
        os.truncate(old, 0)  # the old node is gone: reads come back short
        assert await get(store, s, ns, [K[0]]) == []  # a miss, and the device is failed
        dev = store.flash.devices[0]
        assert not dev.healthy
        # The locator names a node holding another device: not taken.
        await asyncio.sleep(0.3)
        assert not dev.healthy and dev.path == str(old)
        assert store.counters["flash_device_reopened"] == 0
        assert any("does not hold this device" in r.getMessage() for r in caplog.records)
        # Now it names the device's new node: reopened there, and served again.
        where["path"] = str(new)
        await _healthy(store)
        assert dev.path == str(new) and store.counters["flash_device_reopened"] == 1
        assert await get(store, s, ns, list(data)) == list(data.values())
        assert store.counters["integrity_failures"] == 0
        assert await settled_audit(store) == []
    finally:
        await store.close()


def test_write_through_on_a_failed_device_is_refused_not_kept_in_dram(tmp_path: Path) -> None:
    """Issue 13, case 2, through the shim: with the device failing writes (EIO), a
    write-through put fails with UNAVAILABLE naming the device; nothing of it is stored,
    the refusal is counted, and the service keeps serving what it has."""
    svc = FaultyService(tmp_path / "svc", write_policy="write_through")
    svc.start()
    try:
        ns = svc.ns()
        before = keys("wt/before", 4)
        put_live(ns, before)
        svc.faults(devices={"flash0": {"write": "eio"}})
        during = keys("wt/during", 4)
        with pytest.raises(Unavailable) as err:
            ns.put(during, [content(k) for k in during])
        assert "flash0" in str(err.value) and "Errno" in str(err.value)
        assert ns.lookup(during).num_hits == 0
        st = svc.stats()
        assert st["write_through_failures"] >= len(during) and st["dirty_blocks"] == 0
        assert all(served(ns, before).values())
        svc.faults()
        svc.wait_stat("flash_devices_healthy", 1)
        put_live(ns, during)
        svc.restart()
        ns = svc.ns()
        assert all(served(ns, before + during).values())
    finally:
        svc.close()
