"""The data-server contract: what every data-plane server of the service shares.

A data server exposes the store's DRAM slots to clients of one transport. Each one:

* has an explicit lifetime (:class:`~ctxmem_dpu.lifetime.AsyncResource`): ``start()``
  binds / opens the device, ``close()`` stops accepting, drops every connection and then
  releases what start took; both idempotent, close safe without start, ``async with``;
* serves an :attr:`~DataServer.address` the control plane hands to clients (a socket
  path, ``HOST:PORT``, an RDMA IP);
* admits a connection only for a live session of the store that presents the session's
  token (:meth:`DataServer.authenticate`, a constant-time compare);
* tracks its connections (:meth:`DataServer.connection_count`), so close can end them all.

:class:`~ctxmem_dpu.transport.socket_server.SocketDataServer` adds the accept loop the
socket transports (shared memory, TCP) share; RDMA's connections come through the gRPC
control plane instead. The conformance suite every server runs is
tests/integration/data_server_suite.py.
"""

from __future__ import annotations

import hmac
from abc import abstractmethod
from typing import TYPE_CHECKING, ClassVar

from ctxmem_dpu.lifetime import AsyncResource

if TYPE_CHECKING:
    from ctxmem_dpu.blocks import Session
    from ctxmem_dpu.store import BlockStore

__all__ = ["DataServer"]


class DataServer(AsyncResource):
    """One transport's data-plane server over ``store``.

    Subclasses implement :meth:`_open` (take resources), :meth:`_drop_connections`,
    :meth:`connection_count` and :attr:`address`; they may override
    :meth:`_stop_accepting` and :meth:`_release`. :meth:`close` runs stop accepting ->
    drop connections -> release, in that order, every time it is called.
    """

    transport: ClassVar[str]  # "shm", "tcp", "rdma": the service.transports name

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self._running = False

    @property
    @abstractmethod
    def address(self) -> str:
        """What clients reach this server at (a socket path, ``HOST:PORT``, an IP)."""

    @property
    def running(self) -> bool:
        """True between a successful :meth:`start` and :meth:`close`."""
        return self._running

    async def start(self) -> None:
        """Bind / open what the transport needs and start serving. Idempotent."""
        if self._running:
            return
        await self._open()
        self._running = True

    async def close(self) -> None:
        """Stop accepting, end every connection, release the server's resources.

        Idempotent, and safe on a server that never started or failed to start.
        """
        self._running = False
        await self._stop_accepting()
        await self._drop_connections()
        await self._release()

    def authenticate(self, session_id: bytes, token: bytes) -> Session | None:
        """The store's live session ``session_id`` if ``token`` is its token, else None.

        Every new data connection presents these before anything else; the compare is
        constant-time so a wrong token tells nothing about the right one.
        """
        s = self.store.live_session(session_id)
        if s is None or not hmac.compare_digest(s.token, token):
            return None
        return s

    @abstractmethod
    def connection_count(self) -> int:
        """Connections (sessions' data channels) open now."""

    @abstractmethod
    async def _open(self) -> None:
        """Take the server's resources; called once per start."""

    async def _stop_accepting(self) -> None:
        """Refuse new connections (first step of close)."""

    @abstractmethod
    async def _drop_connections(self) -> None:
        """End every open connection and wait until they are gone."""

    async def _release(self) -> None:
        """Give back what :meth:`_open` took (last step of close)."""
