"""``store/invalidation.py``: a flash extent is freed only after its record header is
zeroed and synced; on a failed device it is parked (kept out of use, header intact) until
the reaper zeroes it; the last unpin of a deleted block frees its storage. One 8 MiB flash
file behind a DRAM tier (``parts.py``), records written by the real demotion."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

import pytest

from ctxmem_dpu.blocks import Block
from ctxmem_dpu.tiers.flash import Extent, FlashIOError

from .parts import Parts, parts


async def _records(p: Parts, n: int) -> list[Block]:
    p.session("a")
    blocks = p.put(p.namespace("a"), "a", n, dirty=True)
    assert await p.demotion().demote(blocks) == {}
    return blocks


def _detach(blocks: list[Block]) -> list[Extent]:
    """The blocks' extents, no block naming them any more (as a delete leaves them)."""
    exts = []
    for b in blocks:
        assert b.flash is not None
        exts.append(b.flash)
        b.flash = None
    return exts


def _headers(p: Parts, exts: list[Extent]) -> list[bytes | None]:
    dev = p.ctx.flash.devices[0]
    out = []
    for e in exts:
        hdr = dev.read_header(e.slot)
        out.append(None if hdr is None else hdr.key)
    return out


async def test_headers_are_zeroed_then_the_extents_freed(tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        blocks = await _records(p, 4)
        used = p.ctx.flash.used_bytes()
        exts = _detach(blocks[1:3])
        assert _headers(p, exts) == [blocks[1].key, blocks[2].key]
        assert await p.invalidator.invalidate(exts) is True
        assert _headers(p, exts) == [None, None]
        assert p.ctx.flash.used_bytes() == used - 2 * blocks[0].slot_size
        assert _headers(p, [blocks[0].flash, blocks[3].flash]) == \
            [blocks[0].key, blocks[3].key]  # type: ignore[list-item]
        assert (p.invalidator.parked, dict(p.invalidator.in_flight)) == ({}, {})


async def test_on_a_failed_device_they_are_parked_until_it_works(tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        blocks = await _records(p, 3)
        used = p.ctx.flash.used_bytes()
        exts = _detach(blocks[:2])
        p.health.mark_unhealthy(0, FlashIOError(errno.EIO, "down"))
        assert await p.invalidator.invalidate(exts) is False
        assert p.invalidator.parked == {0: exts}
        assert p.ctx.flash.used_bytes() == used  # not reusable while a record may live
        assert _headers(p, exts) == [blocks[0].key, blocks[1].key]
        await p.invalidator.retry_parked()  # still failed: nothing tried
        assert p.invalidator.parked == {0: exts}
        await p.health.revive()
        await p.invalidator.retry_parked()
        assert (p.invalidator.parked, _headers(p, exts)) == ({}, [None, None])
        assert p.ctx.flash.used_bytes() == used - 2 * blocks[0].slot_size


async def test_without_free_the_headers_die_and_the_extents_stay(tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        blocks = await _records(p, 2)
        used = p.ctx.flash.used_bytes()
        exts = _detach(blocks)
        assert await p.invalidator.invalidate(exts, free=False) is True
        assert (_headers(p, exts), p.ctx.flash.used_bytes()) == ([None, None], used)
        p.health.mark_unhealthy(0, FlashIOError(errno.EIO, "down"))
        assert await p.invalidator.invalidate(exts, free=False) is False
        assert p.invalidator.parked == {}  # the caller keeps them


async def test_the_last_unpin_of_a_deleted_block_frees_its_storage(tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        blocks = await _records(p, 2)
        b, kept = blocks
        used = (p.ctx.dram.used_bytes(), p.ctx.flash.used_bytes())
        ext = b.flash
        b.pins, kept.pins = 2, 1
        b.deleted = True
        p.invalidator.unpin(b)
        assert b.dram is not None and b.flash is not None  # a pin is left
        p.invalidator.unpin(b)
        p.invalidator.unpin(kept)  # not deleted: its storage stays
        assert b.dram is None and b.flash is None
        await asyncio.gather(*p.ctx.io.tasks)
        assert _headers(p, [ext, kept.flash]) == [None, kept.key]  # type: ignore[list-item]
        assert (p.ctx.dram.used_bytes(), p.ctx.flash.used_bytes()) == \
            (used[0] - b.slot_size, used[1] - b.slot_size)
        with pytest.raises(AssertionError, match="unpinned more often than pinned"):
            p.invalidator.unpin(kept)


def test_in_flight_extents_are_counted_per_use() -> None:
    with parts() as p:
        inv = p.invalidator
        e1, e2 = Extent(0, None), Extent(1, None)  # type: ignore[arg-type]
        inv.begin([e1, e1, e2])
        inv.end([e1])
        assert dict(inv.in_flight) == {e1: 1, e2: 1}
        inv.end([e1, e2])
        assert dict(inv.in_flight) == {}
