"""The control fast path on the TCP data channel against hostile clients, on the real
service.

The same cases as the shared-memory socket's (test_shm_ops_boundary.py), sent as OP
frames on an authenticated TCP data connection: a bad magic, an unknown op, a body over
the cap or one that does not decode, a frame naming an id or index, a body that stops
halfway, answers never read, and ids of another session. The service must answer as
gRPC would (the same error), close a connection that broke the framing, and keep serving
every other client meanwhile.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable

import numpy as np
import pytest

import ctxmem
from ctxmem.transport.tcp import TcpChannel
from ctxmem_common.codecs import crc32c
from ctxmem_common.errors import (
    CtxmemError,
    ErrorCode,
    Expired,
    InvalidArgument,
    UnknownNamespace,
)
from ctxmem_common.netaddr import split_hostport
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.shm_ops import decode_error, encode_commit, encode_keys_request, encode_release
from ctxmem_common.wire import (
    OP_READ,
    SHM_OP_ACQUIRE,
    SHM_OP_ALLOCATE,
    SHM_OP_COMMIT,
    SHM_OP_LOOKUP,
    SHM_OP_RELEASE,
    TCP_HELLO,
    TCP_NO_ID,
    TCP_OP,
    TCP_OP_REPLY,
    TCP_REQ,
    TCP_RESP,
    Status,
)
from tests.adversary.raw import RawSession
from tests.adversary.sockets import recv_exact
from tests.adversary.test_shm_ops_boundary import _closed, _grpc_code
from tests.conftest import ServiceHandle
from tests.kit import byte_layout

LAYOUT = byte_layout(64 << 10)
KEYS = ctxmem.chain_hashes(range(4), 1, salt=b"tcp-ops")


@pytest.fixture
def svc(service_factory: Callable[..., ServiceHandle]) -> ServiceHandle:
    return service_factory(encryption=False, flash_size=None, transports=["tcp"],
                           data_plane={"read_timeout_s": 1.0})


def _raw(svc: ServiceHandle, model_id: str = "raw") -> RawSession:
    return RawSession(svc.endpoint, LAYOUT, transport="tcp", model_id=model_id)


def _conn(r: RawSession) -> socket.socket:
    """A bare TCP data connection that has said HELLO for ``r``'s session."""
    host, port = split_hostport(r.health.data_endpoint, "data endpoint")
    sock = socket.create_connection((host, port), timeout=10)
    sock.sendall(TCP_HELLO.pack(b"CXT1", r.session_id, r.token))
    magic, status, _ = TCP_RESP.unpack(recv_exact(sock, TCP_RESP.size))
    assert (magic, status) == (b"CXTA", Status.OK)
    return sock


def _frame(op: int, parts: list[bytes], ident: bytes = TCP_NO_ID, index: int = 0) -> bytes:
    body = b"".join(parts)
    return TCP_OP.pack(b"CXTO", op, ident, index, len(body)) + body


def _reply(sock: socket.socket) -> tuple[int, int, bytes]:
    magic, status, op, length = TCP_OP_REPLY.unpack(recv_exact(sock, TCP_OP_REPLY.size))
    assert magic == b"CXTP"
    return status, op, recv_exact(sock, length)


def _data(r: RawSession) -> TcpChannel:
    assert isinstance(r.data, TcpChannel)
    return r.data


def _still_serves(svc: ServiceHandle) -> None:
    """A well-behaved client gets exact bytes over the TCP fast path."""
    data = [np.full(LAYOUT.block_nbytes, 9, np.uint8)]
    keys = [b"\x42" * 32]
    with ctxmem.Client(svc.endpoint, transport="tcp") as c:
        ns = c.open_namespace(LAYOUT, model_id="good")
        ns.put(keys, data)
        out = [np.zeros(LAYOUT.block_nbytes, np.uint8)]
        assert ns.get(keys, out) == 1 and np.array_equal(out[0], data[0])
        ch = c._sessions["default"].channel
        assert isinstance(ch, TcpChannel) and ch.ops


