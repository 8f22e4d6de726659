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

from ctxmem_dpu.store.ioqueue import STORE_EVERY, IoClass, IoWork, PriorityExecutor, work_as


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


# -- pieces, a thread kept for loads, tenants' shares of the threads (issue 29 item 2) --


class Starts:
    """Jobs that record their start and, when given a gate, block until it opens."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.started: dict[str, threading.Event] = {}
        self.lock = threading.Lock()

    def job(self, name: str, gate: threading.Event | None = None) -> Callable[[], str]:
        self.started[name] = threading.Event()

        def run() -> str:
            with self.lock:
                self.order.append(name)
            self.started[name].set()
            if gate is not None:  # longer than any wait of the tests for a start
                assert gate.wait(60), f"{name}: its gate never opened"
            return name

        return run

    def wait(self, *names: str) -> None:
        for n in names:
            assert self.started[n].wait(10), f"{n} never started; started: {self.order}"


class Clock:
    """A test clock standing still; ``looked`` is set once it is read after ``arm``."""

    def __init__(self) -> None:
        self.now = 0.0
        self.looked = threading.Event()
        self.armed = False

    def __call__(self) -> float:
        if self.armed:
            self.looked.set()
        return self.now

    def arm(self) -> None:
        self.looked.clear()
        self.armed = True


def test_a_load_finds_a_thread_that_no_store_holds() -> None:
    """Two threads, loads about: a store runs on one; the next store waits, so a load
    arriving starts at once on the other thread, before that store."""
    clock = Clock()
    ex = PriorityExecutor(2, clock=clock)
    s = Starts()
    _submit_as(ex, IoClass.LOAD, "v", s.job("warm")).result(10)  # a load just ended
    gate = threading.Event()
    _submit_as(ex, IoClass.STORE, "", s.job("s1", gate))
    s.wait("s1")
    clock.arm()
    _submit_as(ex, IoClass.STORE, "", s.job("s2", gate))
    # The free thread asks whether loads are about (the clock), and keeps s2 waiting.
    assert clock.looked.wait(10), "the free thread never looked at s2"
    _submit_as(ex, IoClass.LOAD, "v", s.job("load", gate))
    s.wait("load")  # with s2 on the second thread, blocked on the gate, it never would
    assert "s2" not in s.order, s.order
    gate.set()
    ex.shutdown(wait=True)
    assert s.order == ["warm", "s1", "load", "s2"]


def test_stores_use_every_thread_while_no_load_is_about() -> None:
    now = [0.0]
    ex = PriorityExecutor(2, clock=lambda: now[0])
    s = Starts()
    _submit_as(ex, IoClass.LOAD, "v", s.job("warm")).result(10)
    now[0] = 1.0  # the last load ended a second ago (LOAD_HOLD_S is far shorter)
    gate = threading.Event()
    _submit_as(ex, IoClass.STORE, "", s.job("s1", gate))
    _submit_as(ex, IoClass.STORE, "", s.job("s2", gate))
    s.wait("s1", "s2")  # both at once
    gate.set()
    ex.shutdown(wait=True)


def test_a_store_held_back_goes_once_loads_have_ended() -> None:
    """The thread kept for loads is given back LOAD_HOLD_S after the last load ended."""
    now = [0.0]
    ex = PriorityExecutor(2, clock=lambda: now[0])
    s = Starts()
    _submit_as(ex, IoClass.LOAD, "v", s.job("warm")).result(10)
    gate = threading.Event()
    _submit_as(ex, IoClass.STORE, "", s.job("s1", gate))
    s.wait("s1")
    _submit_as(ex, IoClass.STORE, "", s.job("s2", gate))
    assert ex.waiting() == (0, 1)
    now[0] = 1.0  # the held-back thread looks again within LOAD_HOLD_S of real time
    s.wait("s2")
    gate.set()
    ex.shutdown(wait=True)


def _pieces(log: list[str], name: str, n: int, during_first: Callable[[], Any] | None = None
            ) -> Callable[[], Any]:
    def gen() -> Any:
        for i in range(n):
            log.append(f"{name}{i}")
            if i == 0 and during_first is not None:
                during_first()
            if i < n - 1:
                yield
        return f"{name} done"
    return gen


def test_a_store_in_pieces_lets_a_load_in_between_its_pieces() -> None:
    h = Held()
    load = IoWork(IoClass.LOAD, "v")
    fut = h.ex.submit_pieces(IoWork(IoClass.STORE, ""), _pieces(
        h.order, "s", 3, lambda: h.ex.submit_as(load, h.order.append, "load")))
    h.gate.set()
    assert fut.result(5) == "s done"  # before shutdown: its first piece submits the load
    order = h.release()
    assert order == ["s0", "load", "s1", "s2"], order


def test_pieces_interleave_with_another_tenants_jobs_and_keep_their_own_order() -> None:
    """A job in pieces of tenant a, then jobs of b and of a itself: b goes between a's
    pieces; a's own later job goes after its last piece (a piece goes back to the head
    of its tenant's queue)."""
    h = Held()
    fut = h.ex.submit_pieces(IoWork(IoClass.LOAD, "a"), _pieces(h.order, "a", 3))
    h.job(IoClass.LOAD, "b", "b0")
    h.job(IoClass.LOAD, "a", "a-later")
    h.job(IoClass.LOAD, "b", "b1")
    order = h.release()
    assert order == ["a0", "b0", "a1", "b1", "a2", "a-later"], order
    assert fut.result(5) == "a done"


def test_an_error_in_a_piece_reaches_the_caller() -> None:
    h = Held()

    def gen() -> Any:
        yield
        raise OSError(5, "device gone in piece 2")

    fut = h.ex.submit_pieces(IoWork(IoClass.LOAD, ""), gen)
    h.release()
    with pytest.raises(OSError, match="piece 2"):
        fut.result(5)


def test_a_tenant_alone_uses_every_thread() -> None:
    ex = PriorityExecutor(3)
    s = Starts()
    gate = threading.Event()
    for i in range(3):
        _submit_as(ex, IoClass.LOAD, "a", s.job(f"a{i}", gate))
    s.wait("a0", "a1", "a2")
    gate.set()
    ex.shutdown(wait=True)


def test_a_tenant_at_its_share_of_the_threads_goes_after_one_below_it() -> None:
    """Two threads, tenants a and b running one job each. b's virtual time is ahead (it
    ran a job before), so by virtual time alone a's next job would take the thread b
    frees and hold it (a's jobs are long); at its share (one of two threads) a waits,
    and b's short jobs go on the freed thread while a's first still runs."""
    ex = PriorityExecutor(2)
    s = Starts()
    _submit_as(ex, IoClass.LOAD, "b", s.job("b0")).result(10)
    gate_a, gate_b = threading.Event(), threading.Event()
    _submit_as(ex, IoClass.LOAD, "a", s.job("a1", gate_a))
    s.wait("a1")
    _submit_as(ex, IoClass.LOAD, "b", s.job("b1", gate_b))
    s.wait("b1")
    _submit_as(ex, IoClass.LOAD, "a", s.job("a2", gate_a))
    _submit_as(ex, IoClass.LOAD, "b", s.job("b2"))
    _submit_as(ex, IoClass.LOAD, "b", s.job("b3"))
    gate_b.set()
    s.wait("b2", "b3")  # a2 on the freed thread, blocked on gate_a, would stop them
    gate_a.set()
    ex.shutdown(wait=True)
    assert s.order == ["b0", "a1", "b1", "b2", "b3", "a2"]
