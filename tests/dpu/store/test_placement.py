"""``store/placement.py`` over ``tiers/dram.py``: which blocks lose their DRAM copy when
a put needs room, in which order, and what is counted, on a DRAM-only tier of eight 1 MiB
slabs (four blocks a slab; no flash, so a victim is dropped rather than demoted)."""

from __future__ import annotations

import pytest

from ctxmem_common.errors import ResourceExhausted
from ctxmem_dpu.blocks import Block

from .parts import Parts, keys_of, parts


async def _no_demote(_blocks: list[Block]) -> object:
    raise AssertionError("no flash: nothing may be demoted")


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
        refs = await p.placement.reserve_dram(ns, 5, _no_demote)
        gone = blocks[3:8]
        assert [b.dram for b in gone] == [None] * 5
        assert _in_dram(p, blocks) == keys_of(blocks[:3] + blocks[8:])
        assert len(refs) == 5 and len(set(refs)) == 5
        assert p.ctx.counters["evictions_dram"] == 5
        assert p.ctx.counters["dirty_dropped"] == 5  # DRAM only: the copies are lost
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
        await p.placement.reserve_dram(b_ns, 8, _no_demote)
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
            await p.placement.reserve_dram(ns, 9, _no_demote)
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
            await p.placement.reserve_dram(ns, 1, _no_demote)
        assert (p.ctx.counters["dram_full"], p.ctx.counters["evictions_dram"]) == (1, 0)
        with pytest.raises(ResourceExhausted, match=r"a batch of 9 blocks needs more DRAM "
                                                    r"than the tier holds \(8 blocks"):
            await p.placement.reserve_dram(ns, 9, _no_demote)
