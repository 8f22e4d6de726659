"""``store/promotion.py``: where a get's run is cut. A cold get in pieces stops at the
first flash-only block past its piece and reads the next piece ahead; a promotion DRAM
cannot take whole is halved until it fits, and the blocks left out count as failed, so
the run ends at the first of them (the shim asks for the rest in its next Acquire). Eight
1 MiB DRAM slabs of four blocks each and one 8 MiB flash file (``parts.py``), and the
same through a whole store's Acquire (``storekit``)."""

from __future__ import annotations

from pathlib import Path

from ctxmem_dpu.blocks import Block
from tests import kit

from ..storekit import LAYOUT, get, make_flash, open_store, put, session, store_config
from .parts import SLOT, Parts, keys_of, parts


async def _on_flash_only(p: Parts, tag: str, n: int) -> list[Block]:
    """``n`` blocks made durable on flash, their DRAM copies dropped."""
    blocks = p.put(p.namespace("a"), tag, n, dirty=True)
    assert await p.demotion().demote(blocks) == {}
    p.room.drop_dram_many(blocks)
    assert all(b.dram is None and b.durable for b in blocks)
    return blocks


def test_a_cold_run_is_cut_after_one_piece_and_the_next_is_read_ahead() -> None:
    with parts(flash={"cold_piece_bytes": 3 * SLOT}) as p:  # three blocks a piece
        p.session("a")
        ns = p.namespace("a")
        warm = p.put(ns, "warm", 4)
        cold = [Block(ns.digest, k, SLOT, SLOT, 0, 0) for k in kit.keys("cold", 8)]
        # warm, cold 0-1, warm, cold 2-7: the cut is at the fourth cold block (cold 3),
        # the piece after it (cold 3-5) is read ahead; warm blocks count for nothing.
        run = [warm[0], cold[0], cold[1], warm[1], *cold[2:]]
        promotion = p.promotion()
        assert promotion.piece_blocks(ns) == 3
        cut, ahead = promotion.cold_piece(ns, run)
        assert (cut, keys_of(ahead)) == (5, keys_of(cold[3:6]))
        assert promotion.cold_piece(ns, run[:5]) == (5, [])  # one piece: no cut
    with parts() as p:  # cold_piece_bytes 0: never in pieces
        ns = p.namespace("a")
        assert (p.promotion().piece_blocks(ns), p.promotion().cold_piece(ns, run)) == \
            (0, (len(run), []))


async def test_a_promotion_dram_cannot_take_is_halved_and_the_rest_fails(tmp_path: Path
                                                                       ) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        p.session("a")
        cold = await _on_flash_only(p, "cold", 12)
        pinned = p.put(p.tables.namespaces[cold[0].ns], "pinned", 32 - 5)  # 5 slots free
        for b in pinned + cold:
            b.pins += 1  # leased blocks; the caller pins what it promotes
        ok = await p.promotion().promote_fitting(p.tables.namespaces[cold[0].ns], cold)
        # 12 did not fit, nor 6; 3 did: the 9 after them are failed (the run's cut).
        assert keys_of(sorted(ok.failed, key=cold.index)) == keys_of(cold[3:])
        assert [b.dram is not None for b in cold] == [True] * 3 + [False] * 9
        for b in cold[:3]:
            assert b.dram is not None
            assert bytes(p.ctx.dram.view(b.dram, SLOT)) == kit.tiled(b.key, SLOT)
        assert (p.ctx.counters["promote_no_space"], p.ctx.counters["dram_full"],
                p.ctx.counters["promoted_blocks"]) == (2, 2, 3)
        assert all(b.flash is not None for b in cold)  # the failed ones stay on flash


async def test_an_acquire_ends_where_dram_ran_out_and_the_next_one_goes_on(tmp_path: Path
                                                                         ) -> None:
    store = await open_store(store_config(dram_size="2MiB"), make_flash(tmp_path / "f.img"))
    try:
        s, ns = session(store)
        per_slab = (1 << 20) // ns.slot_size
        assert per_slab * 2 > 12, "the layout's slots: two slabs hold the blocks below"
        keys = kit.keys("cold", 12)
        data = {k: kit.content(k, LAYOUT.block_nbytes) for k in keys}
        assert await put(store, s, ns, data) == 12
        assert await store.evict(ns, keys, "dram") == 12
        filler = kit.keys("filler", 2 * per_slab - 5)  # leased: DRAM has 5 free slots
        assert await put(store, s, ns, {k: kit.content(k, LAYOUT.block_nbytes)
                                        for k in filler}) == len(filler)
        half = len(filler) // 2  # a lease holds at most half the tier
        for part in (filler[:half], filler[half:]):
            lease, _ = await store.acquire(s, ns, part)
            assert len(lease.blocks) == len(part)
        before = dict(store.counters)
        got = await get(store, s, ns, keys)
        assert got == [data[k] for k in keys[:3]]  # 12, then 6 did not fit; 3 did
        assert {c: store.counters[c] - before[c] for c in
                ("promote_no_space", "promoted_blocks", "hits_flash", "misses")} == \
            {"promote_no_space": 2, "promoted_blocks": 3, "hits_flash": 3, "misses": 9}
        # The next Acquire goes on from there: trying 9, the three blocks just read (no
        # longer leased, durable) were dropped for room, which makes 5 free slots; 9 did
        # not fit, 4 did.
        assert await get(store, s, ns, keys[3:]) == [data[k] for k in keys[3:7]]
        assert store.counters["promote_no_space"] - before["promote_no_space"] == 3
        assert [store.index[ns.digest][k].dram is not None for k in keys] == \
            [False] * 3 + [True] * 4 + [False] * 5
    finally:
        await store.close()
