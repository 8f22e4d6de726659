"""The background demoter's batches (``flash.demote_batch`` blocks at least, filled up to
``flash.demote_batch_bytes`` or ``DEMOTE_BATCH_MAX_BLOCKS``): small blocks are demoted in
batches of many blocks, but never so many that the event loop stalls, large ones as
before, and ``demote_batch_bytes: 0`` batches by count alone."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from ctxmem_dpu.blocks import Block
from ctxmem_dpu.store.demotion import Demotion

KiB, MiB = 1 << 10, 1 << 20


def _demotion(dirty: list[Block], batch: int, batch_bytes: int) -> Demotion:
    ctx = SimpleNamespace(cfg=SimpleNamespace(flash=SimpleNamespace(
        demote_batch=batch, demote_batch_bytes=batch_bytes)))
    index = SimpleNamespace(dirty=dict.fromkeys(dirty))
    none: Any = None
    return Demotion(cast(Any, ctx), cast(Any, index), none, none, none, none)


def _blocks(sizes: list[int]) -> list[Block]:
    return [Block(b"n" * 16, b"k%d" % i, size, size, 0, i + 1) for i, size in enumerate(sizes)]


@pytest.mark.parametrize(("sizes", "batch", "batch_bytes", "want"), [
    ([64 * KiB] * 3000, 32, 64 * MiB, 256),  # 64 KiB blocks: up to the block cap
    ([4 * KiB] * 5000, 32, 64 * MiB, 256),  # 4 KiB blocks: the cap, not 20 MiB's 5,000
    ([64 * KiB] * 3000, 32, 8 * MiB, 128),  # filled to the bytes below the cap
    ([64 * KiB] * 3000, 400, 64 * MiB, 400),  # the count is never capped
    ([2 * MiB] * 100, 32, 64 * MiB, 32),  # 2 MiB blocks: 32, as before the key
    ([64 * KiB] * 3000, 32, 0, 32),  # 0: by count only
    ([64 * KiB] * 100, 32, 64 * MiB, 100),  # fewer dirty than the bytes ask for
    ([4 * MiB] * 100, 32, 64 * MiB, 32),  # demote_batch stays the least
    ([64 * KiB] * 10 + [2 * MiB] * 40, 4, 8 * MiB, 14),  # mixed: by slot bytes
])
def test_next_batch_takes_the_oldest_dirty_blocks_by_count_and_bytes(
        sizes: list[int], batch: int, batch_bytes: int, want: int) -> None:
    dirty = _blocks(sizes)
    assert _demotion(dirty, batch, batch_bytes)._next_batch() == dirty[:want]
