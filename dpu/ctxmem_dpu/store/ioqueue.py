"""The I/O threads' queue: loads before stores, and weighted shares between tenants.

Why a queue of its own (issue 29 item 2): every byte job of the store (device reads and
writes, AES-XTS, CRC32C checks) runs on a few I/O threads. With a plain FIFO executor a
get's promotion, on a request's critical path, waited behind whatever write-back had
queued before it (a 256-block demotion batch split over the threads), and one tenant's
cold gets or puts could fill the queue for everyone. Here each job carries a class and a
tenant, read from :data:`CURRENT` (a context variable) when it is submitted:

* **Class.** :attr:`IoClass.LOAD` (promotion, cold reads, adopting fetched blocks, and
  anything unmarked) before :attr:`IoClass.STORE` (demotion, write-through, a put's
  check, zeroing deleted records). Stores are not starved: while both classes wait, one
  job in every :data:`STORE_EVERY` is a store.
* **A thread kept for loads.** With two threads or more, stores run on at most all but
  one of them while loads are about (one waits or runs, or one ended less than
  :data:`LOAD_HOLD_S` ago): a load arriving finds a thread that no store holds, however
  long a store job (an ``fdatasync``) runs. With no load about, stores use every thread.
* **Tenant.** Within a class, start-time fair queuing with unit cost per job: the tenant
  with the least virtual time goes next, and a job advances its tenant's virtual time by
  ``1 / weight`` (``quotas.tenants.<name>.io_weight``, default 1). A tenant that was idle
  starts at the class's current virtual time, so idleness banks no credit. While other
  tenants wait in the class, a tenant running its share of the threads (``threads *
  weight / the weights of the tenants waiting or running``, rounded up) or more goes after
  those below theirs; alone, a tenant uses every thread.
* **Pieces.** A running job is never interrupted, so the queue bounds how long one runs:
  big work is submitted as pieces. Either as separate jobs (a demotion's payloads in parts
  of ``service.io_piece_bytes``), or as one job whose function is a generator
  (:meth:`PriorityExecutor.submit_pieces`): each ``next()`` is one piece, and between two
  pieces the job goes back to the head of its tenant's queue, so whatever ranks before
  it (a load, when it is a store; another tenant's job) runs first. A load therefore
  waits at most about one piece of the jobs running when it arrived.

Callers mark their work with :func:`work_as` at the start of the task that submits it
(the promotion, demotion and commit tasks do); a job keeps the mark it was submitted
under.
"""

from __future__ import annotations

import concurrent.futures
import enum
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Generator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

#: While loads and stores both wait, one dispatch in this many goes to a store.
STORE_EVERY = 4
#: Loads count as about (one thread kept from stores) until this long after the last ended.
LOAD_HOLD_S = 0.02


class IoClass(enum.IntEnum):
    LOAD = 0
    STORE = 1


@dataclass(frozen=True, slots=True)
class IoWork:
    """What a submitted job is: its class and the tenant it is done for."""

    cls: IoClass
    tenant: str = ""


#: The mark of the work the current task submits (unmarked work is a load).
CURRENT: ContextVar[IoWork] = ContextVar(
    "ctxmem_io_work", default=IoWork(IoClass.LOAD))  # noqa: B039 (IoWork is frozen)


def work_as(cls: IoClass, tenant: str = "") -> None:
    """Mark the I/O jobs the current task submits from now on."""
    CURRENT.set(IoWork(cls, tenant))


class _Job:
    """A submitted job; ``steps``: a piecewise job's generator once its first piece ran."""

    __slots__ = ("args", "fn", "fut", "pieces", "steps", "work")

    def __init__(self, work: IoWork, fut: concurrent.futures.Future[Any],
                 fn: Callable[..., Any], args: tuple[Any, ...], pieces: bool) -> None:
        self.work = work
        self.fut = fut
        self.fn = fn
        self.args = args
        self.pieces = pieces
        self.steps: Generator[None, None, Any] | None = None

    def step(self) -> bool:
        """Run one piece (the whole job, unless piecewise); True when more pieces are left.
        The job's outcome goes to its future."""
        fut = self.fut
        if self.steps is None:
            if not fut.set_running_or_notify_cancel():
                return False
            try:
                result = self.fn(*self.args)
            except BaseException as exc:  # handed to the awaiting coroutine
                fut.set_exception(exc)
                return False
            if not self.pieces:
                fut.set_result(result)
                return False
            self.steps = result
        try:
            next(self.steps)
        except StopIteration as stop:
            fut.set_result(stop.value)
            return False
        except BaseException as exc:
            fut.set_exception(exc)
            return False
        return True