def test_lookup_answers_exact_bytes(svc: ServiceHandle) -> None:
    """A LOOKUP frame's answer, byte for byte: hits, then one pb.Tier code per key."""
    with _raw(svc) as r:
        data = np.full(LAYOUT.block_nbytes, 1, np.uint8)
        alloc = r.allocate(KEYS[:2])
        r.write(alloc, [data.tobytes()] * 2)
        r.commit(alloc, [crc32c(data)] * 2)
        sock = _conn(r)
        sock.sendall(_frame(SHM_OP_LOOKUP, encode_keys_request(r.handle, b"".join(KEYS), 32,
                                                               True)))
        assert _reply(sock) == (Status.OK, SHM_OP_LOOKUP,
                                struct.pack("<I", 2) + bytes([pb.TIER_DRAM] * 2))
        sock.sendall(_frame(SHM_OP_LOOKUP, encode_keys_request(r.handle, b"".join(KEYS), 32,
                                                               False)))
        assert _reply(sock) == (Status.OK, SHM_OP_LOOKUP,
                                struct.pack("<I", 2) + bytes([pb.TIER_DRAM] * 2 + [0, 0]))
        sock.close()


@pytest.mark.parametrize("frame", [
    pytest.param(lambda h: TCP_OP.pack(b"CXTO", 99, TCP_NO_ID, 0, 0), id="unknown-op"),
    pytest.param(lambda h: TCP_OP.pack(b"CXTO", SHM_OP_LOOKUP, TCP_NO_ID, 0, 64 << 20),
                 id="oversize"),
    pytest.param(lambda h: _frame(SHM_OP_LOOKUP, encode_keys_request(h, KEYS[0], 32, True),
                                  ident=b"\x01" * 16), id="nonzero-id"),
    pytest.param(lambda h: _frame(SHM_OP_LOOKUP, encode_keys_request(h, KEYS[0], 32, True),
                                  index=3), id="nonzero-index"),
    pytest.param(lambda h: _frame(SHM_OP_RELEASE, [struct.pack("<II", 0, 5) + b"x"]),
                 id="release-count-disagrees"),
    pytest.param(lambda h: _frame(SHM_OP_COMMIT, [b"abc"]), id="commit-short"),
    pytest.param(lambda h: _frame(SHM_OP_ACQUIRE, [b"abcd"]), id="acquire-short"),
])
def test_a_malformed_op_is_refused_and_the_connection_closed(
        svc: ServiceHandle, frame: Callable[[int], bytes]) -> None:
    with _raw(svc) as r:
        before = svc.stats()["tcp_ops_refused"]
        sock = _conn(r)
        sock.sendall(frame(r.handle))
        status, _op, body = _reply(sock)
        assert status == Status.BAD_REQUEST and body == b""
        assert _closed(sock)
        sock.close()
        assert svc.stats()["tcp_ops_refused"] == before + 1
    _still_serves(svc)


def test_a_bad_magic_is_refused_and_the_connection_closed(svc: ServiceHandle) -> None:
    with _raw(svc) as r:
        sock = _conn(r)
        sock.sendall(TCP_REQ.pack(b"XXXX", SHM_OP_LOOKUP, TCP_NO_ID, 0, 0))
        magic, status, _ = TCP_RESP.unpack(recv_exact(sock, TCP_RESP.size))
        assert (magic, status) == (b"CXTA", Status.BAD_REQUEST)
        assert _closed(sock)
        sock.close()
    _still_serves(svc)


def test_a_body_that_stalls_is_dropped_while_others_are_served(svc: ServiceHandle) -> None:
    """Header and half a body, then nothing: dropped after data_plane.read_timeout_s (1 s
    here); meanwhile another client is served."""
    with _raw(svc) as r:
        sock = _conn(r)
        frame = _frame(SHM_OP_LOOKUP, encode_keys_request(r.handle, b"".join(KEYS), 32, True))
        sock.sendall(frame[:TCP_OP.size + 10])
        t0 = time.monotonic()
        _still_serves(svc)
        assert _closed(sock, within_s=10.0)
        assert time.monotonic() - t0 < 9.0
        sock.close()


