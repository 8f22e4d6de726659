"""``store/deletes.py``: a delete takes the keys out of the index at once, zeroes their
flash headers before it returns, frees their storage on the last unpin (a leased block
keeps its bytes until its lease ends), and counts only keys that were stored. One 8 MiB
flash file behind a DRAM tier (``parts.py``), records written by the real demotion."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ctxmem_dpu.blocks import Block
from ctxmem_dpu.store.deletes import Deletes
from ctxmem_dpu.tiers.flash import Extent
from tests import kit

from .parts import Parts, keys_of, parts


async def _records(p: Parts, n: int) -> list[Block]:
    p.session("a")
    blocks = p.put(p.namespace("a"), "a", n, dirty=True)
    assert await p.demotion().demote(blocks) == {}
    return blocks


def _headers(p: Parts, exts: list[Extent]) -> list[bytes | None]:
    dev = p.ctx.flash.devices[0]
    return [None if (h := dev.read_header(e.slot)) is None else h.key for e in exts]


async def test_a_delete_drops_the_keys_and_kills_their_records_before_it_returns(
        tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        blocks = await _records(p, 4)
        gone, kept = blocks[1:3], [blocks[0], blocks[3]]
        exts = [b.flash for b in blocks]
        assert all(e is not None for e in exts)
        used = (p.ctx.dram.used_bytes(), p.ctx.flash.used_bytes())
        unknown = kit.keys("never-put", 1)
        n = await Deletes(p.ctx, p.index, p.invalidator).delete(
            gone[0].ns, keys_of(gone) + unknown)
        assert n == 2  # the unknown key is not counted
        assert sorted(p.index.namespace(gone[0].ns)) == sorted(keys_of(kept))
        assert _headers(p, exts) == [  # type: ignore[arg-type]
            blocks[0].key, None, None, blocks[3].key]
        slot = blocks[0].slot_size
        assert (p.ctx.dram.used_bytes(), p.ctx.flash.used_bytes()) == \
            (used[0] - 2 * slot, used[1] - 2 * slot)
        assert p.ctx.counters["deleted_blocks"] == 2
        assert p.index.audit() == []


async def test_a_leased_block_keeps_its_bytes_until_its_lease_ends(tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        b, = await _records(p, 1)
        ext = b.flash
        assert ext is not None
        b.pins += 1  # a lease holds it
        used = p.ctx.dram.used_bytes()
        assert await Deletes(p.ctx, p.index, p.invalidator).delete(b.ns, [b.key]) == 1
        assert b.key not in p.index.namespace(b.ns)
        assert _headers(p, [ext]) == [None]  # dead on flash already
        assert b.dram is not None and p.ctx.dram.used_bytes() == used  # the lease reads on
        p.invalidator.unpin(b)  # the lease ends
        await asyncio.gather(*p.ctx.io.tasks)
        assert b.dram is None and p.ctx.dram.used_bytes() == used - b.slot_size


async def test_a_cancelled_delete_still_finishes_its_records(tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        blocks = await _records(p, 2)
        exts = [b.flash for b in blocks]
        task = asyncio.ensure_future(
            Deletes(p.ctx, p.index, p.invalidator).delete(blocks[0].ns, keys_of(blocks)))
        await asyncio.sleep(0)  # out of the index; the header work is under way
        task.cancel()
        assert isinstance((await asyncio.gather(task, return_exceptions=True))[0],
                          asyncio.CancelledError)  # the caller sees it at once
        await asyncio.gather(*p.ctx.io.tasks)  # the records' work, kept by the store
        assert p.index.namespace(blocks[0].ns) == {}
        assert _headers(p, exts) == [None, None]  # type: ignore[arg-type]
        assert all(b.dram is None and b.flash is None for b in blocks)
