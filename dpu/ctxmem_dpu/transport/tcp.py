"""TCP transport: bytes of a session's allocations and leases over a plain socket.

The service receives straight into the DRAM slot (``sock_recv_into`` on a view of the
slot) and sends straight from it: no intermediate copy. A block being sent is pinned for
the duration, so even a lease that expires mid-send never lets its slot be reused under
the transfer; a slot being written keeps its allocation alive the same way.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING

from ctxmem_common.errors import CtxmemError
from ctxmem_common.wire import OP_READ, OP_WRITE, TCP_HELLO, TCP_REQ, TCP_RESP, Status
from ctxmem_dpu.transport.socket_server import SocketDataServer, recv_exact, recv_into

if TYPE_CHECKING:
    from ctxmem_dpu.store import BlockStore

__all__ = ["TcpDataServer"]

log = logging.getLogger(__name__)


_recv_exact = recv_exact  # the names this module's code has always used
_recv_into = recv_into


class TcpDataServer(SocketDataServer):
    """Serves READ and WRITE of a session's slots on ``host:port`` (port 0: any; the
    bound one is in :attr:`port` after start)."""

    transport = "tcp"
    connection_kind = "TCP data"

    def __init__(self, store: BlockStore, host: str, port: int) -> None:
        super().__init__(store)
        self.host = host
        self.port = port

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

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        store = self.store
        s = await self._hello(conn, TCP_HELLO, b"CXT1",
                              lambda status: TCP_RESP.pack(b"CXTA", status, 0))
        if s is None:
            return
        session_id = s.id
        while True:
            magic, op, ident, index, length = TCP_REQ.unpack(
                await _recv_exact(loop, conn, TCP_REQ.size))
            if magic != b"CXTR" or op not in (OP_READ, OP_WRITE):
                await loop.sock_sendall(conn, TCP_RESP.pack(b"CXTA", Status.BAD_REQUEST, 0))
                return
            if session_id not in store.sessions:
                await loop.sock_sendall(conn, TCP_RESP.pack(b"CXTA", Status.UNAUTHENTICATED,
                                                            0))
                return
            if op == OP_WRITE:
                if not await self._write(loop, conn, s, ident, index, length):
                    return
            else:
                await self._read(loop, conn, s, ident, index)

    async def _write(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, s: object,
                     ident: bytes, index: int, length: int) -> bool:
        """One WRITE; False when the connection must end (a length no slot has)."""
        store = self.store
        status = Status.OK
        try:
            a = store.allocation(s, ident)  # type: ignore[arg-type]
            if not 0 <= index < len(a.slots):
                status = Status.BAD_REQUEST
            elif length != a.ns.block_nbytes:
                status = Status.WRONG_LENGTH
        except CtxmemError:
            status = Status.EXPIRED
        if status != Status.OK:
            if length > store.cfg.dram.slab_size:
                # No slot is larger than a slab: a length the client cannot have meant.
                # Never allocate it (2^64-1 raised OverflowError, 2^32 took 4 GiB, found
                # by ``ctxmem fuzz``): answer, then end the connection.
                await loop.sock_sendall(conn, TCP_RESP.pack(b"CXTA", status, 0))
                log.warning("TCP data connection of session %s closed: WRITE of %d bytes "
                            "refused (%s)", getattr(s, "id", b"").hex(), length, status.name)
                return False
            await _recv_into(loop, conn, memoryview(bytearray(length)))  # keep framing
            await loop.sock_sendall(conn, TCP_RESP.pack(b"CXTA", status, 0))
            return True
        with store.writing(a):  # the reaper leaves the allocation alone meanwhile
            view = store.dram.view(a.slots[index], length)
            try:
                await _recv_into(loop, conn, view)
            finally:
                view.release()
        await loop.sock_sendall(conn, TCP_RESP.pack(b"CXTA", Status.OK, 0))
        return True

    async def _read(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, s: object,
                    ident: bytes, index: int) -> None:
        store = self.store
        try:
            lease = store.lease(s, ident)  # type: ignore[arg-type]
        except CtxmemError:
            await loop.sock_sendall(conn, TCP_RESP.pack(b"CXTA", Status.EXPIRED, 0))
            return
        if not 0 <= index < len(lease.blocks):
            await loop.sock_sendall(conn, TCP_RESP.pack(b"CXTA", Status.BAD_REQUEST, 0))
            return
        b = lease.blocks[index]
        assert b.dram is not None
        store.pin(b)
        view = store.dram.view(b.dram, b.length)
        try:
            await loop.sock_sendall(conn, TCP_RESP.pack(b"CXTA", Status.OK, b.length))
            await loop.sock_sendall(conn, view)
        finally:
            view.release()
            store.unpin(b)