def test_a_client_that_reads_no_answers_is_dropped(svc: ServiceHandle) -> None:
    """Pipelined LOOKUPs whose answers are never read: once the socket buffers are full
    the service's send waits read_timeout_s (1 s) and then closes the connection; other
    clients are served meanwhile, and the client gets far fewer answers than it asked
    for."""
    n = 200_000  # 4-byte keys: an 800 KB request, a 200 KB answer (prefix off)
    packed = np.arange(n, dtype="<u4").tobytes()
    with _raw(svc) as r:
        sock = _conn(r)
        frame = _frame(SHM_OP_LOOKUP, encode_keys_request(r.handle, packed, 4, False))
        answer = TCP_OP_REPLY.size + 4 + n
        sock.settimeout(0.5)
        sent = 0
        try:
            for _ in range(200):  # 40 MB of answers, far above the socket buffers
                sock.sendall(frame)
                sent += 1
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            pass  # the service stopped reading us or closed: either is the point
        _still_serves(svc)
        time.sleep(2.0)  # past read_timeout_s: the service gave up on us
        got = 0
        sock.settimeout(10.0)
        try:
            while chunk := sock.recv(1 << 20):
                got += len(chunk)
        except ConnectionResetError:
            pass
        assert got < sent * answer, "every answer was sent: the stalled send was not dropped"
        sock.close()


def _fast_code(ch: TcpChannel, op: int, parts: list[bytes]) -> tuple[str, type]:
    with pytest.raises(CtxmemError) as info:
        ch.call(op, parts)
    return info.value.code.value, type(info.value)


def test_another_sessions_ids_are_refused_as_over_grpc(svc: ServiceHandle) -> None:
    """Session B names A's namespace handle (not open in B), lease id and allocation id:
    the TCP fast path refuses each with the error gRPC gives for the same request."""
    with _raw(svc, "a") as a, _raw(svc, "b") as b:
        data = np.full(LAYOUT.block_nbytes, 3, np.uint8)
        alloc = a.allocate(KEYS[:1])
        a.write(alloc, [data.tobytes()])
        a.commit(alloc, [crc32c(data)])
        lease = a.acquire(KEYS[:1])
        other = a.allocate(KEYS[1:2])
        ch = _data(b)
        foreign = a.handle + 7  # a handle B never opened
        cases = [
            (SHM_OP_LOOKUP, encode_keys_request(foreign, KEYS[0], 32, True),
             lambda: b.call("Lookup", pb.LookupRequest(
                 session_id=b.session_id, namespace_handle=foreign, keys=KEYS[:1])),
             UnknownNamespace),
            (SHM_OP_ACQUIRE, encode_keys_request(foreign, KEYS[0], 32),
             lambda: b.call("Acquire", pb.AcquireRequest(
                 session_id=b.session_id, namespace_handle=foreign, keys=KEYS[:1])),
             UnknownNamespace),
            (SHM_OP_ALLOCATE, encode_keys_request(foreign, KEYS[2], 32),
             lambda: b.call("Allocate", pb.AllocateRequest(
                 session_id=b.session_id, namespace_handle=foreign, keys=KEYS[2:3])),
             UnknownNamespace),
            (SHM_OP_COMMIT, [encode_commit(other.id, [1], abort=False)],
             lambda: b.call("Commit", pb.CommitRequest(
                 session_id=b.session_id, allocation_id=other.id, crc32c=[1])),
             Expired),
        ]
        for op, parts, grpc_call, cls in cases:
            code, got = _fast_code(ch, op, parts)
            assert got is cls, (op, got)
            assert code == _grpc_code(grpc_call), op
        # Release of A's lease from B: "not valid" over both, and A's lease lives on.
        assert ch.call(SHM_OP_RELEASE, [encode_release([lease.id], no_reply=False)]) == b"\0"
        assert list(b.call("Release", pb.ReleaseRequest(
            session_id=b.session_id, lease_ids=[lease.id])).valid) == [False]
        assert a.read(lease) == [data.tobytes()]
        assert a.release(lease) == [True]


