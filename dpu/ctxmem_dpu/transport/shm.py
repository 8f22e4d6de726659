"""Shared-memory transport: give same-host clients the memfds of their tenant's slabs.

The client copies straight into and out of the slots Allocate and Acquire name; the
service only checks, on every MAP, that the region currently belongs to the session's
tenant and is of the generation asked for. Bytes never cross this socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import TYPE_CHECKING

from ctxmem_common.wire import SHM_HELLO, SHM_MAP, SHM_MAP_REPLY, SHM_STATUS, Status
from ctxmem_dpu.transport.socket_server import SocketDataServer, recv_exact

if TYPE_CHECKING:
    from ctxmem_dpu.blocks import Session
    from ctxmem_dpu.store import BlockStore

__all__ = ["ShmServer"]

_recv_exact = recv_exact  # the name this module always had


class ShmServer(SocketDataServer):
    """Serves MAP requests on the Unix socket at ``path`` (created 0660 at start, removed
    at close)."""

    transport = "shm"
    connection_kind = "shared-memory"

    def __init__(self, store: BlockStore, path: str) -> None:
        super().__init__(store)
        self.path = path

    @property
    def address(self) -> str:
        return self.path

    def _listen(self) -> socket.socket:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)
            os.chmod(self.path, 0o660)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    async def _serve(self, conn: socket.socket) -> None:
        s = await self._hello(conn, SHM_HELLO, b"CXS1",
                              lambda status: SHM_STATUS.pack(b"CXSA", status))
        if s is None:
            return
        # While this connection is open its client may map (and keep writing) the
        # session's slabs: slots of its allocations that expire are quarantined, not
        # reused, until its last connection closes (store.sessions).
        self.store.shm_attached(s)
        try:
            await self._map_loop(conn, s)
        finally:
            self.store.shm_detached(s)

    async def _map_loop(self, conn: socket.socket, s: Session) -> None:
        """Answer MAP requests until the connection ends."""
        loop = asyncio.get_running_loop()
        session_id = s.id
        while True:
            magic, region, generation = SHM_MAP.unpack(
                await recv_exact(loop, conn, SHM_MAP.size))
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

    async def _release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
