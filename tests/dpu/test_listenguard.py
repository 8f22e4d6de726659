"""The unauthenticated-connection caps every listener shares (issue 25 item 4)."""

from __future__ import annotations

import resource

from ctxmem_dpu.listenguard import FdReserve, Unauthenticated, raise_nofile_limit


def test_over_the_total_the_oldest_is_closed_and_the_new_one_admitted() -> None:
    closed: list[int] = []
    u = Unauthenticated("test", cap=3, per_source=3)
    tickets = [u.admit(f"10.0.0.{i}", lambda i=i: closed.append(i)) for i in range(5)]
    assert all(t is not None for t in tickets)
    assert closed == [0, 1] and len(u) == 3 and u.evicted == 2


def test_over_the_per_source_cap_only_that_sources_oldest_is_closed() -> None:
    closed: list[str] = []
    u = Unauthenticated("test", cap=10, per_source=2)
    u.admit("victim", lambda: closed.append("victim"))
    for i in range(5):
        u.admit("attacker", lambda i=i: closed.append(f"attacker{i}"))
    assert closed == ["attacker0", "attacker1", "attacker2"]
    assert len(u) == 3  # the victim's and the attacker's two newest


def test_an_authenticated_connection_leaves_the_count_and_cannot_be_evicted() -> None:
    closed: list[int] = []
    u = Unauthenticated("test", cap=1, per_source=1)
    t = u.admit("a", lambda: closed.append(0))
    assert t is not None
    t.done()
    t.done()  # idempotent
    assert len(u) == 0
    u.admit("a", lambda: closed.append(1))
    assert closed == []


def test_below_the_fd_reserve_the_oldest_makes_room_or_the_new_one_is_refused() -> None:
    fds = FdReserve(reserve=1 << 29)  # always "low"
    closed: list[int] = []
    u = Unauthenticated("test", cap=10, per_source=10, fds=fds)
    assert u.admit("a", lambda: closed.append(0)) is None and u.refused == 1
    relaxed = Unauthenticated("test", cap=10, per_source=10)
    relaxed.admit("a", lambda: closed.append(1))
    relaxed.fds = fds
    assert relaxed.admit("a", lambda: closed.append(2)) is not None
    assert closed == [1] and len(relaxed) == 1


def test_the_fd_reserve_counts_this_process_and_the_soft_limit_is_raised() -> None:
    soft, hard = raise_nofile_limit()
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)
    assert hard == resource.RLIM_INFINITY or soft == hard
    assert 0 < FdReserve(16).free() < soft
    assert not FdReserve(0).low()
