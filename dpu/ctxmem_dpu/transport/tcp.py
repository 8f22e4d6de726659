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

from ctxmem_common.errors import CtxmemError
from ctxmem_common.wire import OP_READ, OP_WRITE, TCP_HELLO, TCP_REQ, TCP_RESP, Status
from ctxmem_dpu.store import BlockStore
from ctxmem_dpu.transport.shm import _recv_exact

log = logging.getLogger(__name__)


async def _recv_into(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview
                     ) -> None:
    got = 0
    n = len(view)
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise ConnectionResetError("peer closed mid-payload")
        got += k


class TcpDataServer:
    def __init__(self, store: BlockStore, host: str, port: int) -> None:
        self.store = store
        self.host = host
        self.port = port
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(128)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        self._sock = sock
        self._task = asyncio.create_task(self._accept(), name="ctxmem-tcp-accept")

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                conn.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
            t = asyncio.create_task(self._serve(conn))
            self._conns.add(t)
            t.add_done_callback(self._conns.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        store = self.store
        try:
            magic, session_id, token = TCP_HELLO.unpack(await _recv_exact(loop, conn,
                                                                          TCP_HELLO.size))
            s = store.sessions.get(session_id)
            if magic != b"CXT1" or s is None or s.token != token:
                await loop.sock_sendall(conn, TCP_RESP.pack(b"CXTA", Status.UNAUTHENTICATED, 0))
                return
            await loop.sock_sendall(conn, TCP_RESP.pack(b"CXTA", Status.OK, 0))
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
                    await self._write(loop, conn, s, ident, index, length)
                else:
                    await self._read(loop, conn, s, ident, index)
        except (ConnectionError, OSError):
            pass
        except Exception:
            log.exception("TCP data connection failed")
        finally:
            conn.close()

    async def _write(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, s: object,
                     ident: int, index: int, length: int) -> None:
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
            await _recv_into(loop, conn, memoryview(bytearray(length)))  # keep framing
            await loop.sock_sendall(conn, TCP_RESP.pack(b"CXTA", status, 0))
            return
        with store.writing(a):  # the reaper leaves the allocation alone meanwhile
            view = store.dram.view(a.slots[index], length)
            try:
                await _recv_into(loop, conn, view)
            finally:
                view.release()
        await loop.sock_sendall(conn, TCP_RESP.pack(b"CXTA", Status.OK, 0))

    async def _read(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, s: object,
                    ident: int, index: int) -> None:
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

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for t in list(self._conns):
            t.cancel()
        if self._sock is not None:
            self._sock.close()