class _ClassQueue:
    """One class's waiting jobs, per tenant, in fair-queuing order."""

    def __init__(self) -> None:
        self.jobs: dict[str, deque[_Job]] = {}
        self.vtime: dict[str, float] = {}
        self.clock = 0.0
        self.count = 0

    def put(self, tenant: str, job: _Job, front: bool = False) -> None:
        q = self.jobs.get(tenant)
        if q is None:
            q = self.jobs[tenant] = deque()
            self.vtime[tenant] = max(self.vtime.get(tenant, 0.0), self.clock)
        if front:
            q.appendleft(job)
        else:
            q.append(job)
        self.count += 1

    def take(self, weight_of: Callable[[str], float],
             under_share: Callable[[], set[str]]) -> _Job:
        """The next job: of the tenants waiting here, those running fewer jobs than their
        share of the threads (``under_share()``) first, then the least virtual time."""
        if len(self.jobs) == 1:
            tenant = next(iter(self.jobs))
        else:
            under = under_share()
            tenant = min(self.jobs, key=lambda t: (t not in under, self.vtime[t]))
        q = self.jobs[tenant]
        job = q.popleft()
        self.count -= 1
        self.clock = self.vtime[tenant]
        self.vtime[tenant] += 1.0 / max(weight_of(tenant), 1e-6)
        if not q:
            del self.jobs[tenant]
        return job


