"""The CRC32C of a batch of DRAM slots, as a Commit checks what the client wrote.

Why its own pool: the service must recompute the CRC of the bytes in the slots (the
client keeps the slab mapped and could change them until Commit ends its access), and
while it does the client waits on the Commit, so the core it ran on is idle. A large
batch is therefore split into up to ``service.commit_crc_threads`` parts, one native
:func:`~ctxmem_common.codecs.crc32c_many` call each (the GIL released once per part, not
once per block), on threads of their own: a Commit's check neither queues behind the
demoter's device I/O on the I/O threads nor holds them up.

Only byte work runs on these threads: the slot offsets are computed on the event loop,
which owns the DRAM tier's bookkeeping.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Sequence

from ctxmem_common.codecs import crc32c_many
from ctxmem_dpu.alloc import SlotRef
from ctxmem_dpu.tiers.dram import DramTier

MIN_PART_BYTES = 4 << 20
"""A part smaller than this is not worth a thread hand-off (≈ 0.1 ms of CRC here)."""


def crc_threads(configured: int) -> int:
    """``service.commit_crc_threads`` resolved: 0 means min(4, the CPUs this process may
    run on): a service pinned to one core (``service.cpu_affinity``) checks on one thread,
    not on several time-sliced on that core."""
    return configured if configured > 0 else min(4, len(os.sched_getaffinity(0)))


class SlotCrcs:
    """Computes the CRC32C of many DRAM slots per call, on ``threads`` threads."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.threads, thread_name_prefix="ctxmem-crc")

    async def of_slots(self, dram: DramTier, refs: Sequence[SlotRef], nbytes: int
                       ) -> list[int]:
        """The CRC32C of the first ``nbytes`` of each slot of ``refs``, in their order.

        The slots must stay allocated (and their slabs assigned) until this returns."""
        if not refs:
            return []
        # Per slab (a batch is usually in one or two), its mapping, and each slot's
        # position in ``refs`` and offset in the slab.
        groups: dict[int, tuple[list[int], list[int]]] = {}
        for pos, (slab, index) in enumerate(refs):
            g = groups.get(slab)
            if g is None:
                g = groups[slab] = ([], [])
            g[0].append(pos)
            g[1].append(index)
        n = len(refs)
        parts = max(1, min(self.threads, n * nbytes // MIN_PART_BYTES))
        step = -(-n // parts)
        loop = asyncio.get_running_loop()
        futs = []
        spans: list[list[int]] = []
        for slab, (positions, indexes) in groups.items():
            size = dram.alloc.slabs[slab].slot_size
            view = dram.regions[slab].view
            for i in range(0, len(indexes), step):
                offsets = [k * size for k in indexes[i:i + step]]
                futs.append(loop.run_in_executor(self._pool, crc32c_many, view, offsets,
                                                 nbytes))
                spans.append(positions[i:i + step])
        done: list[list[int]] = await asyncio.gather(*futs)
        if len(groups) == 1:  # positions are 0..n-1 in order: the parts concatenate
            return [c for part in done for c in part]
        crcs = [0] * n
        for positions, part in zip(spans, done, strict=True):
            for p, c in zip(positions, part, strict=True):
                crcs[p] = c
        return crcs

    def shutdown(self) -> None:
        """Stop the threads (after the last Commit; waits for a part in progress)."""
        self._pool.shutdown(wait=True)
