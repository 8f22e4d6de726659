"""``store/quotas.py``: fair shares, ceilings, held-slab caps and the order in which
DRAM and flash victims are offered across tenants, on a DRAM tier of eight 1 MiB slabs
(four blocks a slab) and an 8 MiB flash file, whose every slab and LRU position the test
places by hand (``parts.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ctxmem_common.errors import ResourceExhausted
from ctxmem_dpu.blocks import Block, Lease

from .parts import SLOT, Parts, keys_of, parts


def _no_skip(_b: Block) -> bool:
    return False


def test_the_fair_share_divides_the_tier_among_tenants_with_a_session() -> None:
    with parts(quotas={"tenants": {"vip": {"dram_guaranteed": 0.25},
                                   "small": {"dram_max": 0.5, "dram_held_max": 0.25}}}) as p:
        assert p.quotas.dram_guaranteed("a") == 0  # no session: no share
        p.session("a")
        assert p.quotas.dram_guaranteed("a") == 8  # alone: the whole tier
        p.session("b")
        assert [p.quotas.dram_guaranteed(t) for t in ("a", "b")] == [4, 4]
        p.session("c")
        assert [p.quotas.dram_guaranteed(t) for t in ("a", "b", "c")] == [2, 2, 2]  # 8 // 3
        assert p.quotas.dram_guaranteed("idle", {"a", "b", "c"}) == 0  # no session, no share
        assert p.quotas.dram_guaranteed("vip", set()) == 2  # configured: kept without one
        assert [p.quotas.dram_ceiling(t) for t in ("a", "small")] == [8, 4]
        # Held slabs: the tier less the other active tenants' guarantees, or configured.
        assert p.quotas.held_cap("a") == 8 - 2 - 2
        assert p.quotas.held_cap("small") == 2


def test_a_request_of_a_tenant_under_its_share_takes_from_those_over_theirs() -> None:
    with parts() as p:
        p.session("a")
        p.session("b")
        a_ns, b_ns = p.namespace("a"), p.namespace("b")
        a_old = p.put(a_ns, "a-old", 12)  # slabs 0-2
        b_all = p.put(b_ns, "b", 4)  # slab 3
        a_new = p.put(a_ns, "a-new", 12)  # slabs 4-6: a owns 6, over its 4; b owns 1
        assert p.slabs() == {"a": 6, "b": 1}
        # b is under its guarantee: a's blocks in LRU order, then b's own, last.
        assert keys_of(list(p.quotas.dram_victims("b", _no_skip))) == \
            keys_of(a_old + a_new + b_all)
        # a is over its guarantee: its own in LRU order, and b (under its share) is safe.
        assert keys_of(list(p.quotas.dram_victims("a", _no_skip))) == keys_of(a_old + a_new)
        # Skipped blocks (pinned, in flight) are never offered.
        pinned = {a_old[0], a_new[5]}
        assert keys_of(list(p.quotas.dram_victims("a", lambda b: b in pinned))) == \
            keys_of([b for b in a_old + a_new if b not in pinned])


def test_a_tenant_at_exactly_its_share_evicts_its_own_first() -> None:
    with parts() as p:
        p.session("a")
        p.session("b")
        idle = p.put(p.namespace("gone"), "gone", 8)  # no session: nothing guaranteed
        mine = p.put(p.namespace("a"), "a", 16)  # 4 slabs: a's guarantee exactly
        assert p.slabs() == {"a": 4, "gone": 2}
        assert keys_of(list(p.quotas.dram_victims("a", _no_skip))) == keys_of(mine + idle)
        # b, under its share, takes the idle tenant's, then its own (none), never a's.
        assert keys_of(list(p.quotas.dram_victims("b", _no_skip))) == keys_of(idle)


def test_a_tenant_evicted_down_to_its_share_is_left_alone() -> None:
    with parts() as p:
        p.session("a")
        p.session("b")
        a_ns, b_ns = p.namespace("a"), p.namespace("b")
        a_blocks = p.put(a_ns, "a", 24)  # 6 slabs, 2 over its guarantee of 4
        b_blocks = p.put(b_ns, "b", 4)
        taken: list[Block] = []
        for b in p.quotas.dram_victims("b", _no_skip):
            taken.append(b)
            if b.ns == a_ns.digest:  # evict it as the room does: its slot goes back
                assert b.dram is not None
                p.ctx.dram.free(b.dram)
                b.dram = None
                p.index.dram_lru.remove(b)
        # Two whole slabs of a (its LRU blocks fill slabs in order), then b's own blocks:
        # the check is redone once a slab is freed, and a at 4 slabs is at its share.
        assert keys_of(taken) == keys_of(a_blocks[:8] + b_blocks)
        assert p.slabs() == {"a": 4, "b": 1}


def test_a_tenant_at_its_ceiling_only_reuses_its_own_slabs() -> None:
    with parts(quotas={"tenants": {"b": {"dram_max": 0.125}}}) as p:  # 1 slab
        p.session("a")
        p.session("b")
        a_blocks = p.put(p.namespace("a"), "a", 28)  # 7 slabs: far over its share
        b_blocks = p.put(p.namespace("b"), "b", 4)
        assert keys_of(list(p.quotas.dram_victims("b", _no_skip))) == keys_of(b_blocks)
        p.ctx.dram.free(b_blocks[0].dram)  # type: ignore[arg-type]
        assert p.quotas.fits_ceiling(p.tables.namespaces[b_blocks[0].ns], 1)
        assert not p.quotas.fits_ceiling(p.tables.namespaces[b_blocks[0].ns], 2)
        assert len(a_blocks) == 28


def test_blocks_of_a_tenant_without_a_session_are_offered_to_everyone() -> None:
    with parts() as p:
        p.session("a")
        idle = p.put(p.namespace("gone"), "gone", 8)  # its sessions ended: no guarantee
        mine = p.put(p.namespace("a"), "a", 4)
        assert [p.quotas.tenant_of(b) for b in (idle[0], mine[0])] == ["gone", "a"]
        # a (alone: its share is the whole tier) is under it: the idle tenant's blocks,
        # then its own.
        assert keys_of(list(p.quotas.dram_victims("a", _no_skip))) == keys_of(idle + mine)


def test_a_lease_fits_up_to_the_held_cap_and_the_refusal_says_so() -> None:
    with parts(quotas={"tenants": {"a": {"dram_held_max": 0.25}}}) as p:  # 2 slabs
        p.session("a")
        run = p.put(p.namespace("a"), "a", 12)  # slabs 0, 1, 2
        assert p.quotas.fit_lease("a", run) == 8  # the third slab's first block is cut
        assert p.quotas.fit_lease("a", run[8:]) == 4  # alone: one slab
        assert p.quotas.counters == {}
        # Held slabs count: with slots of two slabs held, a new slab is refused.
        p.tables.leases[b"L"] = _lease(p, run[:8])
        assert p.quotas.fit_lease("a", run[4:8]) == 4  # already held: fine
        with pytest.raises(ResourceExhausted,
                           match=r"tenant 'a': quota dram_held_slabs: .* in 2 DRAM slabs, "
                                 r"limit 2; .*dram_held_max"):
            p.quotas.fit_lease("a", run[8:])
        assert p.quotas.counters == {("a", "refusals"): 1}
        assert p.ctx.counters["quota_refusals"] == 1


def test_stats_name_the_first_tenants_and_sum_the_rest() -> None:
    with parts(quotas={"stats_tenants": 2}) as p:
        for t in ("a", "b", "c", "d"):
            p.put(p.namespace(t), t, 4)
            p.quotas.count(t, "evictions_dram", 3)
        snap = p.quotas.snapshot()
        assert {k: v for k, v in snap.items() if k.endswith("dram_slabs")} == {
            "tenant.a.dram_slabs": 1.0, "tenant.b.dram_slabs": 1.0,
            "tenant._other.dram_slabs": 2.0}
        assert {k: v for k, v in snap.items() if k.endswith("evictions_dram")} == {
            "tenant.a.evictions_dram": 3.0, "tenant.b.evictions_dram": 3.0,
            "tenant._other.evictions_dram": 6.0}


def _lease(p: Parts, blocks: list[Block]) -> Lease:
    return Lease(b"L", b"S", p.tables.namespaces[blocks[0].ns], blocks, float("inf"))


async def _on_flash(p: Parts, tenant: str, n: int) -> list[Block]:
    """``n`` blocks of ``tenant`` made durable on flash (their DRAM copies kept)."""
    blocks = p.put(p.namespace(tenant), tenant, n, dirty=True)
    assert await p.demotion().demote(blocks) == {}
    return blocks


async def test_flash_victims_take_from_the_tenant_over_its_share_until_it_is_at_it(
        tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        p.session("a")
        p.session("b")
        # 7 MiB of slabs: a share of 3.5 MiB (14 slots) each; room for 21 slots (three a
        # slab beside its header table).
        a_blocks = await _on_flash(p, "a", 16)
        b_blocks = await _on_flash(p, "b", 4)
        share = p.quotas.flash_guaranteed("a", {"a", "b"})
        assert share == p.ctx.flash.capacity_bytes() // 2 == 14 * SLOT
        assert p.quotas.flash_bytes() == {"a": 16 * SLOT, "b": 4 * SLOT}
        over = 2  # a's blocks above its share
        taken: list[Block] = []
        for b in p.quotas.flash_victims("b", _no_skip):
            taken.append(b)
            p.quotas.flash_evicted(b)  # as the flash room does: usage follows the walk
        # a's oldest until it is at its share, then b's own (b is under its share).
        assert keys_of(taken) == keys_of(a_blocks[:over] + b_blocks)
        assert p.quotas.counters == {("a", "evictions_flash"): over,
                                     ("b", "evictions_flash"): 4}


async def test_a_tenant_over_its_flash_ceiling_evicts_only_its_own(tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img",
               quotas={"tenants": {"a": {"flash_guaranteed": 0.0625, "flash_max": 0.125}}}
               ) as p:
        p.session("a")
        p.session("b")
        b_blocks = await _on_flash(p, "b", 16)  # b over its share (14 slots)
        a_blocks = await _on_flash(p, "a", 4)
        assert p.quotas.flash_ceiling("a") <= 4 * SLOT  # and over its guarantee
        assert keys_of(list(p.quotas.flash_victims("a", _no_skip))) == keys_of(a_blocks)
        # Demoting several tenants' blocks at once (None): whoever is over their share, in
        # flash LRU order (usage as it stands: nothing is evicted here).
        assert keys_of(list(p.quotas.flash_victims(None, _no_skip))) == \
            keys_of(b_blocks + a_blocks)


async def test_a_tenant_at_its_flash_ceiling_below_its_fair_share_evicts_only_its_own(
        tmp_path: Path) -> None:
    """``flash_max`` below the fair share: the tenant reaches its ceiling while under its
    guarantee. At the ceiling it makes room among its own blocks only (docs/security.md,
    "Fair eviction"), never another tenant's, and not nothing (before, the walk returned
    before its own blocks: its demotions found no room at all)."""
    with parts(flash_file=tmp_path / "f.img",
               quotas={"tenants": {"a": {"flash_max": 0.125}}}) as p:
        p.session("a")
        p.session("b")
        b_blocks = await _on_flash(p, "b", 16)  # b over its share (14 slots)
        a_blocks = await _on_flash(p, "a", 4)
        ceiling = p.quotas.flash_ceiling("a")
        share = p.quotas.flash_guaranteed("a", {"a", "b"})
        assert ceiling <= 4 * SLOT < share == 14 * SLOT  # at its ceiling, under its share
        taken: list[Block] = []
        for b in p.quotas.flash_victims("a", _no_skip):
            taken.append(b)
            p.quotas.flash_evicted(b)
        assert keys_of(taken) == keys_of(a_blocks)
        assert p.quotas.counters == {("a", "evictions_flash"): 4}
        assert b_blocks  # (b's blocks, over b's share, were not offered to a)
