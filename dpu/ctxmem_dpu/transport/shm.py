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

from ctxmem_common import safepaths
from ctxmem_common.wire import SHM_HELLO, SHM_MAP, SHM_MAP_REPLY, SHM_STATUS, Status
from ctxmem_dpu.transport.socket_server import SocketDataServer, recv_exact

if TYPE_CHECKING:
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
        # Created 0750 (the socket's group must reach the 0660 socket) if absent; refused
        # if another user owns it or anyone else can write it (a planted socket or link).
        safepaths.ensure_dir(os.path.dirname(os.path.abspath(self.path)),
                             safepaths.SOCKET_DIR_MODE, "shm socket directory")
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
        loop = asyncio.get_running_loop()
        s = await self._hello(conn, SHM_HELLO, b"CXS1",
                              lambda status: SHM_STATUS.pack(b"CXSA", status))
        if s is None:
            return
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
