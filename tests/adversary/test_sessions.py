"""Sessions cannot leak (issue 26 item 4), against real service processes.

Before: a Connect whose caller had given up still made a session, ``Client.close`` left
its sessions on the service, and a client that died kept its session until
``session_idle_s`` (600 s): a tenant that opened and closed clients, or whose clients
crashed, filled its 64-session cap in seconds and was refused for ten minutes (38,983
refused requests in one run). Now a Connect past its caller's deadline makes nothing,
``Client.close`` ends its sessions (Disconnect), a session whose client went away ends
``service.session_orphan_s`` after its Hold call ended, and the cap counts live sessions
only. Older clients (no Hold) keep the idle rule.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

import ctxmem
from ctxmem.client import CLOSE_TIMEOUT_S
from ctxmem_common.errors import ERROR_METADATA_KEY
from ctxmem_common.identity import SESSION_TOKEN_METADATA_KEY
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.proto import ctxmem_pb2_grpc as pb_grpc
from ctxmem_common.protoconv import transport_to_pb
from tests.adversary.raw import RawSession
from tests.conftest import ServiceHandle
from tests.kit import blocks, chain_keys, model_layout, read_until
from tests.reliability.kit import FaultyService

LAYOUT = model_layout()
BLOCK = LAYOUT.block_nbytes
ORPHAN_S = 1.0  # service.session_orphan_s in these tests
# How long a dead client's session may outlive it: the orphan time, the reaper's pass
# (0.2 s) and slack for a loaded machine.
ORPHAN_BOUND_S = ORPHAN_S + 4.0


def _code(exc: grpc.RpcError) -> str:
    return dict(exc.trailing_metadata() or ()).get(ERROR_METADATA_KEY, "")


def _stats(endpoint: str) -> dict[str, float]:
    with grpc.insecure_channel(endpoint) as ch:
        return dict(pb_grpc.ContextMemoryStub(ch).Stats(pb.StatsRequest(), timeout=15).values)


def _until(endpoint: str, cond: Callable[[dict[str, float]], bool], timeout_s: float,
           what: str) -> tuple[dict[str, float], float]:
    """Stats once ``cond`` holds, and the seconds it took; fails with the last Stats."""
    start = time.monotonic()
    st = read_until(lambda: _stats(endpoint), cond, timeout_s)
    assert cond(st), (f"after {timeout_s} s still not {what}: sessions {st['sessions']}, "
                      f"held {st['sessions_held']}, orphaned "
                      f"{st['orphaned_sessions_closed']}, idle {st['idle_sessions_closed']}")
    return st, time.monotonic() - start


@pytest.fixture
def small_cap(service_factory: Callable[..., ServiceHandle]) -> ServiceHandle:
    """A service whose tenants may hold 4 sessions, orphans ending after 1 s."""
    return service_factory(encryption=False, dram_size="32MiB", dram_slab="4MiB",
                           flash_size=None, transports=["shm", "tcp"],
                           service={"session_orphan_s": ORPHAN_S},
                           quotas={"default": {"max_sessions": 4}})


# -- a Connect whose caller gave up ---------------------------------------------------
@pytest.fixture
def busy(tmp_path: Path) -> Iterator[FaultyService]:
    svc = FaultyService(tmp_path / "busy")
    svc.start()
    yield svc
    svc.close()


@pytest.mark.parametrize("point", ["connect.before_session", "connect.after_session"])
def test_a_connect_whose_caller_gave_up_leaves_no_session(busy: FaultyService,
                                                          point: str) -> None:
    """The service stalls (a blocking sleep on its event loop: a busy service) inside
    Connect, before or after the session is made, past the caller's 0.3 s deadline. The
    caller gets DEADLINE_EXCEEDED and the service keeps no session: none in Stats, one
    abandoned Connect counted. (Before: the session stayed until session_idle_s.)"""
    busy.faults(points=f"{point}:sleep=1.0@1")
    with grpc.insecure_channel(busy.endpoint) as ch:
        stub = pb_grpc.ContextMemoryStub(ch)
        stub.Health(pb.HealthRequest(), timeout=10)  # connected before the stall
        with pytest.raises(grpc.RpcError) as info:
            stub.Connect(pb.ConnectRequest(client_name="gave-up", tenant="t",
                                           transport=transport_to_pb("shm"), hold=True),
                         timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert busy.wait_injected("point:sleep") == 1
    st = _stats(busy.endpoint)  # answered once the stall is over
    assert st["sessions"] == 0, "a session was made for a caller that had given up"
    assert st["connects_abandoned"] == 1
    busy.faults()
    # The service is otherwise unchanged: a client connects and works.
    ns = busy.ns()
    assert ns.lookup([b"k" * 32]).num_hits == 0
    assert _stats(busy.endpoint)["sessions"] == 1


def test_a_held_connect_whose_answer_was_lost_ends_as_an_orphan(
        small_cap: ServiceHandle) -> None:
    """A Connect that says it holds (as the shim's does) but whose client never opens a
    Hold (its answer was lost after the service's deadline checks, or the client died
    right after) ends within the orphan time, counted from Connect."""
    with grpc.insecure_channel(small_cap.endpoint) as ch:
        pb_grpc.ContextMemoryStub(ch).Connect(pb.ConnectRequest(
            client_name="lost", tenant="a", transport=transport_to_pb("tcp"), hold=True),
            timeout=10)
    assert _stats(small_cap.endpoint)["sessions"] == 1
    st, _ = _until(small_cap.endpoint, lambda s: s["sessions"] == 0, ORPHAN_BOUND_S,
                   "the never-held session ended")
    assert st["orphaned_sessions_closed"] == 1


# -- Client.close -----------------------------------------------------------------------
def test_clients_opened_and_closed_in_a_loop_are_never_refused(
        small_cap: ServiceHandle) -> None:
    """200 clients, one after the other, each connecting (shared memory and TCP in turn),
    putting and getting a block and closing, against a cap of 4 sessions: none is refused
    (before: the fifth was, for session_idle_s), and no session is left at the end."""
    keys, data = chain_keys(LAYOUT, 0, 1), blocks(1, BLOCK, 1)
    for i in range(200):
        with ctxmem.Client(small_cap.endpoint, transport="shm" if i % 2 else "tcp",
                           timeout_s=15) as c:
            ns = c.open_namespace(LAYOUT, model_id="m", tenant="a")
            ns.put(keys, data)
            out = [np.zeros_like(data[0])]
            assert ns.get(keys, out) == 1 and np.array_equal(out[0], data[0])
    st, _ = _until(small_cap.endpoint, lambda s: s["sessions"] == 0, 10,
                   "every session ended")
    assert st["sessions_disconnected"] == 200
    assert st["quota_refusals"] == 0


def test_close_ends_the_session_at_once(small_cap: ServiceHandle) -> None:
    """After ``close`` returns, the service no longer has the session (no wait: Disconnect
    is answered before close returns), also for the ``with`` exit and twice."""
    c = ctxmem.Client(small_cap.endpoint, transport="tcp", timeout_s=15)
    c.open_namespace(LAYOUT, model_id="m", tenant="a").lookup(chain_keys(LAYOUT, 0, 1))
    assert _stats(small_cap.endpoint)["sessions"] == 1
    c.close()
    assert _stats(small_cap.endpoint)["sessions"] == 0
    c.close()  # idempotent
    with ctxmem.Client(small_cap.endpoint, transport="shm", timeout_s=15) as c2:
        c2.open_namespace(LAYOUT, model_id="m", tenant="a").lookup(chain_keys(LAYOUT, 0, 1))
        c2.open_namespace(LAYOUT, model_id="m", tenant="b").lookup(chain_keys(LAYOUT, 0, 1))
        assert _stats(small_cap.endpoint)["sessions"] == 2
    # The shared-memory sessions end when their connection's close reaches the service
    # (at once, or from the reaper's next pass).
    _until(small_cap.endpoint, lambda s: s["sessions"] == 0, 5, "both sessions ended")


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_close_with_the_service_gone_does_not_hang(
        service_factory: Callable[..., ServiceHandle], how: str) -> None:
    """``close`` returns within CLOSE_TIMEOUT_S (plus slack) whether the service is dead
    (Disconnect refused at once) or stopped (SIGSTOP: Disconnect never answered), and
    raises nothing."""
    svc = service_factory(encryption=False, flash_size=None, transports=["tcp"])
    c = ctxmem.Client(svc.endpoint, transport="tcp", timeout_s=30)
    c.open_namespace(LAYOUT, model_id="m", tenant="a").lookup(chain_keys(LAYOUT, 0, 1))
    assert svc.proc is not None
    if how == "killed":
        svc.kill()
    else:
        svc.proc.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        c.close()
        took = time.monotonic() - start
    finally:
        if how == "stopped" and svc.proc is not None:
            svc.proc.send_signal(signal.SIGCONT)
    assert took < CLOSE_TIMEOUT_S + 1.5, f"close took {took:.1f} s"


# -- clients that die -------------------------------------------------------------------
_CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    import ctxmem
    endpoint, transport, tenant = sys.argv[1:4]
    layout = ctxmem.KVLayout(dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=64,
                             tokens_per_block=16)
    c = ctxmem.Client(endpoint, transport=transport, timeout_s=15)
    ns = c.open_namespace(layout, model_id="m", tenant=tenant)
    keys = ctxmem.chain_hashes(range(16), 16)
    ns.put(keys, [np.full(layout.block_nbytes, 7, np.uint8)])
    print("ready", flush=True)
    time.sleep(600)
""")


