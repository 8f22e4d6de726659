"""``store/writethrough.py``: under write-through a committed block becomes visible only
once durable on flash; one that could not be written is not kept (its DRAM slot goes, the
Commit fails naming why: RESOURCE_EXHAUSTED for no room, UNAVAILABLE for a failed
device); one whose DRAM bytes changed is dropped quietly; a group's key that failed in one
member is stored in none. Eight 1 MiB DRAM slabs and one 8 MiB flash file, records
written by the real demotion (``parts.py``)."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

import pytest

from ctxmem_common.errors import ResourceExhausted, Unavailable
from ctxmem_dpu.blocks import Allocation, Block, Namespace
from ctxmem_dpu.store.writethrough import WriteThrough
from ctxmem_dpu.tiers.flash import FlashIOError

from .parts import Parts, keys_of, parts


def _wt(p: Parts) -> WriteThrough:
    return WriteThrough(p.ctx, p.index, p.demotion(), p.invalidator)


def _alloc(ns: Namespace, blocks: list[Block]) -> Allocation:
    return Allocation(b"A" * 16, b"S" * 16, ns, [b.key for b in blocks],
                      [b.dram for b in blocks if b.dram is not None], float("inf"))


def _visible(p: Parts, ns: Namespace) -> list[bytes]:
    return list(p.index.namespace(ns.digest))


async def test_durable_blocks_become_visible_a_changed_one_is_dropped(tmp_path: Path
                                                                     ) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        p.session("a")
        ns = p.namespace("a")
        blocks = p.put(ns, "a", 3, indexed=False)
        assert blocks[2].dram is not None
        p.ctx.dram.view(blocks[2].dram, 2)[:] = b"\x00\x01"  # changed after its CRC
        visible = await _wt(p).commit(_alloc(ns, blocks), blocks)
        assert keys_of(visible) == _visible(p, ns) == keys_of(blocks[:2])
        assert [b.durable for b in blocks] == [True, True, False]
        assert keys_of(p.index.dram_lru.order()) == keys_of(blocks[:2])
        assert (p.ctx.counters["dram_crc_mismatch"],
                p.ctx.counters["write_through_failures"]) == (1, 0)


async def test_a_failed_device_fails_the_commit_and_keeps_nothing(tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        p.session("a")
        ns = p.namespace("a")
        before = p.ctx.dram.used_bytes()
        blocks = p.put(ns, "a", 3, indexed=False)
        p.health.mark_unhealthy(0, FlashIOError(errno.EIO, "down"))
        with pytest.raises(Unavailable, match=r"write-through commit of allocation "
                                              r"41414141.*: 3 of 3 blocks could not be made "
                                              r"durable on flash and were not stored \(0 "
                                              r"stored\).*out of service until a probe"):
            await _wt(p).commit(_alloc(ns, blocks), blocks)
        assert _visible(p, ns) == []
        assert all(b.deleted and b.dram is None and not b.durable for b in blocks)
        assert p.ctx.dram.used_bytes() == before  # the slots went back
        assert p.ctx.counters["write_through_failures"] == 3


async def test_no_room_on_flash_is_resource_exhausted(tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        p.session("a")
        ns = p.namespace("a")
        blocks = p.put(ns, "a", 22, indexed=False)  # the file holds 21 such records
        with pytest.raises(ResourceExhausted, match=r"22 of 22 blocks could not be made "
                                                    r"durable.*flash has no room for them"):
            await _wt(p).commit(_alloc(ns, blocks), blocks)
        assert _visible(p, ns) == []
        assert p.ctx.counters["write_through_failures"] == 22


async def test_a_key_already_visible_keeps_the_first_copy(tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        p.session("a")
        ns = p.namespace("a")
        first = p.put(ns, "a", 2)  # another writer's copies, visible already
        again = p.put(ns, "a", 2, indexed=False)
        assert await _wt(p).commit(_alloc(ns, again), again) == []
        assert [p.index.namespace(ns.digest)[b.key] for b in first] == first
        assert all(b.deleted and b.dram is None for b in again)
        await asyncio.gather(*p.ctx.io.tasks)  # their records' headers zeroed, freed
        assert p.ctx.flash.used_bytes() == 0
        assert p.ctx.counters["write_through_failures"] == 0


async def test_a_group_key_that_failed_in_one_member_is_stored_in_none(tmp_path: Path
                                                                      ) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        p.session("a")
        k, v = p.namespace("a", "k"), p.namespace("a", "v")
        kb, vb = p.put(k, "key", 3, indexed=False), p.put(v, "key", 3, indexed=False)
        assert vb[1].dram is not None
        p.ctx.dram.view(vb[1].dram, 2)[:] = b"\x00\x01"  # member v's key 1 changed
        visible = await _wt(p).commit_group([_alloc(k, kb), _alloc(v, vb)], [kb, vb])
        assert keys_of(visible) == keys_of([kb[0], kb[2], vb[0], vb[2]])
        assert _visible(p, k) == _visible(p, v) == keys_of([kb[0], kb[2]])
        assert kb[1].deleted and kb[1].dram is None  # durable, and dropped all the same
        await asyncio.gather(*p.ctx.io.tasks)
        assert p.ctx.flash.used_bytes() == 4 * kb[0].slot_size  # its record freed
        assert p.ctx.counters["write_through_failures"] == 0