def test_a_commit_with_the_wrong_crc_count_is_refused(svc: ServiceHandle) -> None:
    with _raw(svc) as r:
        alloc = r.allocate(KEYS[:2])
        code, got = _fast_code(_data(r), SHM_OP_COMMIT, [encode_commit(alloc.id, [1], False)])
        assert got is InvalidArgument and code == ErrorCode.INVALID_ARGUMENT.value
        assert code == _grpc_code(lambda: r.commit(alloc, [1]))
        # the allocation is untouched: a correct commit (abort) still works
        _data(r).call(SHM_OP_COMMIT, [encode_commit(alloc.id, [], abort=True)])


def test_ops_and_reads_are_answered_in_order(svc: ServiceHandle) -> None:
    """A no-reply RELEASE sends nothing back, and an OP pipelined between READs is
    answered between their answers: the next answer on the socket is always the next
    request's."""
    with _raw(svc) as r:
        data = np.full(LAYOUT.block_nbytes, 6, np.uint8)
        alloc = r.allocate(KEYS[:1])
        r.write(alloc, [data.tobytes()])
        r.commit(alloc, [crc32c(data)])
        lease = r.acquire(KEYS[:1])
        sock = _conn(r)
        sock.sendall(_frame(SHM_OP_RELEASE, [encode_release([b"\0" * 16], no_reply=True)])
                     + TCP_REQ.pack(b"CXTR", OP_READ, lease.id, 0, 0)
                     + _frame(SHM_OP_LOOKUP, encode_keys_request(r.handle, KEYS[0], 32, True))
                     + _frame(SHM_OP_LOOKUP, encode_keys_request(r.handle + 9, KEYS[0], 32,
                                                                 True))
                     + TCP_REQ.pack(b"CXTR", OP_READ, lease.id, 0, 0))
        for i in range(3):
            if i != 1:  # the first and the last answer are the READs'
                magic, status, length = TCP_RESP.unpack(recv_exact(sock, TCP_RESP.size))
                assert (magic, status, length) == (b"CXTA", Status.OK, LAYOUT.block_nbytes)
                assert recv_exact(sock, length) == data.tobytes()
                continue
            assert _reply(sock) == (Status.OK, SHM_OP_LOOKUP,
                                    struct.pack("<I", 1) + bytes([pb.TIER_DRAM]))
            status, op, body = _reply(sock)
            assert (status, op) == (Status.ERROR, SHM_OP_LOOKUP)
            assert isinstance(decode_error(body), UnknownNamespace)
        sock.close()
        assert r.release(lease) == [True]


def test_duplicate_keys_in_a_fast_acquire_are_refused_as_over_grpc(svc: ServiceHandle
                                                                   ) -> None:
    """A TCP ACQUIRE with a repeated key is refused with gRPC's error, nothing leased."""
    with _raw(svc) as r:
        data = np.full(LAYOUT.block_nbytes, 5, np.uint8)
        alloc = r.allocate(KEYS[:2])
        r.write(alloc, [data.tobytes()] * 2)
        r.commit(alloc, [crc32c(data)] * 2)
        dup = [KEYS[0], KEYS[1], KEYS[0]]
        code, got = _fast_code(_data(r), SHM_OP_ACQUIRE,
                               encode_keys_request(r.handle, b"".join(dup), 32))
        assert got is InvalidArgument and code == ErrorCode.INVALID_ARGUMENT.value
        assert code == _grpc_code(lambda: r.call("Acquire", pb.AcquireRequest(
            session_id=r.session_id, namespace_handle=r.handle, keys=dup)))
        lease = r.acquire(KEYS[:2])  # the blocks are intact and leasable
        assert r.read(lease) == [data.tobytes()] * 2
        assert r.release(lease) == [True]
        assert svc.stats()["leases"] == 0