def _spawn_client(endpoint: str, transport: str, tenant: str) -> subprocess.Popen[str]:
    """A client process with one session (and its Hold call) open, once it says ready."""
    p = subprocess.Popen([sys.executable, "-c", _CHILD, endpoint, transport, tenant],
                         stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    assert p.stdout is not None
    line = p.stdout.readline()
    if line.strip() != "ready":
        p.kill()
        p.wait(10)
        raise AssertionError(f"client process did not start: {line!r}")
    return p


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_killed_clients_session_ends_within_the_orphan_time(
        small_cap: ServiceHandle, transport: str) -> None:
    """Four client processes of one tenant fill its cap of 4; SIGKILL them all. Their
    sessions end within session_orphan_s (1 s here, plus the reaper's pass and slack), as
    orphans, not idle ones, and the tenant connects 4 new clients again. (Before: the
    sessions stayed for session_idle_s, 600 s, and every Connect was refused.)"""
    procs = [_spawn_client(small_cap.endpoint, transport, "a") for _ in range(4)]
    try:
        _until(small_cap.endpoint, lambda s: s["sessions_held"] == 4, 10,
               "4 held sessions")
        with pytest.raises(ctxmem.ResourceExhausted, match="max_sessions"), \
                ctxmem.Client(small_cap.endpoint, transport="tcp", timeout_s=15) as c:
            c.open_namespace(LAYOUT, model_id="m", tenant="a")
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
    st, took = _until(small_cap.endpoint, lambda s: s["sessions"] == 0, ORPHAN_BOUND_S,
                      "the killed clients' sessions ended")
    assert st["orphaned_sessions_closed"] == 4 and st["idle_sessions_closed"] == 0
    assert took <= ORPHAN_BOUND_S
    with urllib.request.urlopen(small_cap.metrics_url_for("/metrics"), timeout=10) as r:
        metrics = r.read().decode()
    assert 'ctxmem_sessions_ended_total{reason="orphaned"} 4.0' in metrics
    clients = [ctxmem.Client(small_cap.endpoint, transport=transport, timeout_s=15)
               for _ in range(4)]
    try:
        for c in clients:
            assert c.open_namespace(LAYOUT, model_id="m", tenant="a").lookup(
                chain_keys(LAYOUT, 0, 1)).num_hits == 1
    finally:
        for c in clients:
            c.close()


def test_a_dropped_channel_orphans_the_session_and_old_clients_keep_the_idle_rule(
        small_cap: ServiceHandle) -> None:
    """A shim whose gRPC channel drops (closed under it, the process alive) loses its
    Hold: its session ends as an orphan. A raw client of the older protocol (no hold)
    whose channel closes at the same moment keeps its session: the idle rule alone
    (session_idle_s, 600 s) applies to it, as before."""
    raw = RawSession(small_cap.endpoint, LAYOUT, tenant="old", transport="tcp")
    c = ctxmem.Client(small_cap.endpoint, transport="tcp", timeout_s=15)
    c.open_namespace(LAYOUT, model_id="m", tenant="a").lookup(chain_keys(LAYOUT, 0, 1))
    _until(small_cap.endpoint, lambda s: s["sessions"] == 2 and s["sessions_held"] == 1, 10,
           "one held session and one old one")
    assert c._channel is not None
    c._channel.close()  # the channel drops under the client: no Disconnect
    raw.close()
    st, _ = _until(small_cap.endpoint, lambda s: s["orphaned_sessions_closed"] == 1,
                   ORPHAN_BOUND_S, "the dropped channel's session ended")
    assert st["sessions"] == 1, "the older client's session did not keep the idle rule"
    c.close()


# -- Disconnect and Hold are authenticated like every call ---------------------------
def test_disconnect_and_hold_need_the_sessions_token(small_cap: ServiceHandle) -> None:
    """Disconnect (and Hold) with a wrong token are refused as an unknown session, with no
    token as a client that does not speak the protocol, and the session stays; with its
    own token it ends, and a second Disconnect is answered as an unknown session (the
    shim takes that as done)."""
    with RawSession(small_cap.endpoint, LAYOUT, tenant="a", transport="tcp") as raw:
        req = pb.DisconnectRequest(session_id=raw.session_id)
        for token, code in ((b"\0" * 16, "UNKNOWN_SESSION"), (None, "PERMISSION_DENIED")):
            with pytest.raises(grpc.RpcError) as info:
                raw.call("Disconnect", req, token=token)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert _code(info.value) == code
            with pytest.raises(grpc.RpcError) as info:
                next(iter(raw.call("Hold", pb.HoldRequest(session_id=raw.session_id),
                                   token=token)))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _stats(small_cap.endpoint)["sessions"] == 1
        # At most 4 Hold calls per session are open at once (each costs the service a task).
        holds = []
        try:
            for i in range(5):  # one after the other: each is open before the next
                holds.append(raw.stub.Hold(
                    pb.HoldRequest(session_id=raw.session_id), timeout=30,
                    metadata=((SESSION_TOKEN_METADATA_KEY, raw.token),)))
                if i < 4:
                    assert next(iter(holds[i])).orphan_ms == int(ORPHAN_S * 1000)
            with pytest.raises(grpc.RpcError) as info:
                next(iter(holds[4]))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            for h in holds:
                h.cancel()
        raw.call("Disconnect", req)
        assert _stats(small_cap.endpoint)["sessions"] == 0
        with pytest.raises(grpc.RpcError) as info:
            raw.call("Disconnect", req)
        assert _code(info.value) == "UNKNOWN_SESSION"


def test_sigterm_with_held_sessions_stops_at_once(
        service_factory: Callable[..., ServiceHandle]) -> None:
    """A service whose clients hold sessions (their Hold calls open) stops on SIGTERM
    without waiting out gRPC's 5 s grace for those calls, exits 0 and logs no traceback;
    the client's close afterwards returns (the service is gone) without raising."""
    svc = service_factory(encryption=False, flash_size=None, transports=["tcp"])
    with ctxmem.Client(svc.endpoint, transport="tcp", timeout_s=15) as c:
        c.open_namespace(LAYOUT, model_id="m", tenant="a").lookup(chain_keys(LAYOUT, 0, 1))
        c.open_namespace(LAYOUT, model_id="m", tenant="b").lookup(chain_keys(LAYOUT, 0, 1))
        _until(svc.endpoint, lambda s: s["sessions_held"] == 2, 10, "2 held sessions")
        start = time.monotonic()
        rc = svc.stop()
        took = time.monotonic() - start
    assert rc == 0
    assert took < 4.0, f"stopping took {took:.1f} s: it waited for the Hold calls"
    log = svc.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_session_replaced_after_a_failure_is_ended(small_cap: ServiceHandle,
                                                     transport: str) -> None:
    """The shim's data connection breaks under it (shut down, the process alive): the
    next get reconnects with a new session and retries (as before), and the replaced
    session is ended on the service by Disconnect (not left to the orphan rule; before:
    left for session_idle_s)."""
    keys, data = chain_keys(LAYOUT, 0, 1), blocks(1, BLOCK, 2)
    with ctxmem.Client(small_cap.endpoint, transport=transport, timeout_s=15) as c:
        ns = c.open_namespace(LAYOUT, model_id="m", tenant="a")
        ns.put(keys, data)
        c._sessions["a"].channel._sock.shutdown(socket.SHUT_RDWR)  # type: ignore[attr-defined]
        out = [np.zeros_like(data[0])]
        assert ns.get(keys, out) == 1 and np.array_equal(out[0], data[0])
        st, _ = _until(small_cap.endpoint, lambda s: s["sessions"] == 1, 5,
                       "the replaced session ended")
        assert st["sessions_disconnected"] == 1 and st["orphaned_sessions_closed"] == 0


_EXITS = textwrap.dedent("""
    import sys
    import grpc
    import ctxmem
    layout = ctxmem.KVLayout(dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=64,
                             tokens_per_block=16)
    c = ctxmem.Client(sys.argv[1], transport="tcp", timeout_s=15)
    ns = c.open_namespace(layout, model_id="m", tenant="a")
    # Kept where the interpreter collects it late, after gRPC's modules are torn down.
    grpc._ctxmem_test_keep = (c, ns)
    print("ready", flush=True)
""")


def test_a_client_never_closed_exits_quietly_and_its_session_ends(
        small_cap: ServiceHandle) -> None:
    """A process that exits without closing its client prints nothing at exit (its Hold
    calls are cancelled while gRPC is still there; before this, a call object collected
    after gRPC's teardown printed "Exception ignored" tracebacks), and its session ends as
    an orphan."""
    p = subprocess.run([sys.executable, "-c", _EXITS, small_cap.endpoint],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert p.returncode == 0 and p.stdout.strip() == "ready", (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr
    st, _ = _until(small_cap.endpoint, lambda s: s["sessions"] == 0, ORPHAN_BOUND_S,
                   "the exited client's session ended")
    assert st["orphaned_sessions_closed"] == 1
