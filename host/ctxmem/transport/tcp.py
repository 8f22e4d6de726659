"""TCP channel: pipelined writes and reads over one connection per client.

A batch is sent back to back (request headers and payloads), then the answers are read,
so a batch costs one round trip, not one per block. Writes go straight from the caller's
buffers: each block's request header and payload in one ``sendmsg`` with the blocks
around it (:func:`_send_all`; over TLS, which has no ``sendmsg``, a ``sendall`` each).
Reads receive straight into the caller's buffers; a
verified read (the default get) CRCs each received piece as it lands, while it is in
cache, and a block whose CRC differs from the committed one is scrubbed (zeroed) and ends
the run (:mod:`ctxmem.transport.verified`).

With ``ops`` (the service's Health says ``tcp_ops``, and ``CTXMEM_FAST_OPS`` is not 0)
the connection also carries the control fast path (:meth:`TcpChannel.call`: Lookup,
Acquire/Release, Allocate/Commit as the binary bodies of :mod:`ctxmem_common.shm_ops`),
one request and its answer under the channel's lock, as on the shared-memory socket. The
service answers in request order, and every read and write waits for its own answers
under the same lock, so the next answer after an op is the op's (a RELEASE flagged
no-reply has none). A socket error or an answer that does not match its request breaks
the channel: this call and every later one raise Unavailable, which reconnects.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ctxmem.transport.base import DataChannel, Grant, TransportError
from ctxmem.transport.verified import ReadProgress, check_landed, scrub
from ctxmem_common.codecs import crc32c
from ctxmem_common.errors import CtxmemError
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.wire import (
    OP_READ,
    OP_WRITE,
    STATUS_TEXT,
    TCP_HELLO,
    TCP_NO_ID,
    TCP_OP,
    TCP_OP_REPLY,
    TCP_REQ,
    TCP_RESP,
    Status,
)

if TYPE_CHECKING:
    from ctxmem.tls import TlsConfig


def _recv_into(sock: socket.socket, view: memoryview, crc: bool = False) -> int:
    """Fill ``view`` from ``sock``; with ``crc``, return the CRC32C of what arrived,
    computed piece by piece as each ``recv`` lands (0 otherwise)."""
    got = value = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise TransportError("TCP data connection closed by the service mid-transfer")
        if crc:
            value = crc32c(view[got : got + k], value)
        got += k
    return value


_MAX_REPLY_BYTES = 256 << 20  # far above any legal answer: a larger one is a broken peer
_IOV_MAX = 1024
"""Buffers per ``sendmsg`` (Linux's IOV_MAX): 512 blocks' headers and payloads."""


def _send_all(sock: socket.socket, bufs: list[memoryview]) -> None:
    """Send ``bufs`` (byte views) in order, as many per ``sendmsg`` as the kernel takes:
    one system call for a run of blocks instead of two ``sendall`` per block. The socket's
    timeout bounds each call; a partial send resumes inside the buffer it stopped in."""
    bufs = [b for b in bufs if b.nbytes]
    i = 0
    while i < len(bufs):
        sent = sock.sendmsg(bufs[i:i + _IOV_MAX])
        while sent:
            head = bufs[i]
            if sent >= head.nbytes:
                sent -= head.nbytes
                i += 1
            else:
                bufs[i] = head[sent:]
                sent = 0


def _recv_resp(sock: socket.socket) -> tuple[int, int]:
    buf = bytearray(TCP_RESP.size)
    _recv_into(sock, memoryview(buf))
    magic, status, length = TCP_RESP.unpack(buf)
    if magic != b"CXTA":
        raise TransportError("TCP data connection out of sync (bad response magic)")
    return status, length


class TcpChannel(DataChannel):
    name = "tcp"
    where = "TCP"

    def __init__(self, host: str, port: int, session_id: bytes, token: bytes,
                 timeout_s: float, tls: TlsConfig | None = None, ops: bool = False) -> None:
        """Connect, (with ``tls``) complete a TLS 1.3 handshake checking the service's
        certificate and presenting this client's, and authenticate the session. ``ops``:
        the control fast path may be used (:meth:`call`)."""
        self.ops = ops
        self.address = self.endpoint = f"{host}:{port}"
        self._broken = ""  # why the channel is unusable for ops ("" while it is fine)
        # Frames sent flagged no-reply since the last answered op: close() waits for one
        # answered op first, so what they did (a verified get's Release) has happened.
        self.unanswered = False
        self._lock = threading.Lock()
        raw: socket.socket | None = None
        try:
            raw = socket.create_connection((host, port), timeout=timeout_s)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                raw.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
            self._sock: socket.socket = raw
            if tls is not None:
                self._sock = tls.ssl_context().wrap_socket(
                    raw, server_hostname=tls.hostname(host))
            self._sock.sendall(TCP_HELLO.pack(b"CXT1", session_id, token))
            status, _ = _recv_resp(self._sock)
        except ssl.SSLError as exc:
            if raw is not None:
                raw.close()
            raise TransportError(
                f"TLS to the TCP data channel {host}:{port} failed: {exc.reason or exc}; "
                f"check TlsConfig (ca_file, server_name, the client certificate) against "
                f"the service's tls: section") from None
        except OSError as exc:
            if raw is not None:
                raw.close()
            raise TransportError(
                f"cannot open the TCP data channel to {host}:{port}: {exc.strerror or exc}; "
                f"check service.data_listen and firewalls"
            ) from None
        if status != Status.OK:
            self._sock.close()
            raise TransportError(f"TCP data channel refused: {STATUS_TEXT[Status(status)]}")

    def _send_parts(self, parts: Sequence[bytes]) -> None:
        """``parts`` in order: one ``sendmsg`` where the socket has it, else (TLS) a
        ``sendall`` each; nothing is joined (a Lookup body is up to 16 MiB)."""
        if isinstance(self._sock, ssl.SSLSocket):
            for part in parts:
                self._sock.sendall(part)
        else:
            _send_all(self._sock, [memoryview(p) for p in parts])

    def call(self, op: int, parts: Sequence[bytes], reply: bool = True,
             meanwhile: Callable[[], None] | None = None) -> bytes:
        """Send fast-path op ``op`` with body ``parts`` and return its answer's body (see
        :meth:`DataChannel.call`)."""
        return self._fast_call(op, parts, reply, meanwhile)

    def _send_op(self, op: int, parts: Sequence[bytes]) -> None:
        self._send_parts([TCP_OP.pack(b"CXTO", op, TCP_NO_ID, 0, sum(map(len, parts))),
                          *parts])

    def _read_answer(self, op: int, name: str) -> tuple[int, bytes]:
        head = bytearray(TCP_OP_REPLY.size)
        _recv_into(self._sock, memoryview(head))
        magic, status, got_op, length = TCP_OP_REPLY.unpack(head)
        if magic != b"CXTP" or got_op != op or length > _MAX_REPLY_BYTES:
            raise TransportError(f"answer {magic!r} op {got_op} of {length} bytes "
                                 f"does not answer {name}")
        body = bytearray(length)
        _recv_into(self._sock, memoryview(body))
        return status, bytes(body)


    def _check(self, status: int, what: str) -> None:
        if status != Status.OK:
            raise TransportError(f"{what}: {STATUS_TEXT.get(Status(status), status)}")

    def _write_grant(self, grant: Grant, views: Sequence[memoryview]) -> list[int]:
        """WRITE frames name blocks by index in the allocation: the slots are not read."""
        return self.write_crc(grant.id, (), views)

    def _read_grant(self, grant: Grant, views: Sequence[memoryview], verify: bool,
                    progress: ReadProgress) -> None:
        """READ frames name blocks by index in the lease: the slots are not read."""
        self._read(grant.id, views, grant.crcs if verify else None,
                   progress if verify else ReadProgress())

    def write(self, allocation_id: bytes, slots: Sequence[pb.Slot],
              views: Sequence[memoryview]) -> None:
        with self._lock:
            try:
                if isinstance(self._sock, ssl.SSLSocket):
                    for i, view in enumerate(views):
                        self._sock.sendall(TCP_REQ.pack(b"CXTR", OP_WRITE, allocation_id, i,
                                                        len(view)))
                        self._sock.sendall(view)
                else:
                    bufs: list[memoryview] = []
                    for i, view in enumerate(views):
                        bufs.append(memoryview(TCP_REQ.pack(b"CXTR", OP_WRITE, allocation_id,
                                                            i, len(view))))
                        bufs.append(view.cast("B") if view.format != "B" else view)
                    _send_all(self._sock, bufs)
                for i in range(len(views)):
                    status, _ = _recv_resp(self._sock)
                    self._check(status,
                                f"TCP write of slot {i} of allocation {allocation_id.hex()}")
            except OSError as exc:
                raise TransportError(f"TCP write failed: {exc}") from None

    def read(self, lease_id: bytes, slots: Sequence[pb.Slot],
             views: Sequence[memoryview]) -> None:
        self._read(lease_id, views, None, ReadProgress())

    def read_verified(self, lease_id: bytes, slots: Sequence[pb.Slot],
                      views: Sequence[memoryview], crcs: Sequence[int],
                      progress: ReadProgress) -> None:
        self._read(lease_id, views, crcs, progress)

    def _read(self, lease_id: bytes, views: Sequence[memoryview], crcs: Sequence[int] | None,
              progress: ReadProgress) -> None:
        """Pipelined read of every block of the lease into ``views``, checking each
        against ``crcs`` unless it is ``None``. After a failed block (scrubbed) the rest
        of the answers are still drained, into a scratch buffer, so the connection stays
        in step and the views after it stay untouched."""
        scratch: memoryview | None = None
        with self._lock:
            try:
                self._sock.sendall(b"".join(
                    TCP_REQ.pack(b"CXTR", OP_READ, lease_id, i, 0) for i in range(len(views))))
                for i, view in enumerate(views):
                    status, length = _recv_resp(self._sock)
                    self._check(status, f"TCP read of block {i} of lease {lease_id.hex()}")
                    if length != len(view):
                        raise TransportError(f"TCP read of block {i}: {length} bytes, expected "
                                             f"{len(view)}")
                    if crcs is None:
                        _recv_into(self._sock, view)
                        progress.done = i + 1
                    elif progress.bad is None:
                        try:
                            crc = _recv_into(self._sock, view, crc=True)
                        except BaseException:
                            scrub(view)  # part of a block arrived: none of it stays
                            raise
                        if check_landed(view, crc, crcs[i]):
                            progress.done = i + 1
                        else:
                            progress.bad = i
                    else:
                        if scratch is None or scratch.nbytes < length:
                            scratch = memoryview(bytearray(length))
                        _recv_into(self._sock, scratch[:length])
            except OSError as exc:
                raise TransportError(f"TCP read failed: {exc}") from None

    def close(self) -> None:
        if self.unanswered and not self._broken:
            # Bounded by the socket's timeout: a service that does not answer leaves the
            # releases to the lease timeout, as a crashed client would.
            with contextlib.suppress(CtxmemError):
                self.flush()
        self._sock.close()
