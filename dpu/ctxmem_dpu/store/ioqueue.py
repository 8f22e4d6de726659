"""The I/O threads' queue: loads before stores, and weighted shares between tenants.

Why a queue of its own (issue 29 item 2): every byte job of the store (device reads and
writes, AES-XTS, CRC32C checks) runs on a few I/O threads. With a plain FIFO executor a
get's promotion, on a request's critical path, waited behind whatever write-back had
queued before it (a 256-block demotion batch split over the threads), and one tenant's
cold gets or puts could fill the queue for everyone. Here each job carries a class and a
tenant, read from :data:`CURRENT` (a context variable) when it is submitted:

* **Class.** :attr:`IoClass.LOAD` (promotion, cold reads, adopting fetched blocks, and
  anything unmarked) before :attr:`IoClass.STORE` (demotion, write-through, a put's
  check). Stores are not starved: while both classes wait, one job in every
  :data:`STORE_EVERY` is a store.
* **Tenant.** Within a class, start-time fair queuing with unit cost per job: the tenant
  with the least virtual time goes next, and a job advances its tenant's virtual time by
  ``1 / weight`` (``quotas.tenants.<name>.io_weight``, default 1). A tenant that was idle
  starts at the class's current virtual time, so idleness banks no credit.

Callers mark their work with :func:`work_as` at the start of the task that submits it
(the promotion, demotion and commit tasks do); a job keeps the mark it was submitted
under. A job already running is never interrupted: a load waits at most for the jobs
running when it arrived.
"""

from __future__ import annotations

import concurrent.futures
import enum
import threading
from collections import deque
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

#: While loads and stores both wait, one dispatch in this many goes to a store.
STORE_EVERY = 4


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


_Job = tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]]


class _ClassQueue:
    """One class's waiting jobs, per tenant, in fair-queuing order."""

    def __init__(self) -> None:
        self.jobs: dict[str, deque[_Job]] = {}
        self.vtime: dict[str, float] = {}
        self.clock = 0.0
        self.count = 0

    def put(self, tenant: str, job: _Job) -> None:
        q = self.jobs.get(tenant)
        if q is None:
            q = self.jobs[tenant] = deque()
            self.vtime[tenant] = max(self.vtime.get(tenant, 0.0), self.clock)
        q.append(job)
        self.count += 1

    def take(self, weight_of: Callable[[str], float]) -> _Job:
        tenant = min(self.jobs, key=self.vtime.__getitem__)
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
    ``loop.run_in_executor`` takes it). ``weight_of(tenant)``: the tenant's share."""

    def __init__(self, threads: int, weight_of: Callable[[str], float] = lambda _t: 1.0,
                 name: str = "ctxmem-io") -> None:
        self._weight_of = weight_of
        self._cv = threading.Condition()
        self._classes = (_ClassQueue(), _ClassQueue())
        self._since_store = 0
        self._stopping = False
        self._workers = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(max(1, threads))]
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
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("the I/O threads are shut down")
            self._classes[work.cls].put(work.tenant, (fut, fn, args))
            self._cv.notify()
        return fut

    def _next(self) -> _Job | None:
        """The next job (the lock held), or None to stop."""
        loads, stores = self._classes
        while True:
            if loads.count and (not stores.count or self._since_store < STORE_EVERY - 1):
                self._since_store += 1
                return loads.take(self._weight_of)
            if stores.count:
                self._since_store = 0
                return stores.take(self._weight_of)
            if self._stopping:
                return None
            self._cv.wait()

    def _work(self) -> None:
        while True:
            with self._cv:
                job = self._next()
            if job is None:
                return
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the awaiting coroutine
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def waiting(self) -> tuple[int, int]:
        """(loads, stores) queued and not started."""
        with self._cv:
            return self._classes[0].count, self._classes[1].count

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop once the queued jobs are done (``cancel_futures``: drop them instead)."""
        with self._cv:
            self._stopping = True
            if cancel_futures:
                for cq in self._classes:
                    for q in cq.jobs.values():
                        for fut, _fn, _args in q:
                            fut.cancel()
                    cq.jobs.clear()
                    cq.count = 0
            self._cv.notify_all()
        if wait:
            for t in self._workers:
                t.join()
