"""Issue 12 item 4: the TCP (and Unix-socket) data plane is bounded against hostile clients.

Each test drives a REAL service process with hand-made frames (tests/adversary/raw.py for
the gRPC steps, a bare socket for the data channel) and checks what a tenant that does
not trust the others needs: a header is checked before any buffer is allocated, a bad
one closes the connection without a traceback, every wait has a deadline (a stalled
write's allocation still expires), and connections are capped in total and per tenant.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

import ctxmem
from ctxmem_common.codecs import crc32c
from ctxmem_common.netaddr import split_hostport
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.wire import OP_READ, OP_WRITE, TCP_HELLO, TCP_REQ, TCP_RESP, Status
from ctxmem_tools.launcher import local_config
from tests.adversary.raw import RawSession
from tests.adversary.sockets import recv_exact
from tests.conftest import ServiceHandle
from tests.kit import byte_layout, until

BLOCK = 16 << 10
LAYOUT = byte_layout(BLOCK)
HELLO_S = 1.0
READ_S = 1.0
IDLE_S = 2.0
TTL_S = 1.0
PER_TENANT = 3
TOTAL = 6


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceHandle]:
    """One service for the module, with short deadlines and small caps."""
    workdir = tmp_path_factory.mktemp("bounds")
    cfg = local_config(workdir, transports=["shm", "tcp"], flash_size=None,
                       dram_size="8MiB", dram_slab="4MiB", allocation_ttl_s=TTL_S,
                       data_plane={"hello_timeout_s": HELLO_S, "read_timeout_s": READ_S,
                                   "idle_timeout_s": IDLE_S, "max_connections": TOTAL,
                                   "max_connections_per_tenant": PER_TENANT})
    h = ServiceHandle(workdir, cfg)
    yield h
    h.stop()


def _raw(svc: ServiceHandle, tenant: str = "default") -> RawSession:
    return RawSession(svc.endpoint, LAYOUT, transport="tcp", tenant=tenant)


def _connect(r: RawSession, hello: bool = True) -> socket.socket:
    host, port = split_hostport(r.health.data_endpoint, "data endpoint")
    sock = socket.create_connection((host, port), timeout=10)
    if hello:
        sock.sendall(TCP_HELLO.pack(b"CXT1", r.session_id, r.token))
        magic, status, _ = TCP_RESP.unpack(recv_exact(sock, TCP_RESP.size))
        assert (magic, status) == (b"CXTA", Status.OK)
    return sock




def _status_then_closed(sock: socket.socket, within_s: float) -> int | None:
    """The status the service answered (None if it closed without one), after checking
    the connection is then closed within ``within_s``."""
    sock.settimeout(within_s)
    data = b""
    try:
        while True:
            got = sock.recv(4096)
            if not got:
                break
            data += got
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the service kept the connection open past {within_s} s "
                    f"(received {len(data)} bytes)")
    if len(data) >= TCP_RESP.size:
        return int(TCP_RESP.unpack(data[:TCP_RESP.size])[1])
    return None


def _rss_kib(svc: ServiceHandle) -> int:
    assert svc.proc is not None
    for line in Path(f"/proc/{svc.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/PID/status")


def _log_since(svc: ServiceHandle, mark: int) -> str:
    return svc.log_path.read_bytes()[mark:].decode(errors="replace")


def test_a_huge_write_header_allocates_nothing_and_closes(svc: ServiceHandle) -> None:
    with _raw(svc) as r:
        a = r.allocate([b"h" * 16])
        before = _rss_kib(svc)
        sock = _connect(r)
        sock.sendall(TCP_REQ.pack(b"CXTR", OP_WRITE, a.id, 0, 512 << 20) + b"x" * 4096)
        assert _status_then_closed(sock, 5) == Status.WRONG_LENGTH
        sock.close()
        grown = _rss_kib(svc) - before
        assert grown < 16 << 10, f"service RSS grew {grown} KiB on a 512 MiB header"


@pytest.mark.parametrize("header, status", [
    (lambda a: TCP_REQ.pack(b"CXTR", OP_WRITE, a, 0, (1 << 64) - 1), Status.WRONG_LENGTH),
    (lambda a: TCP_REQ.pack(b"XXXX", OP_WRITE, a, 0, BLOCK), Status.BAD_REQUEST),
    (lambda a: TCP_REQ.pack(b"CXTR", 99, a, 0, BLOCK), Status.BAD_REQUEST),
    (lambda a: TCP_REQ.pack(b"CXTR", OP_WRITE, b"\xff" * 16, 0, BLOCK), Status.EXPIRED),
    (lambda a: TCP_REQ.pack(b"CXTR", OP_WRITE, a, (1 << 32) - 1, BLOCK), Status.BAD_REQUEST),
    (lambda a: TCP_REQ.pack(b"CXTR", OP_READ, a, 0, (1 << 64) - 1), Status.EXPIRED),
], ids=["len-2^64-1", "bad-magic", "bad-op", "unknown-allocation", "index-2^32-1",
        "unknown-lease"])
def test_a_bad_header_is_answered_and_closed_without_a_traceback(
        svc: ServiceHandle, header: object, status: Status) -> None:
    mark = svc.log_path.stat().st_size
    with _raw(svc) as r:
        a = r.allocate([b"b" * 16])
        sock = _connect(r)
        sock.sendall(header(a.id) + b"junk" * 64)  # type: ignore[operator]
        assert _status_then_closed(sock, 5) == status
        sock.close()
    time.sleep(0.2)
    text = _log_since(svc, mark)
    assert "Traceback" not in text, text
    assert "closed:" in text, f"no log line for the refused header:\n{text}"


def test_a_stalled_write_is_dropped_and_its_allocation_expires(svc: ServiceHandle) -> None:
    until(lambda: svc.stats()["dram_used_bytes"] == 0, TTL_S + 5,
          "earlier tests' allocations to expire", 0.1)
    with _raw(svc) as r:
        expired0 = svc.stats()["expired_allocations"]
        keys = [bytes([i]) * 16 for i in range(4)]
        a = r.allocate(keys)
        sock = _connect(r)
        sock.sendall(TCP_REQ.pack(b"CXTR", OP_WRITE, a.id, 0, BLOCK) + b"x")  # then stall
        t0 = time.monotonic()
        _status_then_closed(sock, READ_S + 4)
        assert time.monotonic() - t0 < READ_S + 4
        sock.close()
        until(lambda: svc.stats()["expired_allocations"] > expired0
              and svc.stats()["dram_used_bytes"] == 0,  # its slots went back
              TTL_S + 5, "the stalled write's allocation to expire", 0.1)
    with ctxmem.Client(svc.endpoint, transport="tcp") as c:  # and serve another put
        ns = c.open_namespace(LAYOUT, model_id="after-stall")
        data = [np.full(LAYOUT.block_nbytes, i, dtype=np.uint8) for i in range(4)]
        assert ns.put(keys, data).stored == 4
        out = [np.zeros_like(d) for d in data]
        assert ns.get(keys, out) == 4
        assert all(np.array_equal(x, y) for x, y in zip(data, out, strict=True))


def test_a_second_connection_cannot_write_an_allocation_being_written(
        svc: ServiceHandle) -> None:
    """Two writers would each hold the allocation and the first to finish would end the
    other's hold: the reaper could then recycle slots still being written."""
    with _raw(svc) as r:
        a = r.allocate([b"c" * 16, b"d" * 16])
        first = _connect(r)
        first.sendall(TCP_REQ.pack(b"CXTR", OP_WRITE, a.id, 0, BLOCK) + b"x")  # stalls
        time.sleep(0.2)
        second = _connect(r)
        second.sendall(TCP_REQ.pack(b"CXTR", OP_WRITE, a.id, 1, BLOCK) + b"y" * BLOCK)
        assert _status_then_closed(second, 5) == Status.BAD_REQUEST
        second.close()
        first.close()


