"""``store/room.py`` and ``store/flash_room.py``, making room: which blocks lose their
DRAM copy when a put needs room, in which order, which are demoted first and which only
dropped; which flash blocks a demotion evicts, in which order, and when a pod's shared
device leases a free slab instead (a real redis-server and ``SlabLeaseKeeper``).

A store's parts (``parts.py``): eight 1 MiB DRAM slabs of four 256 KiB blocks, DRAM only,
or with one 8 MiB flash file of 1 MiB slabs (three blocks a slab)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from ctxmem_common.errors import ResourceExhausted
from ctxmem_dpu.blocks import Block
from ctxmem_dpu.pod.slab_leases import SlabLeaseKeeper, SlabLeases
from ctxmem_dpu.tiers.flash import FlashDevice, FlashTier
from ctxmem_dpu.tiers.flash_fence import SlabFence

from ..pod.podkit import DEVICE, format_shared
from .parts import SLOT, MiB, Parts, keys_of, parts, where


def _in_dram(p: Parts, blocks: list[Block]) -> list[bytes]:
    return [b.key for b in blocks if b.dram is not None]


async def test_room_is_made_in_lru_order_protected_and_pinned_last() -> None:
    with parts() as p:
        p.session("a")
        ns = p.namespace("a")
        blocks = p.put(ns, "a", 32, dirty=True)  # the whole tier
        for b in blocks[:2]:  # hit twice: protected, evicted after every probation block
            b.hits = 2
            p.index.dram_lru.touch(b, 2)
        blocks[2].pins = 1  # leased: never a victim
        refs = await p.room.reserve_dram(ns, 5)
        gone = blocks[3:8]
        assert [b.dram for b in gone] == [None] * 5
        assert _in_dram(p, blocks) == keys_of(blocks[:3] + blocks[8:])
        assert len(refs) == 5 and len(set(refs)) == 5
        assert p.ctx.counters["evictions_dram"] == 5
        assert p.ctx.counters["dirty_dropped"] == 5  # DRAM only: the copies are lost
        assert p.ctx.counters["demoted_blocks"] == 0  # no flash: nothing is demoted
        assert p.quotas.counters == {("a", "evictions_dram"): 5}
        assert all(b.key not in p.index.namespace(ns.digest) for b in gone)
        assert list(p.index.dram_lru.order())[:3] == [blocks[2], *blocks[8:10]]


async def test_a_put_of_a_tenant_under_its_share_evicts_the_one_over_it() -> None:
    with parts() as p:
        p.session("a")
        p.session("b")
        a_ns, b_ns = p.namespace("a"), p.namespace("b")
        b_blocks = p.put(b_ns, "b", 4)  # the least recently used: still never b's
        a_blocks = p.put(a_ns, "a", 28)  # 7 slabs: 3 over a's share
        await p.room.reserve_dram(b_ns, 8)
        # a's LRU blocks until whole slabs came free (4 a slab): b's own slab had no room.
        assert _in_dram(p, b_blocks) == keys_of(b_blocks)
        assert _in_dram(p, a_blocks) == keys_of(a_blocks[8:])
        assert p.quotas.counters == {("a", "evictions_dram"): 8}
        assert p.slabs() == {"a": 5, "b": 3}


async def test_a_put_refused_past_the_tenants_ceiling_evicts_nothing() -> None:
    with parts(quotas={"tenants": {"a": {"dram_max": 0.25}}}) as p:  # 2 slabs
        p.session("a")
        ns = p.namespace("a")
        blocks = p.put(ns, "a", 4)
        with pytest.raises(ResourceExhausted,
                           match=r"tenant 'a': quota dram_max: a batch of 9 blocks needs "
                                 r"more than the tenant's DRAM ceiling of 2 slabs"):
            await p.room.reserve_dram(ns, 9)
        assert _in_dram(p, blocks) == keys_of(blocks)
        assert p.quotas.counters == {("a", "refusals"): 1}


async def test_a_tier_of_leased_blocks_is_full_and_says_why() -> None:
    with parts(dram="2MiB") as p:
        p.session("a")
        ns = p.namespace("a")
        blocks = p.put(ns, "a", 8)
        for b in blocks:
            b.pins = 1
        with pytest.raises(ResourceExhausted, match=r"DRAM tier full: 1 slots of 262144 "
                                                    r"bytes for tenant 'a' cannot be freed"):
            await p.room.reserve_dram(ns, 1)
        assert (p.ctx.counters["dram_full"], p.ctx.counters["evictions_dram"]) == (1, 0)
        with pytest.raises(ResourceExhausted, match=r"a batch of 9 blocks needs more DRAM "
                                                    r"than the tier holds \(8 blocks"):
            await p.room.reserve_dram(ns, 9)


async def test_dram_victims_on_flash_are_dropped_and_the_others_demoted_first(
        tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img", flash={"demote_batch": 2}) as p:
        p.session("a")
        ns = p.namespace("a")
        blocks = p.put(ns, "a", 32, dirty=True)  # the whole tier
        assert await p.demoter.demote(blocks[:1]) == {}  # durable on flash already
        blocks[1].origin = b"entry"  # a copy fetched from a peer: DRAM only, not dirty
        del p.index.dirty[blocks[1]]
        refs = await p.room.reserve_dram(ns, 3)
        assert len(refs) == 3
        # In LRU order: block 0 (on flash) and block 1 (a copy) dropped in place, no slab
        # free yet; then blocks 2-4 demoted together (max(3, demote_batch) = 3 victims),
        # then dropped; block 5 on is untouched.
        assert where(blocks[:6]) == ["flash", "gone", "flash", "flash", "flash", "dram"]
        assert blocks[1].key not in p.index.namespace(ns.digest)
        assert keys_of(p.index.flash_lru.order()) == keys_of(blocks[:1] + blocks[2:5])
        assert keys_of(list(p.index.dirty)) == keys_of(blocks[5:])
        assert (p.ctx.counters["evictions_dram"], p.ctx.counters["demoted_blocks"],
                p.ctx.counters["dirty_dropped"], p.ctx.counters["evictions_flash"]) == \
            (5, 4, 0, 0)
        assert p.index.audit(flash_enabled=True) == []


async def test_flash_victims_go_in_flash_lru_order_and_their_extents_are_reused(
        tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        p.session("a")
        ns = p.namespace("a")
        room = p.flash_room.free(SLOT)
        assert room == 21  # seven 1 MiB slabs of three 256 KiB extents
        old = p.put(ns, "old", room, dirty=True)
        assert await p.demoter.demote(old) == {}
        assert p.flash_room.free(SLOT) == 0  # flash full
        p.room.drop_dram_many(old[1:])  # old 0 stays in DRAM too
        old[1].pins = 1  # leased: never a victim
        victims = [old[0], old[2], old[3]]
        extents = {(b.flash.device, b.flash.slot) for b in victims if b.flash is not None}
        new = p.put(ns, "new", 3, dirty=True)
        assert await p.demoter.demote(new) == {}
        # The flash LRU's first three unpinned blocks: old 0 keeps its DRAM copy and is
        # dirty again; old 2 and 3 had none and are gone. The new blocks took their
        # extents, whose headers now name them.
        assert where(old[:5]) == ["dram", "flash", "gone", "gone", "flash"]
        assert keys_of(list(p.index.dirty)) == keys_of(old[:1])
        assert {(b.flash.device, b.flash.slot) for b in new if b.flash is not None} == extents
        dev = p.ctx.flash.devices[0]
        for b in new:
            assert b.flash is not None
            hdr = dev.read_header(b.flash.slot)
            assert hdr is not None and (hdr.key, hdr.seq) == (b.key, b.seq)
        assert keys_of(p.index.flash_lru.order()) == keys_of([old[1], *old[4:], *new])
        assert p.ctx.counters["evictions_flash"] == 3
        assert p.quotas.counters == {("a", "evictions_dram"): 20, ("a", "evictions_flash"): 3}
        old[1].pins = 0
        assert p.index.audit(flash_enabled=True) == []


async def test_evict_makes_blocks_durable_then_drops_their_dram_copies(tmp_path: Path
                                                                      ) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        p.session("a")
        ns = p.namespace("a")
        blocks = p.put(ns, "a", 4, dirty=True)
        blocks[1].pins = 1  # leased: made durable, its DRAM copy kept
        n = await p.room.evict(p.index.get(ns.digest), keys_of(blocks[:3]))
        assert n == 2
        assert where(blocks) == ["flash", "dram+flash", "flash", "dram"]
        assert keys_of(list(p.index.dirty)) == keys_of(blocks[3:])
        blocks[1].pins = 0
        assert p.index.audit(flash_enabled=True) == []


async def test_on_shared_flash_slabs_are_leased_before_any_block_is_evicted(
        tmp_path: Path, redis_server: Any) -> None:
    path = str(tmp_path / "shared.img")
    uuid = format_shared(path, MiB, size=MiB + 4 * MiB)  # four slabs, three extents each
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        with parts() as p:
            dev = FlashDevice(0, DEVICE, path, MiB, p.cfg.flash.o_direct, True,
                              SlabFence(DEVICE, "n1"))
            try:
                p.ctx.flash = FlashTier([dev])  # as BlockStore.start: once it is open
                mine, other = SlabLeases(client, "n1", 30.0), SlabLeases(client, "n2", 30.0)
                keeper = SlabLeaseKeeper(mine, [dev], p.ctx.io.run, spare=0,
                                         dead_grace_s=0.0)
                await keeper.attach()
                p.flash_room.attach_keeper(keeper)
                with pytest.raises(AssertionError, match="a keeper is attached already"):
                    p.flash_room.attach_keeper(keeper)
                p.session("a")
                ns = p.namespace("a")
                first = p.put(ns, "first", 6, dirty=True)
                assert await p.demoter.demote(first) == {}
                # Six extents: one slab leased, not enough, a second: no block evicted.
                held = await mine.holders(uuid, [0, 1, 2, 3])
                assert [h and h[0] for h in held] == ["n1", "n1", None, None]
                assert (p.ctx.counters["evictions_flash"], dev.alloc.free_slabs) == (0, 0)
                for slab in (2, 3):  # another node takes the rest: none can be leased
                    assert await other.grant(uuid, slab) is not None
                second = p.put(ns, "second", 3, dirty=True)
                assert await p.demoter.demote(second) == {}
                # So the first three blocks' flash copies are evicted (LRU), in slab 0.
                assert where(first) == ["dram"] * 3 + ["dram+flash"] * 3
                assert where(second) == ["dram+flash"] * 3
                assert p.ctx.counters["evictions_flash"] == 3
                assert {b.flash.slot.slab for b in second if b.flash is not None} == {0}
                held = await mine.holders(uuid, [0, 1, 2, 3])
                assert [h and h[0] for h in held] == ["n1", "n1", "n2", "n2"]
            finally:
                dev.close()
    finally:
        await client.aclose()
