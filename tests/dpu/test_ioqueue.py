"""The I/O threads' queue (store/ioqueue.py): loads before stores without starving
them, weighted shares between tenants, no credit for idleness. Real threads; every
order is made deterministic by holding the one worker on an event while jobs queue."""

from __future__ import annotations

import contextvars
import itertools
import threading
from collections.abc import Callable
from typing import Any

import pytest

from ctxmem_dpu.store.ioqueue import STORE_EVERY, IoClass, PriorityExecutor, work_as


def _submit_as(ex: PriorityExecutor, cls: IoClass, tenant: str, fn: Callable[..., Any],
               *args: Any) -> Any:
    def go() -> Any:
        work_as(cls, tenant)
        return ex.submit(fn, *args)
    return contextvars.copy_context().run(go)


class Held:
    """One worker, held busy until :meth:`release`, recording the jobs it runs."""

    def __init__(self, weights: dict[str, float] | None = None) -> None:
        w = weights or {}
        self.ex = PriorityExecutor(1, lambda t: w.get(t, 1.0))
        self.gate = threading.Event()
        self.order: list[str] = []
        self.blocker = self.ex.submit(self.gate.wait, 10)

    def job(self, cls: IoClass, tenant: str, name: str) -> Any:
        return _submit_as(self.ex, cls, tenant, self.order.append, name)

    def release(self) -> list[str]:
        self.gate.set()
        self.ex.shutdown(wait=True)
        return self.order


def test_loads_go_before_queued_stores_and_stores_are_not_starved() -> None:
    h = Held()
    for i in range(4):
        h.job(IoClass.STORE, "", f"s{i}")
    for i in range(8):
        h.job(IoClass.LOAD, "t", f"l{i}")
    order = h.release()
    assert sorted(order) == sorted([f"s{i}" for i in range(4)] + [f"l{i}" for i in range(8)])
    assert order[:STORE_EVERY - 2] == ["l0", "l1"], order  # loads overtake queued stores
    # while both wait, a store gets a turn at least every STORE_EVERY dispatches
    first_store = order.index("s0")
    assert first_store <= STORE_EVERY - 1, order
    gaps = [i for i, n in enumerate(order) if n.startswith("s")]
    assert all(b - a <= STORE_EVERY for a, b in itertools.pairwise(gaps)), order
    assert [n for n in order if n.startswith("s")] == ["s0", "s1", "s2", "s3"]  # FIFO


def test_unmarked_work_is_a_load() -> None:
    h = Held()
    h.job(IoClass.STORE, "", "store")
    h.ex.submit(h.order.append, "unmarked")
    assert h.release() == ["unmarked", "store"]


def test_tenants_share_a_class_by_weight() -> None:
    h = Held({"a": 2.0, "b": 1.0})
    for i in range(9):
        h.job(IoClass.LOAD, "a", f"a{i}")
        h.job(IoClass.LOAD, "b", f"b{i}")
    order = h.release()
    first = order[:9]
    assert sum(n.startswith("a") for n in first) == 6, order  # 2:1
    assert [n for n in order if n.startswith("a")] == [f"a{i}" for i in range(9)]


def test_a_flooding_tenant_does_not_delay_a_newcomer() -> None:
    """50 jobs of one tenant queued; another tenant's job that arrives while the first of
    them runs goes next, not behind the other 49."""
    ex = PriorityExecutor(1)
    order: list[str] = []
    running, go_on = threading.Event(), threading.Event()

    def first() -> None:
        order.append("f0")
        running.set()
        go_on.wait(10)

    _submit_as(ex, IoClass.LOAD, "flood", first)
    for i in range(1, 50):
        _submit_as(ex, IoClass.LOAD, "flood", order.append, f"f{i}")
    assert running.wait(10)
    _submit_as(ex, IoClass.LOAD, "victim", order.append, "victim")
    go_on.set()
    ex.shutdown(wait=True)
    assert order[:2] == ["f0", "victim"], order[:5]
    assert order[2:] == [f"f{i}" for i in range(1, 50)]


def test_errors_reach_the_caller_and_cancelled_jobs_never_run() -> None:
    h = Held()

    def boom() -> None:
        raise OSError(5, "device gone")

    f_err = h.ex.submit(boom)
    f_cancel = h.job(IoClass.LOAD, "", "never")
    assert f_cancel.cancel()
    order = h.release()
    with pytest.raises(OSError, match="device gone"):
        f_err.result(timeout=5)
    assert order == []


def test_submit_after_shutdown_is_refused() -> None:
    ex = PriorityExecutor(2)
    ex.shutdown(wait=True)
    with pytest.raises(RuntimeError, match="shut down"):
        ex.submit(print)