def test_no_hello_is_closed_after_the_hello_deadline(svc: ServiceHandle) -> None:
    with _raw(svc) as r:
        sock = _connect(r, hello=False)
        t0 = time.monotonic()
        assert _status_then_closed(sock, HELLO_S + 4) is None
        assert time.monotonic() - t0 >= HELLO_S * 0.8
        sock.close()
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.connect(r.health.shm_socket)
        unix.settimeout(HELLO_S + 4)
        try:
            assert unix.recv(64) == b"", "shared-memory socket answered a missing HELLO"
        except TimeoutError:
            pytest.fail("the shared-memory socket kept a connection with no HELLO open")
        finally:
            unix.close()


def test_an_idle_connection_is_closed(svc: ServiceHandle) -> None:
    with _raw(svc) as r:
        sock = _connect(r)
        t0 = time.monotonic()
        assert _status_then_closed(sock, IDLE_S + 4) is None
        assert time.monotonic() - t0 >= IDLE_S * 0.8
        sock.close()


def test_connections_over_the_caps_are_refused(svc: ServiceHandle) -> None:
    with _raw(svc, tenant="greedy") as r, _raw(svc, tenant="other") as other:
        # Each raw session holds one data connection of its own: the greedy tenant opens
        # the rest of its per-tenant cap.
        mine = [_connect(r) for _ in range(PER_TENANT - 1)]
        extra = _connect(r, hello=False)
        extra.sendall(TCP_HELLO.pack(b"CXT1", r.session_id, r.token))
        assert _status_then_closed(extra, 5) == Status.TOO_MANY_CONNECTIONS
        extra.close()
        theirs = _connect(other)  # another tenant is not starved by the greedy one
        # Fill the total cap with connections that never say HELLO: the next is refused.
        host, port = split_hostport(r.health.data_endpoint, "data endpoint")
        silent = [socket.create_connection((host, port), timeout=5)
                  for _ in range(TOTAL - PER_TENANT - 2)]
        time.sleep(0.2)
        over = socket.create_connection((host, port), timeout=5)
        assert _status_then_closed(over, 5) == Status.TOO_MANY_CONNECTIONS
        over.close()
        for s in mine + silent + [theirs]:
            s.close()
        time.sleep(0.3)
        _connect(r).close()  # closed connections give their places back


