"""TCP transport: bytes of a session's allocations and leases over a plain socket.

The service receives straight into the DRAM slot (``sock_recv_into`` on a view of the
slot) and sends straight from it: no intermediate copy. A block being sent is pinned for
the duration, so even a lease that expires mid-send never lets its slot be reused under
the transfer; a slot being written keeps its allocation alive the same way, but only
until the read deadline: a write that stalls is dropped, and its allocation then expires
like any other.

Every header is checked against the allocation or lease it names (the slot index, the
block length) before a byte of payload is read or a buffer allocated; a bad one is
answered with its status and the connection closed. Deadlines and caps:
:class:`~ctxmem_dpu.transport.socket_server.SocketDataServer`.

The same connection carries the control fast path (OP frames, :mod:`ctxmem_common.wire`):
Lookup, Acquire/Release and Allocate/Commit as the shared-memory socket's binary bodies,
served by :func:`~ctxmem_dpu.transport.shm_fastpath.serve_op` (the gRPC path's checks),
so a TCP session's control calls skip gRPC as a shared-memory one's do. The same bounds
hold: a body over ``service.shm_op_max_bytes``, an unknown op or one that does not decode
is answered BAD_REQUEST, counted (``tcp_ops_refused``) and the connection closed; a body
that stalls is dropped after ``data_plane.read_timeout_s``; an answer the client does not
read within it ends the connection. Each op served is counted (``tcp_ops_<op>``).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, NoReturn

from ctxmem_common.config import DataPlaneConfig
from ctxmem_common.errors import CtxmemError
from ctxmem_common.wire import (
    OP_READ,
    OP_WRITE,
    SHM_OP_NAMES,
    TCP_HELLO,
    TCP_NO_ID,
    TCP_OP_REPLY,
    TCP_REQ,
    TCP_RESP,
    Status,
)
from ctxmem_dpu.transport.socket_server import SocketDataServer, recv_exact, recv_into

if TYPE_CHECKING:
    from ctxmem_dpu.blocks import Session
    from ctxmem_dpu.store import BlockStore

__all__ = ["TcpDataServer"]

_OP_COUNTERS = (*(f"tcp_ops_{name}" for name in SHM_OP_NAMES.values()), "tcp_ops_refused")

_recv_exact = recv_exact  # the names this module's code has always used
_recv_into = recv_into


class TcpDataServer(SocketDataServer):
    """Serves READ and WRITE of a session's slots on ``host:port`` (port 0: any; the
    bound one is in :attr:`port` after start)."""

    transport = "tcp"
    connection_kind = "TCP data"

    def __init__(self, store: BlockStore, host: str, port: int,
                 limits: DataPlaneConfig | None = None) -> None:
        super().__init__(store, limits)
        self.host = host
        self.port = port
        for name in _OP_COUNTERS:  # reported from the start, like the store's own
            store.counters.setdefault(name, 0)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _listen(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        return sock

    def _configure(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            conn.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)

    def _refusal(self, status: Status) -> bytes:
        return _resp(status)

    async def _serve(self, conn: socket.socket) -> None:
        s = await self._hello(conn, TCP_HELLO, b"CXT1", _resp)
        if s is None:
            return
        while True:
            raw = await self._next_request(conn, TCP_REQ.size)
            if raw is None:
                return
            magic, op, ident, index, length = TCP_REQ.unpack(raw)
            if magic == b"CXTO":  # a fast-path op (the op answers an ended session)
                await self._op(conn, s, op, ident, index, length)
                continue
            if magic != b"CXTR" or op not in (OP_READ, OP_WRITE):
                await self._fail(conn, _resp(Status.BAD_REQUEST),
                                 f"bad request header (magic {magic!r}, op {op})")
            if self.store.live_session(s.id) is None:
                await self._fail(conn, _resp(Status.UNAUTHENTICATED),
                                 f"session {s.id.hex()} ended")
            s.last_used = time.monotonic()  # a data request keeps the session from idling
            if op == OP_WRITE:
                await self._write(conn, s, ident, index, length)
            else:
                await self._read(conn, s, ident, index, length)

    async def _op(self, conn: socket.socket, s: Session, op: int, ident: bytes, index: int,
                  length: int) -> None:
        """Read one fast-path op's body (within ``read_timeout_s``), run it and send its
        answer. A malformed frame is answered BAD_REQUEST, and the connection closed."""
        def refuse(reason: str) -> Awaitable[NoReturn]:
            return self._refuse_op(conn, s, op, reason)

        if op in SHM_OP_NAMES and (ident != TCP_NO_ID or index):
            await refuse(f"{SHM_OP_NAMES[op]} frame with a nonzero id or index")
        out = await self._run_op(conn, s, op, length, "tcp_ops", refuse)
        name = SHM_OP_NAMES[op]
        if out is not None:
            status, reply = out
            await self._sendmany(conn, [TCP_OP_REPLY.pack(b"CXTP", status, op, len(reply)),
                                        reply], f"answering a {name}")

    async def _refuse_op(self, conn: socket.socket, s: Session, op: int, reason: str
                         ) -> NoReturn:
        """Answer a malformed op BAD_REQUEST and close the connection."""
        self.store.counters["tcp_ops_refused"] += 1
        await self._fail(conn, TCP_OP_REPLY.pack(b"CXTP", Status.BAD_REQUEST, op, 0),
                         f"session {s.id.hex()} (tenant {s.tenant!r}): {reason}; a client "
                         f"must send well-formed requests (ctxmem_common.wire, shm_ops)")

    async def _write(self, conn: socket.socket, s: Session, ident: bytes, index: int,
                     length: int) -> None:
        store = self.store
        what = f"WRITE of slot {index} of allocation {ident.hex()}"
        try:
            a = store.allocation(s, ident)
        except CtxmemError:
            a = None
        if a is None or a.expires < time.monotonic():
            await self._fail(conn, _resp(Status.EXPIRED),
                             f"{what}: allocation unknown or expired")
        if not 0 <= index < len(a.slots):
            await self._fail(conn, _resp(Status.BAD_REQUEST),
                             f"{what}: index out of range (the allocation has "
                             f"{len(a.slots)} slots)")
        if length != a.ns.block_nbytes:
            await self._fail(conn, _resp(Status.WRONG_LENGTH),
                             f"{what}: {length} bytes claimed, blocks are "
                             f"{a.ns.block_nbytes}")
        if a.done:  # held: a write on another connection, or Commit checksumming it
            await self._fail(conn, _resp(Status.BAD_REQUEST),
                             f"{what}: the allocation is being written on another "
                             f"connection or committed")
        # The reaper leaves the allocation alone only while bytes keep coming: the read
        # deadline ends the hold, and then the allocation expires like any other.
        with store.writing(a):
            view = store.dram.view(a.slots[index], length)
            try:
                await self._recv_into(conn, view, f"receiving the payload of the {what}")
            finally:
                view.release()
        await self._sendall(conn, _resp(Status.OK), f"answering the {what}")

    async def _read(self, conn: socket.socket, s: Session, ident: bytes, index: int,
                    length: int) -> None:
        store = self.store
        what = f"READ of block {index} of lease {ident.hex()}"
        try:
            lease = store.lease(s, ident)
        except CtxmemError:
            await self._fail(conn, _resp(Status.EXPIRED), f"{what}: lease unknown or expired")
        if not 0 <= index < len(lease.blocks):
            await self._fail(conn, _resp(Status.BAD_REQUEST),
                             f"{what}: index out of range (the lease has "
                             f"{len(lease.blocks)} blocks)")
        b = lease.blocks[index]
        if length not in (0, b.length):
            await self._fail(conn, _resp(Status.WRONG_LENGTH),
                             f"{what}: {length} bytes asked, the block has {b.length}")
        assert b.dram is not None
        store.pin(b)
        view = store.dram.view(b.dram, b.length)
        try:
            await self._sendmany(conn, [TCP_RESP.pack(b"CXTA", Status.OK, b.length), view],
                                 f"answering the {what}")
        finally:
            view.release()
            store.unpin(b)


def _resp(status: Status) -> bytes:
    """A response header with ``status`` and no payload."""
    return TCP_RESP.pack(b"CXTA", status, 0)
