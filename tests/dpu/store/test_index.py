"""``store/index.py``'s state changes, each one's exact effect on the index maps, both
LRUs and the dirty set, and :meth:`BlockIndex.audit`: empty after a mixed workload of the
store's own modules (put, demote, evict, promote, flash eviction, delete), naming each
deliberately broken state."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ctxmem_dpu.blocks import Block
from ctxmem_dpu.store.index import BlockIndex, unpin

from .parts import Parts, keys_of, parts


def _fresh(p: Parts, ns_tag: str, n: int, tag: str = "") -> list[Block]:
    """``n`` blocks written and checksummed, not yet indexed (as a Commit holds them)."""
    return p.put(p.namespace(ns_tag), tag or ns_tag, n, indexed=False)


async def test_committed_enters_maps_dram_lru_and_dirty_set_in_order() -> None:
    with parts() as p:
        p.session("a")
        blocks = _fresh(p, "a", 4)
        p.index.committed(blocks, dirty=True)
        assert keys_of(list(p.index.get(blocks[0].ns).values())) == keys_of(blocks)
        assert p.index.dram_lru.order() == blocks
        assert list(p.index.dirty) == blocks
        assert p.index.flash_lru.order() == []
        assert p.index.audit(flash_enabled=True) == []
        more = _fresh(p, "a", 2, "more")
        p.index.committed(more, dirty=False)  # no flash tier: not dirty
        assert list(p.index.dirty) == blocks
        assert p.index.audit() == []


async def test_dram_and_flash_copies_come_and_go(tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        p.session("a")
        ns = p.namespace("a")
        blocks = p.put(ns, "a", 4, dirty=True)
        assert await p.demotion().demote(blocks[:2]) == {}
        # made_durable (through the demotion): out of dirty, into the flash LRU.
        assert [b.durable for b in blocks] == [True, True, False, False]
        assert list(p.index.dirty) == blocks[2:]
        assert p.index.flash_lru.order() == blocks[:2]
        assert p.index.audit(flash_enabled=True) == []
        # dropped_dram: a durable block stays indexed (flash only), a dirty one is gone.
        p.ctx.dram.free(blocks[0].dram)  # type: ignore[arg-type]
        assert p.index.dropped_dram(blocks[0]) is False
        p.ctx.dram.free(blocks[3].dram)  # type: ignore[arg-type]
        assert p.index.dropped_dram(blocks[3]) is True
        per_ns = p.index.get(ns.digest)
        assert blocks[0].key in per_ns and blocks[3].key not in per_ns
        assert p.index.dram_lru.order() == blocks[1:3]
        assert list(p.index.dirty) == blocks[2:3]
        assert p.index.audit(flash_enabled=True) == []
        # dropped_flash: with a DRAM copy the block is dirty again; without, gone.
        ext = p.index.dropped_flash(blocks[1])
        assert ext is not None and blocks[1].flash is None and not blocks[1].durable
        assert list(p.index.dirty) == [blocks[2], blocks[1]]
        p.ctx.flash.free(ext)
        p.ctx.flash.free(p.index.dropped_flash(blocks[0]))
        assert blocks[0].key not in per_ns
        assert p.index.flash_lru.order() == []
        assert p.index.audit(flash_enabled=True) == []


async def test_promoted_touched_pinned_and_deleted(tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        p.session("a")
        ns = p.namespace("a")
        blocks = p.put(ns, "a", 3, dirty=True)
        await p.demotion().demote(blocks)
        p.room.drop_dram_many(blocks[:2])
        p.index.pin_many(blocks[:2])
        res = await p.promotion().promote(ns, blocks[:2])
        assert not res.failed
        assert [unpin(b) for b in blocks[:2]] == [False, False]
        assert all(b.dram is not None for b in blocks)
        assert p.index.dram_lru.order() == [blocks[2], *blocks[:2]]
        p.index.touched(blocks[2:])
        assert blocks[2].hits == 1 and p.index.dram_lru.order()[-1] is blocks[2]
        assert p.index.flash_lru.order()[-1] is blocks[2]
        assert p.index.audit(flash_enabled=True) == []
        p.index.pin(blocks[0])  # a lease
        gone = p.index.deleted(ns.digest, [blocks[0].key, blocks[1].key, b"x" * 32])
        assert gone == blocks[:2] and all(b.deleted and b.pins >= 1 for b in gone)
        assert p.index.dram_lru.order() == blocks[2:]
        assert p.index.flash_lru.order() == blocks[2:]
        assert unpin(blocks[1]) is True  # the delete's own pin: its storage goes now
        assert unpin(blocks[0]) is False  # still leased
        assert unpin(blocks[0]) is True
        assert p.index.audit(flash_enabled=True) == []


async def test_audit_is_empty_after_a_mixed_workload(tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img", flash={"demote_batch": 4}) as p:
        p.session("a")
        p.session("b")
        a_ns, b_ns = p.namespace("a"), p.namespace("b")
        a = p.put(a_ns, "a", 12, dirty=True)
        b = p.put(b_ns, "b", 8, dirty=True)
        demotion = p.demotion()
        await demotion.demote(a[:6])
        assert p.index.audit(flash_enabled=True) == []
        await p.room.evict(p.index.get(b_ns.digest), keys_of(b[:4]))
        assert p.index.audit(flash_enabled=True) == []
        # A put that needs room: DRAM victims demoted and dropped.
        refs = await p.room.reserve_dram(a_ns, 8)
        p.ctx.dram.free_many(refs)
        assert p.index.audit(flash_enabled=True) == []
        cold = [x for x in a + b if x.dram is None and x.key in p.index.get(x.ns)]
        p.index.pin_many(cold[:3])
        await p.promotion().promote(a_ns if cold[0].ns == a_ns.digest else b_ns,
                                    [x for x in cold[:3] if x.ns == cold[0].ns])
        for x in cold[:3]:
            p.invalidator.unpin(x)
        p.index.touched([x for x in a if x.dram is not None][:3])
        assert p.index.audit(flash_enabled=True) == []
        gone = p.index.deleted(a_ns.digest, keys_of(a[:5]))
        for x in gone:
            p.invalidator.unpin(x)  # frees each one's storage: its header zeroed first
        await asyncio.gather(*(asyncio.all_tasks() - {asyncio.current_task()}))
        assert p.index.audit(flash_enabled=True) == []


async def test_audit_names_each_broken_state() -> None:
    with parts() as p:
        p.session("a")
        ns = p.namespace("a")
        blocks = p.put(ns, "a", 4, dirty=True)
        assert p.index.audit(flash_enabled=True) == []
        p.index.dram_lru.remove(blocks[0])  # an LRU out of step with the tier
        blocks[1].pins = -1
        stray = _fresh(p, "b", 1)[0]
        p.index.dirty[stray] = None  # dirty but never indexed
        p.index.dirty.pop(blocks[2])  # DRAM only but not dirty
        index: BlockIndex = p.index
        problems = index.audit(flash_enabled=True)
        text = "\n".join(problems)
        assert f"block {blocks[0].key.hex()[:16]}" in text and "DRAM LRU False" in text
        assert "has -1 pins" in text
        assert f"block {stray.key.hex()[:16]}" in text and "dirty but not indexed" in text
        assert f"block {blocks[2].key.hex()[:16]}" in text and "not in the dirty set" in text
        assert "DRAM LRU holds 3 blocks, 4 have a DRAM copy" in text
        assert len(problems) == 5, problems
