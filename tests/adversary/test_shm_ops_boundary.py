"""The shared-memory control fast path against hostile clients, on the real service.

Each test is something a same-host client can send on its authenticated data socket: a
frame with a bad magic, an unknown op, a body over the cap or one that does not decode, a
body that stops halfway, a flood of ops whose answers it never reads, and ids of another
session. The service must answer as gRPC would (the same error), close a connection that
broke the framing, and keep serving every other client meanwhile.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable

import numpy as np
import pytest

import ctxmem
from ctxmem.transport.shm import ShmChannel
from ctxmem_common.errors import (
    CtxmemError,
    ErrorCode,
    Expired,
    InvalidArgument,
    UnknownNamespace,
)
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.shm_ops import (
    decode_error,
    encode_commit,
    encode_keys_request,
    encode_release,
)
from ctxmem_common.wire import (
    SHM_MAP,
    SHM_MAP_REPLY,
    SHM_OP,
    SHM_OP_ACQUIRE,
    SHM_OP_ALLOCATE,
    SHM_OP_COMMIT,
    SHM_OP_LOOKUP,
    SHM_OP_RELEASE,
    SHM_OP_REPLY,
    Status,
)
from tests.adversary.raw import RawSession
from tests.adversary.shm_raw import shm_connect
from tests.adversary.sockets import recv_exact
from tests.conftest import ServiceHandle
from tests.kit import byte_layout, until

LAYOUT = byte_layout(64 << 10)
KEYS = ctxmem.chain_hashes(range(4), 1, salt=b"ops")


@pytest.fixture
def svc(service_factory: Callable[..., ServiceHandle]) -> ServiceHandle:
    return service_factory(encryption=False, flash_size=None,
                           data_plane={"read_timeout_s": 1.0},
                           service={"shm_reply_deadline_s": 1.0})




def _reply(sock: socket.socket) -> tuple[int, int, bytes]:
    magic, status, op, length = SHM_OP_REPLY.unpack(recv_exact(sock, SHM_OP_REPLY.size))
    assert magic == b"CXSP"
    return status, op, recv_exact(sock, length)


def _closed(sock: socket.socket, within_s: float = 5.0) -> bool:
    """Whether the service closed ``sock`` (EOF or reset) within ``within_s``."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _raw_conn(r: RawSession) -> socket.socket:
    sock, status = shm_connect(r.health.shm_socket, r.session_id, r.token)
    assert status == Status.OK
    return sock


def _send_op(sock: socket.socket, op: int, parts: list[bytes]) -> None:
    body = b"".join(parts)
    sock.sendall(SHM_OP.pack(b"CXSO", op, len(body)) + body)


def _still_serves(svc: ServiceHandle) -> None:
    """A well-behaved client gets exact bytes over the fast path."""
    data = [np.full(LAYOUT.block_nbytes, 9, np.uint8)]
    keys = [b"\x42" * 32]
    with ctxmem.Client(svc.endpoint, transport="shm") as c:
        ns = c.open_namespace(LAYOUT, model_id="good")
        ns.put(keys, data)
        out = [np.zeros(LAYOUT.block_nbytes, np.uint8)]
        assert ns.get(keys, out) == 1 and np.array_equal(out[0], data[0])


@pytest.mark.parametrize("frame", [
    pytest.param(lambda h: SHM_OP.pack(b"CXSO", 99, 0), id="unknown-op"),
    pytest.param(lambda h: SHM_OP.pack(b"CXSO", SHM_OP_LOOKUP, (64 << 20)), id="oversize"),
    pytest.param(lambda h: SHM_OP.pack(b"CXSO", SHM_OP_RELEASE, 9) + struct.pack(
        "<II", 0, 5) + b"x", id="release-count-disagrees"),
    pytest.param(lambda h: SHM_OP.pack(b"CXSO", SHM_OP_COMMIT, 3) + b"abc",
                 id="commit-short"),
    pytest.param(lambda h: SHM_OP.pack(b"CXSO", SHM_OP_ACQUIRE, 4) + b"abcd",
                 id="acquire-short"),
])
def test_a_malformed_op_is_refused_and_the_connection_closed(
        svc: ServiceHandle, frame: Callable[[int], bytes]) -> None:
    with RawSession(svc.endpoint, LAYOUT) as r:
        before = svc.stats()["shm_ops_refused"]
        sock = _raw_conn(r)
        sock.sendall(frame(r.handle))
        status, _op, body = _reply(sock)
        assert status == Status.BAD_REQUEST and body == b""
        assert _closed(sock)
        sock.close()
        assert svc.stats()["shm_ops_refused"] == before + 1
    _still_serves(svc)


def test_a_bad_magic_is_refused_and_the_connection_closed(svc: ServiceHandle) -> None:
    with RawSession(svc.endpoint, LAYOUT) as r:
        sock = _raw_conn(r)
        sock.sendall(SHM_MAP.pack(b"XXXX", 0, 0))
        _m, status, _g, _size = SHM_MAP_REPLY.unpack(recv_exact(sock, SHM_MAP_REPLY.size))
        assert status == Status.BAD_REQUEST
        assert _closed(sock)
        sock.close()
    _still_serves(svc)


def test_a_body_that_stalls_is_dropped_while_others_are_served(svc: ServiceHandle) -> None:
    """Header and half a body, then nothing: dropped after data_plane.read_timeout_s (1 s
    here); meanwhile another client is served."""
    with RawSession(svc.endpoint, LAYOUT) as r:
        sock = _raw_conn(r)
        body = b"".join(encode_keys_request(r.handle, b"".join(KEYS), 32, True))
        sock.sendall(SHM_OP.pack(b"CXSO", SHM_OP_LOOKUP, len(body)) + body[:10])
        t0 = time.monotonic()
        _still_serves(svc)
        assert _closed(sock, within_s=10.0)
        assert time.monotonic() - t0 < 9.0
        sock.close()


