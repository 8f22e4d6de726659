"""BlockStore behaviour on real files: placement, eviction, integrity, leases, recovery."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from ctxmem_common.errors import Expired, ResourceExhausted
from ctxmem_common.flash_format import SECTOR

from .storekit import LAYOUT, get, make_flash, open_store, payload, put, session, store_config

K = [bytes([i]) * 8 for i in range(200)]


async def test_dram_eviction_demotes_and_flash_serves(tmp_path: Path) -> None:
    store = await open_store(store_config(), make_flash(tmp_path / "f.img"))
    try:
        s, ns = session(store)
        data = {K[i]: payload(i + 1) for i in range(100)}  # 6.25 MiB into a 4 MiB DRAM tier
        for i in range(0, 100, 10):
            await put(store, s, ns, {k: data[k] for k in K[i:i + 10]})
        st = store.stats()
        assert st["evictions_dram"] > 0 and st["blocks"] == 100
        got: list[bytes] = []
        while len(got) < 100:  # the shim's loop: a run is cut where DRAM is full
            part = await get(store, s, ns, K[len(got):100])
            assert part, f"run stopped at {len(got)}"
            got += part
        assert got == [data[k] for k in K[:100]]
        assert store.counters["hits_flash"] > 0
    finally:
        await store.close()


async def test_corrupt_flash_block_is_a_miss_counted_and_quarantined(tmp_path: Path) -> None:
    store = await open_store(store_config(), make_flash(tmp_path / "f.img"))
    try:
        s, ns = session(store)
        await put(store, s, ns, {K[0]: payload(1), K[1]: payload(2), K[2]: payload(3)})
        assert await store.evict(ns, K[:3], "dram") == 3
        b1 = store.index[ns.digest][K[1]]
        assert b1.flash is not None
        dev = store.flash.devices[0]
        off = dev.payload_offset(b1.flash.slot) + 100
        with open(tmp_path / "f.img", "r+b") as f:  # flip one bit of block 1's ciphertext
            f.seek(off)
            byte = f.read(1)
            f.seek(off)
            f.write(bytes([byte[0] ^ 0x01]))
        got = await get(store, s, ns, K[:3])
        assert got == [payload(1)]  # the run stops at the corrupt block: a miss, not data
        assert store.counters["integrity_failures"] == 1
        assert store.lookup(ns, K[:3], prefix=True)[0] == 1
        assert b1.flash is None and len(dev.alloc.quarantined) == 1
    finally:
        await store.close()


async def test_leased_blocks_are_never_evicted_and_full_dram_is_resource_exhausted(
    tmp_path: Path,
) -> None:
    store = await open_store(store_config(), None)  # DRAM only: 64 slots of 64 KiB
    try:
        s, ns = session(store)
        data = {K[i]: payload(i + 1) for i in range(64)}
        await put(store, s, ns, data)
        lease1, _ = await store.acquire(s, ns, K[:64])
        assert len(lease1.blocks) == 32  # one lease holds at most half the tier
        lease2, _ = await store.acquire(s, ns, K[32:64])
        assert len(lease2.blocks) == 32
        with pytest.raises(ResourceExhausted, match="DRAM tier full"):
            await store.allocate(s, ns, K[64:70])
        assert store.lookup(ns, K[:64], prefix=True)[0] == 64  # nothing leased was evicted
        store.release(s, [lease1.id, lease2.id])
        a, _ = await store.allocate(s, ns, K[64:70])  # now evictable
        assert len(a.slots) == 6
    finally:
        await store.close()


async def test_oversized_batch_is_refused_clearly(tmp_path: Path) -> None:
    store = await open_store(store_config(), None)
    try:
        s, ns = session(store)
        with pytest.raises(ResourceExhausted, match="more DRAM than the tier holds"):
            await store.allocate(s, ns, K[:65])
    finally:
        await store.close()


async def test_expired_allocation_and_lease(tmp_path: Path) -> None:
    store = await open_store(store_config(allocation_ttl_s=0.2, lease_ttl_s=0.2), None)
    try:
        s, ns = session(store)
        a, _ = await store.allocate(s, ns, [K[0]])
        await asyncio.sleep(0.6)
        with pytest.raises(Expired, match="allocate again"):
            await store.commit(s, a.id, [], False)
        assert store.dram.used_bytes() == 0  # its slot went back
        await put(store, s, ns, {K[1]: payload(5)})
        lease, _ = await store.acquire(s, ns, [K[1]])
        await asyncio.sleep(0.6)
        assert store.release(s, [lease.id]) == [False]
        assert store.counters["expired_leases"] == 1
    finally:
        await store.close()


async def test_client_crc_mismatch_drops_the_block(tmp_path: Path) -> None:
    store = await open_store(store_config(), None)
    try:
        s, ns = session(store)
        a, _ = await store.allocate(s, ns, [K[0], K[1]])
        for ref in a.slots:
            store.dram.view(ref, ns.block_nbytes)[:] = payload(9)
        from ctxmem_common.codecs import crc32c

        good = crc32c(payload(9))
        assert await store.commit(s, a.id, [good, good ^ 1], False) == 1
        assert store.lookup(ns, [K[0], K[1]], prefix=False)[1] == ["dram", ""]
    finally:
        await store.close()


@pytest.mark.parametrize("encryption", [True, False])
async def test_restart_rebuilds_index_from_flash(tmp_path: Path, encryption: bool) -> None:
    flash = make_flash(tmp_path / "f.img")
    cfg = store_config(encryption=encryption)
    store = await open_store(cfg, flash)
    s, ns = session(store)
    data = {K[i]: payload(i + 1) for i in range(20)}
    await put(store, s, ns, data)
    await store.delete(ns, K[15:20])
    await store.close()  # clean shutdown flushes write-back blocks
    store = await open_store(cfg, flash)
    try:
        s, ns = session(store)
        assert store.counters["recovered_blocks"] == 15
        n, tiers = store.lookup(ns, K[:20], prefix=True)
        assert n == 15 and set(tiers) == {"flash"}  # deleted blocks did not come back
        assert await get(store, s, ns, K[:15]) == [data[k] for k in K[:15]]
        # No extent is handed out twice after the rebuild.
        await put(store, s, ns, {K[100 + i]: payload(200 + i) for i in range(10)})
        await store.evict(ns, [K[100 + i] for i in range(10)], "dram")
        assert await get(store, s, ns, K[:15]) == [data[k] for k in K[:15]]
    finally:
        await store.close()


async def test_write_through_is_durable_when_commit_returns(tmp_path: Path) -> None:
    store = await open_store(store_config(write_policy="write_through"),
                             make_flash(tmp_path / "f.img"))
    try:
        s, ns = session(store)
        await put(store, s, ns, {K[0]: payload(1)})
        b = store.index[ns.digest][K[0]]
        assert b.durable and b.flash is not None and b.dram is not None
    finally:
        await store.close()


async def test_tenants_get_separate_slabs(tmp_path: Path) -> None:
    store = await open_store(store_config(), None)
    try:
        s1, ns1 = session(store, "alice")
        s2, ns2 = session(store, "bob")
        assert ns1.digest != ns2.digest
        await put(store, s1, ns1, {K[0]: payload(1)})
        await put(store, s2, ns2, {K[0]: payload(2)})
        slab1 = store.index[ns1.digest][K[0]].dram
        slab2 = store.index[ns2.digest][K[0]].dram
        assert slab1 is not None and slab2 is not None and slab1.slab != slab2.slab
        assert store.dram.region_tenant(slab1.slab) == "alice"
        assert store.dram.region_tenant(slab2.slab) == "bob"
        assert await get(store, s2, ns2, [K[0]]) == [payload(2)]
    finally:
        await store.close()


async def test_a_hot_acquire_starts_no_task(tmp_path: Path) -> None:
    """An Acquire whose blocks are all in DRAM has nothing to promote: it starts no
    promotion task (nor any other), and serves every block from DRAM."""
    store = await open_store(store_config(), make_flash(tmp_path / "f.img"))
    loop = asyncio.get_running_loop()
    started: list[str] = []

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kw: Any) -> asyncio.Task[Any]:
        started.append(getattr(coro, "__qualname__", repr(coro)))
        return asyncio.Task(coro, loop=loop, **kw)

    try:
        s, ns = session(store)
        await put(store, s, ns, {K[i]: payload(i + 1) for i in range(4)})
        loop.set_task_factory(factory)
        try:
            lease, sources = await store.acquire(s, ns, K[:4])
        finally:
            loop.set_task_factory(None)
        assert started == []
        assert len(lease.blocks) == 4 and sources == ["dram"] * 4
        assert store.counters["hits_dram"] == 4 and store.counters["hits_flash"] == 0
        store.release(s, [lease.id])
    finally:
        await store.close()


def test_sector_constant() -> None:
    assert SECTOR == 4096 and LAYOUT.block_nbytes == 64 << 10
