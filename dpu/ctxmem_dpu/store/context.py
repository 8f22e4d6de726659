"""What every part of the store shares, in one explicit object instead of a god object.

The store runs on one asyncio event loop; every mutation of the index happens on that
loop's thread, so no locks. Byte work (CRC32C, AES-XTS, device I/O) runs on a small thread
pool (:class:`IOPool`); those functions get the slot views they need and never touch the
index.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from ctxmem_common.config import Config
from ctxmem_dpu.tiers.dram import DramTier
from ctxmem_dpu.tiers.flash import FlashTier

T = TypeVar("T")


class IOPool:
    """The I/O threads, and the store's short background tasks (prefetch, invalidation).

    Background tasks are kept so ``close`` can await them: they are never cancelled
    mid-I/O, which would strand blocks with half-done bookkeeping.
    """

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.threads, thread_name_prefix="ctxmem-io"
        )
        self.tasks: list[asyncio.Task[object]] = []

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking byte work (I/O, CRC, crypto) on the I/O threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Start ``fn`` on the I/O threads without awaiting it (pipelined scans)."""
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def parallel(self, fn: Callable[[list[Any]], list[T]], jobs: list[Any]
                 ) -> Awaitable[list[T]]:
        """``fn`` over ``jobs`` split into one contiguous part per I/O thread, in parallel:
        device reads and writes overlap (queue depth > 1) with AES-XTS and CRC32C on the
        other thread (all three release the GIL). Results keep the jobs' order.

        The parts are submitted to the threads now, in the call, before the caller
        awaits: work submitted after it (a get's read-ahead, see ``promotion``) queues
        behind it."""
        n = max(1, min(self.threads, len(jobs)))
        size = -(-len(jobs) // n)
        futs = [self.submit(fn, jobs[i:i + size]) for i in range(0, len(jobs), size)]

        async def collect() -> list[T]:
            done = await asyncio.gather(*futs)
            return [r for part in done for r in part]

        return collect()

    def spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        """Run ``coro`` in the background; ``close`` awaits it."""
        self.tasks = [t for t in self.tasks if not t.done()]
        self.tasks.append(asyncio.create_task(coro))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


@dataclass
class StoreContext:
    """The state every store module reads: config, tiers, counters and I/O threads.

    ``flash`` is replaced once, at start, when the devices are open; modules therefore
    read ``ctx.flash`` each time rather than keeping the tier. ``closed`` tells the
    demoter to finish its batch and stop.
    """

    cfg: Config
    dram: DramTier
    flash: FlashTier
    counters: Counter[str]
    io: IOPool
    closed: bool = False