def test_a_client_that_reads_no_replies_is_dropped(svc: ServiceHandle) -> None:
    """Pipelined Lookups whose answers are never read: the queue (or the deadline) ends
    the connection, counted as a slow reader; other clients are served meanwhile."""
    keys = ctxmem.chain_hashes(range(20_000), 1, salt=b"flood")
    with RawSession(svc.endpoint, LAYOUT) as r:
        before = svc.stats()["shm_slow_readers"]
        sock = _raw_conn(r)
        frame = b"".join(encode_keys_request(r.handle, b"".join(keys), 32, False))
        frame = SHM_OP.pack(b"CXSO", SHM_OP_LOOKUP, len(frame)) + frame
        sock.settimeout(0.5)
        try:
            for _ in range(400):
                sock.sendall(frame)
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            pass  # the service stopped reading us or closed: either is the point
        _still_serves(svc)
        until(lambda: svc.stats()["shm_slow_readers"] != before, 10,
              "the slow reader to be counted", 0.2)
        assert svc.stats()["shm_slow_readers"] == before + 1
        sock.close()


def _grpc_code(call: Callable[[], object]) -> str:
    import grpc

    try:
        call()
    except grpc.RpcError as exc:
        for key, value in exc.trailing_metadata() or ():  # type: ignore[attr-defined]
            if key == "ctxmem-error":
                return str(value)
    raise AssertionError("the gRPC call was not refused")


def _fast_code(ch: ShmChannel, op: int, parts: list[bytes]) -> tuple[str, type]:
    with pytest.raises(CtxmemError) as info:
        ch.call(op, parts)
    return info.value.code.value, type(info.value)


def test_another_sessions_ids_are_refused_as_over_grpc(svc: ServiceHandle) -> None:
    """Session B names A's namespace handle (not open in B), lease id and allocation id:
    the fast path refuses each with the error gRPC gives for the same request."""
    with RawSession(svc.endpoint, LAYOUT, model_id="a") as a, \
            RawSession(svc.endpoint, LAYOUT, model_id="b") as b:
        data = np.full(LAYOUT.block_nbytes, 3, np.uint8)
        alloc = a.allocate(KEYS[:1])
        a.write(alloc, [data.tobytes()])
        from ctxmem_common.codecs import crc32c

        a.commit(alloc, [crc32c(data)])
        lease = a.acquire(KEYS[:1])
        other = a.allocate(KEYS[1:2])
        assert isinstance(b.data, ShmChannel)
        ch = b.data
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
    with RawSession(svc.endpoint, LAYOUT) as r:
        assert isinstance(r.data, ShmChannel)
        alloc = r.allocate(KEYS[:2])
        code, got = _fast_code(r.data, SHM_OP_COMMIT, [encode_commit(alloc.id, [1], False)])
        assert got is InvalidArgument and code == ErrorCode.INVALID_ARGUMENT.value
        assert code == _grpc_code(lambda: r.commit(alloc, [1]))
        # the allocation is untouched: a correct commit (abort) still works
        r.data.call(SHM_OP_COMMIT, [encode_commit(alloc.id, [], abort=True)])


def test_a_no_reply_release_keeps_the_replies_in_order(svc: ServiceHandle) -> None:
    """RELEASE flagged no-reply sends nothing back: the next op's reply is the next one on
    the socket (a reply for it would be read as the Lookup's answer)."""
    with RawSession(svc.endpoint, LAYOUT) as r:
        sock = _raw_conn(r)
        _send_op(sock, SHM_OP_RELEASE, [encode_release([b"\0" * 16], no_reply=True)])
        _send_op(sock, SHM_OP_LOOKUP, encode_keys_request(r.handle, KEYS[0], 32, True))
        status, op, body = _reply(sock)
        assert (status, op) == (Status.OK, SHM_OP_LOOKUP) and body[:4] == b"\0\0\0\0"
        _send_op(sock, SHM_OP_LOOKUP, encode_keys_request(r.handle + 9, KEYS[0], 32, True))
        status, op, body = _reply(sock)
        assert status == Status.ERROR
        assert isinstance(decode_error(body), UnknownNamespace)
        sock.close()


def test_duplicate_keys_in_a_fast_acquire_are_refused_as_over_grpc(svc: ServiceHandle
                                                                   ) -> None:
    """The fast path's Acquire checks its keys once (in the frame's decoding, not again in
    the store): a batch with a repeated key is still refused, with gRPC's error, and
    nothing is leased."""
    with RawSession(svc.endpoint, LAYOUT) as r:
        assert isinstance(r.data, ShmChannel)
        data = np.full(LAYOUT.block_nbytes, 5, np.uint8)
        from ctxmem_common.codecs import crc32c

        alloc = r.allocate(KEYS[:2])
        r.write(alloc, [data.tobytes()] * 2)
        r.commit(alloc, [crc32c(data)] * 2)
        dup = [KEYS[0], KEYS[1], KEYS[0]]
        code, got = _fast_code(r.data, SHM_OP_ACQUIRE,
                               encode_keys_request(r.handle, b"".join(dup), 32))
        assert got is InvalidArgument and code == ErrorCode.INVALID_ARGUMENT.value
        assert code == _grpc_code(lambda: r.call("Acquire", pb.AcquireRequest(
            session_id=r.session_id, namespace_handle=r.handle, keys=dup)))
        lease = r.acquire(KEYS[:2])  # the blocks are intact and leasable
        assert r.read(lease) == [data.tobytes()] * 2
        assert r.release(lease) == [True]