def test_commit_or_abort_while_a_write_is_in_flight_is_refused(svc: ServiceHandle) -> None:
    """A Commit racing a WRITE of the same allocation could checksum a slot whose bytes
    then change (a committed block with bytes not its own), and an abort could free slots
    the WRITE is still filling: both are refused until the WRITE is answered."""
    with _raw(svc) as r:
        keys = [bytes([0x40 + i]) * 16 for i in range(2)]
        a = r.allocate(keys)
        payload = bytes(range(256)) * (BLOCK // 256)
        sock = _connect(r)
        sock.sendall(TCP_REQ.pack(b"CXTR", OP_WRITE, a.id, 0, BLOCK) + payload[:4096])
        time.sleep(0.3)  # the service is now inside the WRITE, waiting for the rest
        for abort in (False, True):
            with pytest.raises(grpc.RpcError) as err:
                r.call("Commit", pb.CommitRequest(session_id=r.session_id, allocation_id=a.id,
                                                  crc32c=[crc32c(payload)] * 2, abort=abort))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "still in flight" in (err.value.details() or "")
        sock.sendall(payload[4096:])
        assert TCP_RESP.unpack(recv_exact(sock, TCP_RESP.size))[1] == Status.OK
        sock.sendall(TCP_REQ.pack(b"CXTR", OP_WRITE, a.id, 1, BLOCK) + payload)
        assert TCP_RESP.unpack(recv_exact(sock, TCP_RESP.size))[1] == Status.OK
        sock.close()
        done = r.call("Commit", pb.CommitRequest(session_id=r.session_id, allocation_id=a.id,
                                                 crc32c=[crc32c(payload)] * 2))
        assert done.committed == 2


def test_a_reader_that_stops_reading_is_dropped(svc: ServiceHandle) -> None:
    """READ answers leave with one non-blocking ``sendmsg`` and no timer; what the socket
    does not take at once must still move within ``read_timeout_s``, or the connection
    is dropped (the service does not wait forever on a client that stopped reading)."""
    with _raw(svc) as r:
        keys = [b"s" * 16]
        block = b"z" * BLOCK
        a = r.allocate(keys)
        r.write(a, [block])
        assert r.commit(a, [crc32c(block)]).committed == 1
        lease = r.acquire(keys)
        sock = _connect(r)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        n = 4096  # answers: 64 MiB, far more than the sockets' buffers hold
        sock.sendall(TCP_REQ.pack(b"CXTR", OP_READ, lease.id, 0, BLOCK) * n)
        time.sleep(READ_S + 2)  # read nothing: the service's send stalls, then is dropped
        sock.settimeout(5)
        got = 0
        t0 = time.monotonic()
        try:  # dropped: only what the buffers held is left, then the end
            while chunk := sock.recv(1 << 20):
                got += len(chunk)
                assert time.monotonic() - t0 < 5, (
                    f"the service still sends after {got} bytes: the stalled reader "
                    f"was never dropped")
        except ConnectionResetError:
            pass
        except TimeoutError:
            pytest.fail(f"the connection stayed open after {got} bytes")
        sock.close()
        assert got < n * (TCP_RESP.size + BLOCK), "the stalled reader was never dropped"
        r.release(lease)
