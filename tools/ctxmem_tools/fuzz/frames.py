"""Raw data-plane cases: the TCP data port and the shared-memory Unix socket.

Frames are built from the structs in :mod:`ctxmem_common.wire` only (never from the data
servers' code), so the cases keep their meaning when a server's internals change. Each
case opens its own connection(s) to loopback or the Unix socket, sends a valid HELLO of
one of the fuzzer's sessions (or a mutated one), then valid and mutated frames (bit
flips, truncations, oversized and 2^64-1 lengths, unknown ops, wrong magic, random
bytes), half-closes, and reads what comes back until EOF or a short deadline. Some
cases interleave frames over several connections; others leave a connection stalled
mid-frame, or send MAP/READ requests without ever reading the replies, in a bounded pool
of at most ``max_stalled`` connections that is drained oldest first.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import time
from collections import deque
from collections.abc import Callable

from ctxmem_common.shm_ops import encode_commit, encode_keys_request, encode_release
from ctxmem_common.wire import (
    OP_READ,
    OP_WRITE,
    SHM_HELLO,
    SHM_MAP,
    SHM_OP_ACQUIRE,
    SHM_OP_ALLOCATE,
    SHM_OP_COMMIT,
    SHM_OP_LOOKUP,
    SHM_OP_NAMES,
    SHM_OP_RELEASE,
    SHM_STAGE_OPS,
    SHM_STATUS,
    TCP_HELLO,
    TCP_NO_ID,
    TCP_OP,
    TCP_REQ,
    TCP_RESP,
    Status,
)
from ctxmem_tools.fuzz.messages import Identity, MessageFuzzer, Pools, mutate_bytes

U64_MAX = (1 << 64) - 1


def _status_name(value: int) -> str:
    try:
        return Status(value).name
    except ValueError:
        return f"status_{value}"


class FrameTarget:
    """Cases against one data-plane socket: ``kind`` is ``"tcp"`` or ``"shm"``."""

    def __init__(self, kind: str, address: str | tuple[str, int], rng: random.Random,
                 pools: Pools, fuzzer: MessageFuzzer, *, max_stalled: int = 16,
                 read_deadline_s: float = 2.0) -> None:
        self.kind = kind
        self.address = address
        self.rng = rng
        self.pools = pools
        self.fuzzer = fuzzer
        self.read_deadline_s = read_deadline_s
        self.stalled: deque[socket.socket] = deque()
        self.max_stalled = max_stalled
        self.fds_received = 0

    # -- connections ----------------------------------------------------------------------
    def _connect(self) -> socket.socket:
        if self.kind == "shm":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(self.read_deadline_s)
        try:
            sock.connect(self.address)
        except BaseException:
            sock.close()
            raise
        return sock

    def _stall(self, sock: socket.socket) -> None:
        """Keep ``sock`` open and silent; the oldest stalled one is closed when full."""
        self.stalled.append(sock)
        while len(self.stalled) > self.max_stalled:
            self.stalled.popleft().close()

    def close(self) -> None:
        """Close every stalled connection."""
        while self.stalled:
            self.stalled.popleft().close()

    def _drain(self, sock: socket.socket) -> bytes:
        """Half-close, then read until EOF or the deadline; fds passed back are closed."""
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
        got = bytearray()
        deadline = time.monotonic() + self.read_deadline_s
        while time.monotonic() < deadline and len(got) < (8 << 20):
            try:
                if self.kind == "shm":
                    data, fds, _, _ = socket.recv_fds(sock, 65536, 16)
                    for fd in fds:
                        self.fds_received += 1
                        with contextlib.suppress(OSError):
                            os.close(fd)
                else:
                    data = sock.recv(65536)
            except TimeoutError:
                got += b"<timeout>"
                break
            except OSError:
                got += b"<reset>"
                break
            if not data:
                break
            got += data
        return bytes(got)

    # -- frames -----------------------------------------------------------------------------
    def _me(self) -> Identity:
        return self.rng.choice(self.pools.own)

    def hello(self, me: Identity, valid: bool = True) -> bytes:
        """A HELLO of ``me``; when not ``valid``, one of the ways a HELLO goes wrong."""
        st, magic = (SHM_HELLO, b"CXS1") if self.kind == "shm" else (TCP_HELLO, b"CXT1")
        if valid:
            return st.pack(magic, me.session_id, me.token)
        r = self.rng
        victim = r.choice(self.pools.victims)
        pick = r.randrange(7)
        if pick == 0:
            return st.pack(r.choice((b"CXS1", b"CXT1", b"CXTR", b"\0\0\0\0")), me.session_id,
                           me.token)
        if pick == 1:  # a victim's session id with the fuzzer's own token
            return st.pack(magic, victim.session_id, me.token)
        if pick == 2:
            return st.pack(magic, me.session_id, r.randbytes(16))
        if pick == 3:
            return st.pack(magic, r.randbytes(16), r.randbytes(16))
        if pick == 4:
            return st.pack(magic, me.session_id, me.token)[:r.randrange(st.size)]
        if pick == 5:
            return r.randbytes(r.randrange(0, 200))
        return mutate_bytes(r, st.pack(magic, me.session_id, me.token))

    def _an_id(self) -> bytes:
        r, p = self.rng, self.pools
        pools = [p.own_allocations, p.own_leases, p.victim_ids]
        pool = r.choice(pools)
        if pool and r.random() < 0.8:
            return r.choice(list(pool))
        return self.fuzzer.an_id(self._me())[:16].ljust(16, b"\0")

    def tcp_request(self) -> bytes:
        """A TCP REQ frame: valid-looking, or mutated (op, length, magic, bytes); a quarter
        are control fast-path OP frames (:meth:`tcp_op`)."""
        r = self.rng
        if r.random() < 0.25:
            return self.tcp_op()
        op = r.choice((OP_READ, OP_WRITE))
        index = r.choice((0, 0, 1, 2, 7, (1 << 32) - 1, r.randrange(1 << 32)))
        length = r.choice((8192, 8192, 0, 1, 8191, 8193, 65536, 1 << 32, 1 << 40, U64_MAX))
        magic = b"CXTR"
        pick = r.random()
        if pick < 0.1:
            op = r.choice((0, 3, 127, 255))
        elif pick < 0.2:
            magic = r.choice((b"CXTA", b"CXS1", b"\0\0\0\0", r.randbytes(4)))
        frame = TCP_REQ.pack(magic, op, self._an_id(), index, length)
        if op == OP_WRITE and length <= 65536 and r.random() < 0.7:
            payload = r.randbytes(length)
            if r.random() < 0.3:
                payload = payload[:r.randrange(length + 1)]
            frame += payload
        if r.random() < 0.15:
            frame = mutate_bytes(r, frame)
        return frame

    def tcp_op(self) -> bytes:
        """A TCP OP frame (the control fast path): a well-formed body of a random op with
        random handles, keys and ids, or mutated (op, id/index, length, bytes)."""
        r = self.rng
        op = r.choice(sorted(SHM_OP_NAMES))
        handle = r.choice((0, 1, 2, (1 << 32) - 1, r.randrange(1 << 32)))
        key_len = r.choice((32, 32, 16, 0, 1, 64, 65))
        keys = r.randbytes(r.choice((0, 1, 2, 16, 300)) * key_len)
        body: bytes
        if op in (SHM_OP_ACQUIRE, SHM_OP_ALLOCATE):
            body = b"".join(encode_keys_request(handle, keys, key_len))
        elif op == SHM_OP_LOOKUP:
            body = b"".join(encode_keys_request(handle, keys, key_len, r.random() < 0.5))
        elif op == SHM_OP_RELEASE:
            body = encode_release([self._an_id() for _ in range(r.randrange(4))],
                                  r.random() < 0.5)
        elif op in SHM_STAGE_OPS:  # shared memory only: TCP answers them UNSUPPORTED
            body = r.randbytes(r.choice((0, 4, 8, 20, 64)))
        else:
            assert op == SHM_OP_COMMIT
            body = encode_commit(self._an_id(), [r.randrange(1 << 32)
                                                 for _ in range(r.randrange(4))],
                                 r.random() < 0.2)
        ident, index, length = TCP_NO_ID, 0, len(body)
        pick = r.random()
        if pick < 0.1:
            op = r.choice((0, 9, 99, 255))
        elif pick < 0.2:
            length = r.choice((1 << 40, U64_MAX, (16 << 20) + 8192, max(0, length - 1)))
        elif pick < 0.25:
            ident, index = self._an_id(), r.choice((0, 1, (1 << 32) - 1))
        frame = TCP_OP.pack(b"CXTO", op, ident, index, length) + body
        if r.random() < 0.15:
            frame = mutate_bytes(r, frame)
        return frame

    def shm_request(self) -> bytes:
        """A MAP frame: of a slab the service handed out (valid), or mutated."""
        r = self.rng
        regions = sorted(self.pools.regions) or [(0, 0)]
        region, generation = r.choice(regions) if r.random() < 0.6 else (
            r.choice((0, 1, 2, 1 << 16, (1 << 32) - 1, r.randrange(1 << 32))),
            r.choice((0, 1, (1 << 32) - 1)))
        magic = b"CXSM" if r.random() < 0.9 else r.choice((b"CXS1", b"\0\0\0\0", r.randbytes(4)))
        frame = SHM_MAP.pack(magic, region, generation)
        if r.random() < 0.15:
            frame = mutate_bytes(r, frame)
        return frame

    def request(self) -> bytes:
        return self.shm_request() if self.kind == "shm" else self.tcp_request()

    # -- cases ----------------------------------------------------------------------------
    def case(self) -> str:
        """Run one case; the outcome label (the first status the service answered)."""
        r = self.rng
        pick = r.random()
        try:
            if pick < 0.25:
                return self._one(self.hello(self._me(), valid=False), [])
            if pick < 0.8:
                frames = [self.request() for _ in range(r.randrange(1, 9))]
                return self._one(self.hello(self._me()), frames)
            if pick < 0.92:
                return self._interleaved()
            return self._stalled_case()
        except (ConnectionError, TimeoutError) as exc:
            return f"conn_{type(exc).__name__}"

    def _one(self, hello: bytes, frames: list[bytes]) -> str:
        with self._connect() as sock:
            with contextlib.suppress(OSError):
                sock.sendall(hello + b"".join(frames))
            return self._label(self._drain(sock))

    def _interleaved(self) -> str:
        """2-3 connections, hellos then frames sent round robin, then all drained."""
        socks = [self._connect() for _ in range(self.rng.randrange(2, 4))]
        try:
            for s in socks:
                s.sendall(self.hello(self._me()))
            for _ in range(self.rng.randrange(1, 6)):
                for s in socks:
                    with contextlib.suppress(OSError):
                        s.sendall(self.request())
            labels = [self._label(self._drain(s)) for s in socks]
            return labels[0]
        finally:
            for s in socks:
                s.close()

    def _stalled_case(self) -> str:
        """A connection left open: mid-HELLO, mid-frame, or sending without reading."""
        r = self.rng
        sock = self._connect()
        hello = self.hello(self._me())
        pick = r.randrange(3)
        try:
            if pick == 0:
                sock.sendall(hello[:r.randrange(len(hello))])
                label = "stalled_hello"
            elif pick == 1:
                frame = self.request()
                sock.sendall(hello + frame[:r.randrange(1, max(2, len(frame)))])
                label = "stalled_frame"
            else:  # many requests, no reads: MAP replies (with fds) or READ payloads pile up
                sock.setblocking(False)
                sent = 0
                burst = hello + b"".join(self.request() for _ in range(r.randrange(50, 300)))
                with contextlib.suppress(BlockingIOError, OSError):
                    sent = sock.send(burst)
                label = "not_reading" if sent else "not_reading_blocked"
        except OSError:
            sock.close()
            return "stalled_reset"
        self._stall(sock)
        return label

    def _label(self, got: bytes) -> str:
        resp: Callable[[bytes], int]
        if self.kind == "shm":
            size = SHM_STATUS.size

            def resp(b: bytes) -> int:
                return int(SHM_STATUS.unpack(b[:size])[1])
        else:
            size = TCP_RESP.size

            def resp(b: bytes) -> int:
                return int(TCP_RESP.unpack(b[:size])[1])
        if got.startswith(b"<"):
            return got.decode()[1:-1]
        if len(got) < size:
            return "closed_no_reply"
        status = resp(got)
        if status != Status.OK:
            return f"hello_{_status_name(status)}"
        rest = got[size:]
        if rest.startswith(b"<"):
            return rest.decode()[1:-1]
        if self.kind == "shm" and len(rest) >= size:
            return _status_name(resp(rest))
        if self.kind == "tcp" and len(rest) >= size:
            return _status_name(resp(rest))
        return "hello_OK"