class PriorityExecutor(concurrent.futures.Executor):
    """``threads`` workers serving :class:`IoClass` queues (an ``Executor``, so
    ``loop.run_in_executor`` takes it). ``weight_of(tenant)``: the tenant's share;
    ``clock``: monotonic seconds (tests pass their own)."""

    def __init__(self, threads: int, weight_of: Callable[[str], float] = lambda _t: 1.0,
                 name: str = "ctxmem-io", clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.threads = max(1, threads)
        self._weight_of = weight_of
        self._clock = clock
        self._cv = threading.Condition()
        self._classes = (_ClassQueue(), _ClassQueue())
        self._since_store = 0
        self._running = [0, 0]  # per class
        self._running_by: Counter[str] = Counter()  # per tenant, both classes
        self._last_load = -math.inf
        self._stopping = False
        self._workers = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(self.threads)]
        for t in self._workers:
            t.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
               ) -> concurrent.futures.Future[Any]:
        if kwargs:
            raise TypeError("PriorityExecutor.submit takes positional arguments only")
        return self.submit_as(CURRENT.get(), fn, *args)

    def submit_as(self, work: IoWork, fn: Callable[..., Any], /, *args: Any
                  ) -> concurrent.futures.Future[Any]:
        """:meth:`submit` under the mark ``work`` (from any thread: an I/O thread handing
        a pipelined read to another, where :data:`CURRENT` is not the task's mark)."""
        return self._put(_Job(work, concurrent.futures.Future(), fn, args, False))

    def submit_pieces(self, work: IoWork, fn: Callable[..., Generator[None, None, Any]],
                      /, *args: Any) -> concurrent.futures.Future[Any]:
        """Submit a job in pieces: ``fn(*args)`` is a generator, each ``next()`` one
        piece; the future gets what it returns. Between two pieces the job goes back to
        the head of its tenant's queue (the next piece may run on another thread: a piece
        must not leave state in its thread, nor wait on a job of its own not started)."""
        return self._put(_Job(work, concurrent.futures.Future(), fn, args, True))

    def _put(self, job: _Job) -> concurrent.futures.Future[Any]:
        with self._cv:
            if self._stopping:
                raise RuntimeError("the I/O threads are shut down")
            self._classes[job.work.cls].put(job.work.tenant, job)
            self._cv.notify()
        return job.fut

    def _loads_about(self) -> bool:
        """Loads wait or run, or one ended less than LOAD_HOLD_S ago (the lock held)."""
        return bool(self._classes[IoClass.LOAD].count or self._running[IoClass.LOAD]
                    or self._clock() - self._last_load < LOAD_HOLD_S)

    def _store_room(self) -> bool:
        """May another store start now (the lock held)? Not on the last thread free
        while loads are about."""
        return (self.threads == 1 or self._stopping
                or self._running[IoClass.STORE] < self.threads - 1 or not self._loads_about())

    def _under_share(self) -> set[str]:
        """The tenants running fewer jobs than their share of the threads: ``threads *
        weight / the weights of every tenant that waits or runs``, rounded up (the lock
        held)."""
        active = set(self._running_by)
        for cq in self._classes:
            active.update(cq.jobs)
        weights = {t: max(self._weight_of(t), 1e-6) for t in active}
        total = sum(weights.values())
        return {t for t, w in weights.items()
                if self._running_by[t] < math.ceil(self.threads * w / total - 1e-9)}

    def _pick(self) -> _Job | None:
        """The next job to start (the lock held), or None when none may start now."""
        loads, stores = self._classes
        store_ok = bool(stores.count) and self._store_room()
        if loads.count and (not store_ok or self._since_store < STORE_EVERY - 1):
            self._since_store += 1
            job = loads.take(self._weight_of, self._under_share)
        elif store_ok:
            self._since_store = 0
            job = stores.take(self._weight_of, self._under_share)
        else:
            return None
        self._running[job.work.cls] += 1
        self._running_by[job.work.tenant] += 1
        return job

    def _next(self) -> _Job | None:
        """The next job (the lock held), or None to stop."""
        while True:
            job = self._pick()
            if job is not None:
                return job
            if self._stopping and not (self._classes[0].count or self._classes[1].count):
                return None
            loads, stores = self._classes
            if stores.count and not (loads.count or self._running[IoClass.LOAD]):
                # Held back for loads that ended just now: until LOAD_HOLD_S has passed.
                self._cv.wait(max(1e-3, self._last_load + LOAD_HOLD_S - self._clock()))
            else:
                self._cv.wait()  # a submit, or a job's end, wakes it

    def _ended(self, job: _Job, more: bool) -> None:
        """``job``'s piece ended (the lock held): its thread is free; ``more``: it goes
        back to the head of its tenant's queue for its next piece."""
        work = job.work
        self._running[work.cls] -= 1
        self._running_by[work.tenant] -= 1
        if not self._running_by[work.tenant]:
            del self._running_by[work.tenant]
        if work.cls == IoClass.LOAD:
            self._last_load = self._clock()
        if more:
            self._classes[work.cls].put(work.tenant, job, front=True)
            self._cv.notify()  # if this thread takes another job, an idle one takes it

    def _work(self) -> None:
        job: _Job | None = None
        more = False
        while True:
            with self._cv:
                if job is not None:
                    self._ended(job, more)
                job = self._next()
            if job is None:
                return
            more = job.step()

    def waiting(self) -> tuple[int, int]:
        """(loads, stores) queued and not started."""
        with self._cv:
            return self._classes[0].count, self._classes[1].count

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop once the queued jobs are done (``cancel_futures``: drop those not started
        instead; a piecewise job that started runs to its end)."""
        with self._cv:
            self._stopping = True
            if cancel_futures:
                for cq in self._classes:
                    for tenant, q in list(cq.jobs.items()):
                        keep = deque(job for job in q if job.steps is not None)
                        for job in q:
                            if job.steps is None:
                                job.fut.cancel()
                        cq.count -= len(q) - len(keep)
                        if keep:
                            cq.jobs[tenant] = keep
                        else:
                            del cq.jobs[tenant]
            self._cv.notify_all()
        if wait:
            for t in self._workers:
                t.join()
