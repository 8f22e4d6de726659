"""Shared-memory transport: give same-host clients the memfds of their tenant's slabs.

The client copies straight into and out of the slots Allocate and Acquire name; the
service only checks, on every MAP, that the region currently belongs to the session's
tenant and is of the generation asked for. Bytes never cross this socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

from ctxmem_common.wire import SHM_HELLO, SHM_MAP, SHM_MAP_REPLY, SHM_STATUS, Status
from ctxmem_dpu.store import BlockStore

log = logging.getLogger(__name__)


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise ConnectionResetError("peer closed")
        got += k
    return bytes(buf)


class ShmServer:
    def __init__(self, store: BlockStore, path: str) -> None:
        self.store = store
        self.path = path
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        os.chmod(self.path, 0o660)
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self._task = asyncio.create_task(self._accept(), name="ctxmem-shm-accept")

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            conn.setblocking(False)
            t = asyncio.create_task(self._serve(conn))
            self._conns.add(t)
            t.add_done_callback(self._conns.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            magic, session_id, token = SHM_HELLO.unpack(await _recv_exact(loop, conn,
                                                                          SHM_HELLO.size))
            s = self.store.sessions.get(session_id)
            if magic != b"CXS1" or s is None or s.token != token:
                await loop.sock_sendall(conn, SHM_STATUS.pack(b"CXSA", Status.UNAUTHENTICATED))
                return
            await loop.sock_sendall(conn, SHM_STATUS.pack(b"CXSA", Status.OK))
            while True:
                magic, region, generation = SHM_MAP.unpack(
                    await _recv_exact(loop, conn, SHM_MAP.size))
                dram = self.store.dram
                status = Status.OK
                if magic != b"CXSM" or not 0 <= region < dram.num_slabs:
                    status = Status.BAD_REQUEST
                elif session_id not in self.store.sessions:
                    status = Status.UNAUTHENTICATED
                elif dram.region_tenant(region) != s.tenant or region not in dram.regions:
                    status = Status.DENIED
                elif dram.generation(region) != generation:
                    status = Status.STALE
                if status != Status.OK:
                    await loop.sock_sendall(conn, SHM_MAP_REPLY.pack(b"CXSR", status, 0, 0))
                    continue
                r = dram.regions[region]
                reply = SHM_MAP_REPLY.pack(b"CXSR", Status.OK, r.generation, r.size)
                # sendmsg with SCM_RIGHTS: the reply is tiny, a blocking send is fine.
                conn.setblocking(True)
                try:
                    socket.send_fds(conn, [reply], [r.fd])
                finally:
                    conn.setblocking(False)
        except (ConnectionError, OSError):
            pass
        except Exception:
            log.exception("shared-memory connection failed")
        finally:
            conn.close()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for t in list(self._conns):
            t.cancel()
        if self._sock is not None:
            self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
