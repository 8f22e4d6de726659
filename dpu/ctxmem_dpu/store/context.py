"""What every part of the store shares, in one explicit object instead of a god object.

The store runs on one asyncio event loop; every mutation of the index happens on that
loop's thread, so no locks. Byte work (CRC32C, AES-XTS, device I/O) runs on a small thread
pool (:class:`IOPool`); those functions get the slot views they need and never touch the
index.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from ctxmem_common.config import Config
from ctxmem_dpu.store.ioqueue import CURRENT, IoWork, PriorityExecutor
from ctxmem_dpu.tiers.dram import DramTier
from ctxmem_dpu.tiers.flash import FlashTier

T = TypeVar("T")
log = logging.getLogger("ctxmem_dpu.store")


class IOPool:
    """The I/O threads, and the store's short background tasks (prefetch, invalidation).

    The threads serve loads before stores and tenants by weight (:mod:`.ioqueue`): mark
    a task's work with :func:`~ctxmem_dpu.store.ioqueue.work_as` before it submits.

    Background tasks are kept so ``close`` can await them: they are never cancelled
    mid-I/O, which would strand blocks with half-done bookkeeping.
    """

    def __init__(self, threads: int,
                 weight_of: Callable[[str], float] = lambda _tenant: 1.0) -> None:
        self.threads = max(1, threads)
        # Loads before stores, weighted shares between tenants (store/ioqueue.py).
        self._pool = PriorityExecutor(self.threads, weight_of)
        self.tasks: list[asyncio.Task[object]] = []

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking byte work (I/O, CRC, crypto) on the I/O threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    async def run_as(self, work: IoWork, fn: Callable[..., T], *args: Any) -> T:
        """:meth:`run` under the mark ``work``, whatever the current task's."""
        return await asyncio.wrap_future(self._pool.submit_as(work, fn, *args))

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Start ``fn`` on the I/O threads without awaiting it (pipelined scans)."""
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def submit_as(self, work: IoWork, fn: Callable[..., T], *args: Any
                  ) -> concurrent.futures.Future[T]:
        """Start ``fn`` on the I/O threads from any thread (an I/O thread handing a
        pipelined read to another: ``promotion``), marked ``work``; a plain future."""
        return self._pool.submit_as(work, fn, *args)

    def submit_pieces(self, fn: Callable[..., Generator[None, None, T]], *args: Any
                      ) -> asyncio.Future[T]:
        """Start ``fn(*args)``, a generator, on the I/O threads in pieces (each ``next()``
        one, re-queued between them: :meth:`PriorityExecutor.submit_pieces`), under the
        current task's mark; its return value is the future's."""
        return asyncio.wrap_future(self._pool.submit_pieces(CURRENT.get(), fn, *args))

    def parallel(self, fn: Callable[[list[Any]], list[T]], jobs: list[Any],
                 parts: int | None = None, per_part: int = 0) -> Awaitable[list[T]]:
        """``fn`` over ``jobs`` split into one contiguous part per I/O thread, in parallel:
        device reads and writes overlap (queue depth > 1) with AES-XTS and CRC32C on the
        other thread (all three release the GIL). Results keep the jobs' order.
        ``parts``: fewer parts than threads (a pipelined promotion leaves threads free
        for the reads its parts hand out). ``per_part``: at most this many jobs per part
        (more parts then, each an I/O job of its own, which bounds how long one runs:
        ``service.io_piece_bytes``).

        The parts are submitted to the threads now, in the call, before the caller
        awaits: work submitted after it (a get's read-ahead, see ``promotion``) queues
        behind it.

        If a part raises, the awaitable raises that error only once every part has
        ended: the callers free or reuse the slots and extents the parts write into as
        soon as it raises, so no thread may still be writing then."""
        return _collect([self.submit(fn, part)
                         for part in self._split(jobs, parts, per_part)])

    def parallel_pieces(self, fn: Callable[[list[Any]], Generator[None, None, list[T]]],
                        jobs: list[Any], parts: int | None = None) -> Awaitable[list[T]]:
        """:meth:`parallel` of a generator function: each part runs in pieces
        (:meth:`submit_pieces`) and returns its results."""
        return _collect([self.submit_pieces(fn, part) for part in self._split(jobs, parts)])

    def _split(self, jobs: list[Any], parts: int | None, per_part: int = 0
               ) -> list[list[Any]]:
        n = max(1, min(self.threads if parts is None else parts, len(jobs)))
        size = -(-len(jobs) // n)
        if per_part > 0:
            size = min(size, per_part)
        return [jobs[i:i + size] for i in range(0, len(jobs), size)]

    async def uncancellable(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` run as a task of its own, which goes on to its end even if the
        awaiting request is cancelled (a gRPC deadline passing, a client going away):
        store operations that hand slots and extents to the I/O threads and then update
        the index (promotion, demotion) must never stop halfway. The caller still sees
        the cancellation at once; the task is then kept with the background tasks (so
        ``close`` awaits it) and an error it ends with is logged, as nobody awaits it."""
        task = asyncio.ensure_future(coro)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                self.tasks = [t for t in self.tasks if not t.done()]
                self.tasks.append(task)
                task.add_done_callback(_log_orphan)
            raise

    def spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        """Run ``coro`` in the background; ``close`` awaits it."""
        self.tasks = [t for t in self.tasks if not t.done()]
        self.tasks.append(asyncio.create_task(coro))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


async def _collect(futs: list[asyncio.Future[list[T]]]) -> list[T]:
    """The parts' results in order, once every part has ended (the first error then)."""
    done = await asyncio.gather(*futs, return_exceptions=True)
    for part in done:
        if isinstance(part, BaseException):
            raise part
    return [r for part in done for r in cast("list[T]", part)]


def _log_orphan(task: asyncio.Future[Any]) -> None:
    """Done callback of an :meth:`IOPool.uncancellable` task whose request was cancelled:
    its error (retrieved, so asyncio does not warn) is logged, since nobody awaits it."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("store work finished after its request was cancelled failed: %r", exc)
    else:
        log.info("store work finished after its request was cancelled")


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
