"""The accept loop the socket transports share (shared memory over a Unix socket, TCP).

A :class:`SocketDataServer` listens on one socket, runs one task per accepted
connection, authenticates the connection's hello (session id and token) before serving
anything, and on close cancels every connection's task and waits for it, so each socket
is closed by the time :meth:`~ctxmem_dpu.transport.base.DataServer.close` returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from abc import abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from ctxmem_common.wire import Status
from ctxmem_dpu.transport.base import DataServer

if TYPE_CHECKING:
    from ctxmem_dpu.blocks import Session
    from ctxmem_dpu.store import BlockStore

__all__ = ["SocketDataServer", "recv_exact", "recv_into"]

log = logging.getLogger(__name__)


async def recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``sock``; ConnectionResetError if the peer closes first."""
    buf = bytearray(n)
    await recv_into(loop, sock, memoryview(buf))
    return bytes(buf)


async def recv_into(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview
                    ) -> None:
    """Fill ``view`` from ``sock`` (straight into a slot: no copy); ConnectionResetError if
    the peer closes first."""
    got = 0
    n = len(view)
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise ConnectionResetError("peer closed")
        got += k


class SocketDataServer(DataServer):
    """A data server that accepts stream connections on one listening socket.

    Subclasses build the socket (:meth:`_listen`), may tune each accepted one
    (:meth:`_configure`), and serve a connection (:meth:`_serve`), usually starting with
    :meth:`_hello`. A connection that ends with a socket error ends quietly; any other
    error is logged; either way its socket is closed.
    """

    connection_kind: ClassVar[str]  # for the log: "shared-memory", "TCP data"

    def __init__(self, store: BlockStore) -> None:
        super().__init__(store)
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()

    @abstractmethod
    def _listen(self) -> socket.socket:
        """A bound, listening, non-blocking socket."""

    def _configure(self, conn: socket.socket) -> None:
        """Tune an accepted connection (socket options) before it is served."""

    @abstractmethod
    async def _serve(self, conn: socket.socket) -> None:
        """Serve one connection until it ends; the caller closes ``conn``."""

    def connection_count(self) -> int:
        return len(self._conns)

    async def _open(self) -> None:
        self._sock = self._listen()
        self._task = asyncio.create_task(self._accept(),
                                         name=f"ctxmem-{self.transport}-accept")

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            conn.setblocking(False)
            self._configure(conn)
            t = asyncio.create_task(self._connection(conn))
            self._conns.add(t)
            t.add_done_callback(self._conns.discard)

    async def _connection(self, conn: socket.socket) -> None:
        try:
            await self._serve(conn)
        except (ConnectionError, OSError):
            pass
        except Exception:
            log.exception("%s connection failed", self.connection_kind)
        finally:
            conn.close()

    async def _hello(self, conn: socket.socket, hello: struct.Struct, magic: bytes,
                     reply: Callable[[Status], bytes]) -> Session | None:
        """Read the connection's hello (magic, session id, token) and answer it.

        Returns the authenticated session, or None after answering UNAUTHENTICATED (a
        wrong magic, an unknown session or a wrong token); the caller then ends.
        """
        loop = asyncio.get_running_loop()
        got, session_id, token = hello.unpack(await recv_exact(loop, conn, hello.size))
        s = self.authenticate(session_id, token) if got == magic else None
        await loop.sock_sendall(conn, reply(Status.OK if s is not None
                                            else Status.UNAUTHENTICATED))
        return s

    async def _stop_accepting(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            if _ours(task):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def _drop_connections(self) -> None:
        conns = list(self._conns)
        for t in conns:
            t.cancel()
        mine = [t for t in conns if _ours(t)]
        if mine:  # each connection's finally closes its socket
            await asyncio.gather(*mine, return_exceptions=True)


def _ours(task: asyncio.Task[None]) -> bool:
    """Whether ``task`` runs on the running loop (only then can close wait for it)."""
    try:
        return task.get_loop() is asyncio.get_running_loop()
    except RuntimeError:
        return False
