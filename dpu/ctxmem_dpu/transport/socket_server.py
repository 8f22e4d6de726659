"""The accept loop the socket transports share (shared memory over a Unix socket, TCP).

A :class:`SocketDataServer` listens on one socket, runs one task per accepted
connection, authenticates the connection's hello (session id and token) before serving
anything, and on close cancels every connection's task and waits for it, so each socket
is closed by the time :meth:`~ctxmem_dpu.transport.base.DataServer.close` returns.

Every client may be slow, buggy or hostile (docs/security.md), so every wait here is
bounded (``data_plane`` config): the hello must arrive within ``hello_timeout_s``, a
connection may sit idle between requests ``idle_timeout_s``, and once a request's first
byte arrived the rest (and every answer sent) must move within ``read_timeout_s``. The
connections open at once are capped in total and per tenant, and those not yet
authenticated (accept to HELLO) separately, in total and per source, by
:class:`~ctxmem_dpu.listenguard.Unauthenticated`: over a cap the oldest of them is
closed, and none is admitted while free file descriptors are below the reserve. A
connection ended for a reason (a deadline, a cap, a bad header) is logged as one line
naming the peer and the reason: :class:`Dropped`.

With :attr:`SocketDataServer.tls` set (the TCP data plane with ``tls:`` on), every
accepted connection first completes a TLS 1.3 handshake within ``hello_timeout_s`` (one
deadline from accept for the handshake and the HELLO)
(:class:`~ctxmem_dpu.transport.tls_stream.TlsStream`), and every read and write below
goes through it; a failed handshake (a plaintext client, an unverified certificate) is
one log line. In mutual mode the client certificate's tenant must be the HELLO's
session's tenant.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import struct
from abc import abstractmethod
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, TypeVar

from ctxmem_common.config import DataPlaneConfig
from ctxmem_common.wire import SHM_OP_NAMES, Status
from ctxmem_dpu.listenguard import FdReserve, Ticket, Unauthenticated
from ctxmem_dpu.logthrottle import throttled
from ctxmem_dpu.transport.base import DataServer
from ctxmem_dpu.transport.shm_fastpath import Malformed, serve_op
from ctxmem_dpu.transport.tls_stream import TlsStream

if TYPE_CHECKING:
    from ctxmem_dpu.blocks import Session
    from ctxmem_dpu.store import BlockStore
    from ctxmem_dpu.tls import ServerTls

__all__ = ["Dropped", "SocketDataServer", "recv_exact", "recv_into"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class Dropped(Exception):
    """A connection is being closed on purpose; ``str(exc)`` says why (for the log line).

    ``level`` is the log level of that line: WARNING for what a correct client never does
    (a bad header, a missed deadline mid-request), INFO for the ordinary (idle too long).
    """

    def __init__(self, reason: str, level: int = logging.WARNING) -> None:
        super().__init__(reason)
        self.level = level


@dataclass
class _ConnInfo:
    """What the server knows of one accepted connection (for caps and the log)."""

    peer: str
    tenant: str | None = None
    ticket: Ticket | None = None  # its unauthenticated place, until HELLO proves it
    deadline: float = 0.0  # loop time by which TLS and HELLO must be done


def _peer_name(addr: Any) -> str:
    """``host:port`` of a TCP peer; a Unix-socket peer has no address."""
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return "a local process"


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
    :meth:`_hello` and reading requests with :meth:`_next_request` and
    :meth:`_recv_into`. A connection that ends with a socket error ends quietly, one ended
    by :class:`Dropped` is logged as one line; either way its socket is closed.
    ``limits`` bounds every wait and the connections open (default: the config's
    defaults); set it before :meth:`start`.
    """

    connection_kind: ClassVar[str]  # for the log: "shared-memory", "TCP data"
    #: Whether this socket serves the staging ops (it can pass a region's fd: Unix only).
    staging_ops: ClassVar[bool] = False

    def __init__(self, store: BlockStore, limits: DataPlaneConfig | None = None) -> None:
        super().__init__(store)
        self.limits = limits or DataPlaneConfig()
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._info: dict[socket.socket, _ConnInfo] = {}
        self._per_tenant: Counter[str] = Counter()
        # TLS for every accepted connection (TCP only; set before start), and each
        # connection's stream once its handshake is done.
        self.tls: ServerTls | None = None
        self._streams: dict[socket.socket, TlsStream] = {}
        # Pod mode (set by the app before start): Lookup and Acquire need the cluster's
        # view, so the fast path answers them UNSUPPORTED (the client asks over gRPC).
        self.pod = False
        # The fd reserve every listener shares (set by the app before start; None: none).
        self.fd_reserve: FdReserve | None = None
        self._unauth: Unauthenticated | None = None

    @abstractmethod
    def _listen(self) -> socket.socket:
        """A bound, listening, non-blocking socket."""

    def _configure(self, conn: socket.socket) -> None:
        """Tune an accepted connection (socket options) before it is served."""

    def _source(self, conn: socket.socket, addr: Any) -> str:
        """Whom a connection counts against for the per-source unauthenticated cap: the
        peer's IP address (a Unix-socket server overrides it)."""
        return str(addr[0]) if isinstance(addr, tuple) and addr else "local"

    def unauthenticated_count(self) -> int:
        """Connections accepted whose HELLO has not been accepted yet."""
        return len(self._unauth) if self._unauth is not None else 0

    def _refusal(self, status: Status) -> bytes:
        """The hello answer carrying ``status``, sent to a connection refused at accept
        (over ``max_connections``) before it is closed; b"": close without one."""
        return b""

    @abstractmethod
    async def _serve(self, conn: socket.socket) -> None:
        """Serve one connection until it ends; the caller closes ``conn``."""

    def connection_count(self) -> int:
        return len(self._conns)

    def tenant_connections(self, tenant: str) -> int:
        """Authenticated connections of ``tenant`` open now."""
        return self._per_tenant[tenant]

    async def _open(self) -> None:
        self._unauth = Unauthenticated(self.connection_kind, self.limits.max_unauthenticated,
                                       self.limits.max_unauthenticated_per_source,
                                       self.fd_reserve)
        self._sock = self._listen()
        self._task = asyncio.create_task(self._accept(),
                                         name=f"ctxmem-{self.transport}-accept")

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, addr = await loop.sock_accept(self._sock)
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS: keep the server, back off
                throttled(log, logging.WARNING, f"{self.connection_kind}.accept",
                          "%s server: accept failed (%s); retrying in 0.1 s",
                          self.connection_kind, exc)
                await asyncio.sleep(0.1)
                continue
            peer = _peer_name(addr)
            conn.setblocking(False)
            if len(self._conns) >= self.limits.max_connections:
                throttled(log, logging.WARNING, f"{self.connection_kind}.refused",
                          "%s connection from %s refused: %d connections open "
                          "(data_plane.max_connections)", self.connection_kind, peer,
                          len(self._conns))
                self._refuse_now(conn)
                continue
            assert self._unauth is not None
            ticket = self._unauth.admit(self._source(conn, addr), _shutter(conn))
            if ticket is None:  # fds below the reserve: closed before anything is read
                conn.close()
                continue
            self._configure(conn)
            self._info[conn] = _ConnInfo(peer, ticket=ticket,
                                         deadline=loop.time() + self.limits.hello_timeout_s)
            t = asyncio.create_task(self._connection(conn))
            self._conns.add(t)
            t.add_done_callback(self._conns.discard)
            await asyncio.sleep(0)  # a flood of accepts lets the hellos in between

    def _refuse_now(self, conn: socket.socket) -> None:
        """Answer TOO_MANY_CONNECTIONS if the socket takes it at once, and close: no task,
        no wait, nothing read beyond what already arrived."""
        if self.tls is not None:  # no handshake for a refused connection: just close
            conn.close()
            return
        with contextlib.suppress(OSError):
            conn.recv(256)  # the hello, if here: closing over unread bytes resets the reply
        with contextlib.suppress(OSError):
            reply = self._refusal(Status.TOO_MANY_CONNECTIONS)
            if reply:
                conn.send(reply)
        conn.close()

    async def _connection(self, conn: socket.socket) -> None:
        try:
            if self.tls is not None:
                await self._handshake(conn, self.tls)
            await self._serve(conn)
        except Dropped as exc:
            throttled(log, exc.level, f"{self.connection_kind}.closed",
                      "%s connection from %s closed: %s", self.connection_kind,
                      self._peer(conn), exc)
        except (ConnectionError, OSError):
            pass
        except Exception:
            log.exception("%s connection from %s failed", self.connection_kind,
                          self._peer(conn))
        finally:
            self._streams.pop(conn, None)
            info = self._info.pop(conn, None)
            if info is not None and info.ticket is not None:
                info.ticket.done()
            if info is not None and info.tenant is not None:
                self._per_tenant[info.tenant] -= 1
                if self._per_tenant[info.tenant] <= 0:
                    del self._per_tenant[info.tenant]
            conn.close()

    def _hello_left(self, conn: socket.socket) -> float:
        """Seconds left of the connection's ``hello_timeout_s`` (counted from accept)."""
        info = self._info.get(conn)
        if info is None or not info.deadline:
            return self.limits.hello_timeout_s
        return max(0.001, info.deadline - asyncio.get_running_loop().time())

    async def _handshake(self, conn: socket.socket, tls: ServerTls) -> None:
        """TLS handshake on a new connection, within ``hello_timeout_s``; a failure is
        :class:`Dropped` (one log line naming the reason, e.g. a plaintext client)."""
        stream = TlsStream(conn, tls.ssl_context())
        try:
            await self._within(stream.handshake(), self._hello_left(conn),
                               "the TLS handshake (data_plane.hello_timeout_s)")
        except ssl.SSLError as exc:
            raise Dropped(f"TLS handshake failed ({exc.reason or exc}): not a TLS client, "
                          f"or its certificate is not trusted") from None
        self._streams[conn] = stream

    async def _recv_some(self, conn: socket.socket, view: memoryview) -> int:
        """Up to ``len(view)`` bytes into ``view`` (through TLS if on); 0: peer closed."""
        stream = self._streams.get(conn)
        if stream is not None:
            return await stream.recv_into(view)
        return await asyncio.get_running_loop().sock_recv_into(conn, view)

    async def _recv_all(self, conn: socket.socket, view: memoryview) -> None:
        """Fill ``view``; ConnectionResetError if the peer closes first."""
        got = 0
        while got < len(view):
            k = await self._recv_some(conn, view[got:])
            if k == 0:
                raise ConnectionResetError("peer closed")
            got += k

    async def _send(self, conn: socket.socket, data: bytes | memoryview) -> None:
        stream = self._streams.get(conn)
        if stream is not None:
            await stream.sendall(data)
        else:
            await asyncio.get_running_loop().sock_sendall(conn, data)

    def _peer(self, conn: socket.socket) -> str:
        info = self._info.get(conn)
        return info.peer if info is not None else "an unknown peer"

    async def _within(self, aw: Awaitable[T], timeout_s: float, what: str) -> T:
        """``await aw``, or :class:`Dropped` naming ``what`` after ``timeout_s``."""
        try:
            return await asyncio.wait_for(aw, timeout_s)
        except asyncio.TimeoutError:
            raise Dropped(f"{what} took longer than {timeout_s:g} s") from None

    def _recv_now(self, conn: socket.socket, view: memoryview) -> int:
        """What of ``view`` the kernel already holds, without waiting (-1: the peer
        closed; 0 under TLS, whose reads always take the bounded path).

        The fast path of every bounded read: a request or payload that has already
        arrived is taken with one ``recv_into`` and no timer, task or future (in 3.11
        ``asyncio.wait_for`` costs a task and a ``call_later`` per call, a quarter of
        the service's CPU on 64 KiB TCP gets); only what has to be waited for is."""
        if not view or conn in self._streams:
            return 0
        try:
            k = conn.recv_into(view)
        except (BlockingIOError, InterruptedError):
            return 0
        return k if k else -1

    async def _recv_into(self, conn: socket.socket, view: memoryview, what: str) -> None:
        """Fill ``view`` within ``read_timeout_s`` (:class:`Dropped` after it); what has
        already arrived is taken without a timer (:meth:`_recv_now`)."""
        k = self._recv_now(conn, view)
        if k < 0:
            raise ConnectionResetError("peer closed")
        if k < len(view):
            await self._within(self._recv_all(conn, view[k:]), self.limits.read_timeout_s,
                               f"{what} (data_plane.read_timeout_s)")

    async def _run_op(self, conn: socket.socket, s: Session, op: int, length: int,
                      counter: str, refuse: Callable[[str], Awaitable[NoReturn]]
                      ) -> tuple[Status, bytes] | None:
        """One control fast-path op, as both sockets carry it: ``op`` known and its body
        within ``service.shm_op_max_bytes``, the body read within ``read_timeout_s``, run
        by :func:`~ctxmem_dpu.transport.shm_fastpath.serve_op` and counted as
        ``{counter}_{name}``. Returns the (status, body) to answer, or None (a no-reply
        RELEASE). A malformed frame goes to ``refuse(reason)``, which answers
        BAD_REQUEST and closes the connection (the caller's framing)."""
        cap = self.store.cfg.service.shm_op_max_bytes
        name = SHM_OP_NAMES.get(op)
        if name is None:
            await refuse(f"unknown op {op}")
        if length > cap:
            await refuse(f"{name} body of {length} bytes over service.shm_op_max_bytes="
                         f"{cap}" + (" (the fast path is off)" if cap == 0 else ""))
        body = bytearray(length)
        await self._recv_into(conn, memoryview(body), f"receiving a {name} body")
        try:
            out = await serve_op(self.store, s.id, op, body, self.pod,  # not copied
                                 staging=self.staging_ops)
        except Malformed as exc:
            await refuse(f"malformed {name}: {exc}")
        del body
        self.store.counters[f"{counter}_{name}"] += 1
        return out

    def _send_now(self, conn: socket.socket, parts: list[bytes | memoryview]) -> int:
        """Bytes of ``parts`` the kernel takes at once, in one ``sendmsg`` (no join, no
        copy in Python; 0 under TLS, whose writes always take the bounded path)."""
        if conn in self._streams:
            return 0
        try:
            return conn.sendmsg(parts)
        except (BlockingIOError, InterruptedError):
            return 0

    async def _sendall(self, conn: socket.socket, data: bytes | memoryview, what: str) -> None:
        """Send ``data`` within ``read_timeout_s``: a peer that stops reading is dropped."""
        await self._sendmany(conn, [data], what)

    async def _sendmany(self, conn: socket.socket, parts: list[bytes | memoryview],
                        what: str) -> None:
        """Send ``parts`` in order within ``read_timeout_s`` (a peer that stops reading is
        dropped): first one non-blocking ``sendmsg`` with no timer, then whatever the
        socket did not take under the deadline."""
        sent = self._send_now(conn, parts)
        rest: list[memoryview] = []
        try:
            for p in parts:
                n = len(p) if isinstance(p, bytes) else p.nbytes
                if sent >= n:
                    sent -= n
                    continue
                rest.append(memoryview(p).cast("B")[sent:])
                sent = 0
            if rest:
                await self._within(self._send_parts(conn, rest),
                                   self.limits.read_timeout_s,
                                   f"{what} (data_plane.read_timeout_s)")
        finally:  # the caller releases the slot's view: no export of it may outlive this
            for v in rest:
                v.release()

    async def _send_parts(self, conn: socket.socket, parts: list[memoryview]) -> None:
        for p in parts:
            await self._send(conn, p)

    async def _next_request(self, conn: socket.socket, size: int) -> bytes | None:
        """The next ``size``-byte request header, or None when the peer closed cleanly
        between requests. Waits ``idle_timeout_s`` for its first byte (then
        :class:`Dropped` at INFO), ``read_timeout_s`` for the rest."""
        buf = bytearray(size)
        view = memoryview(buf)
        idle = self.limits.idle_timeout_s
        k = self._recv_now(conn, view)  # pipelined requests: no timer (_recv_now)
        if k < 0:
            return None
        if k == 0:
            try:
                k = await asyncio.wait_for(self._recv_some(conn, view), idle)
            except asyncio.TimeoutError:
                raise Dropped(f"idle for {idle:g} s (data_plane.idle_timeout_s)",
                              logging.INFO) from None
            if k == 0:
                return None
        if k < size:
            await self._recv_into(conn, view[k:], "receiving a request header")
        return bytes(buf)

    async def _fail(self, conn: socket.socket, answer: bytes, reason: str) -> NoReturn:
        """Answer ``answer`` (best effort, bounded) and drop the connection for
        ``reason``: after a bad header nothing more is read from it."""
        with contextlib.suppress(OSError, Dropped):
            await self._sendall(conn, answer, "answering a refused request")
        raise Dropped(reason)

    async def _hello(self, conn: socket.socket, hello: struct.Struct, magic: bytes,
                     reply: Callable[[Status], bytes]) -> Session | None:
        """Read the connection's hello (magic, session id, token) and answer it.

        Returns the authenticated session, or None after answering UNAUTHENTICATED (a
        wrong magic, an unknown session or a wrong token) or TOO_MANY_CONNECTIONS (the
        tenant's cap); the caller then ends. No hello within ``hello_timeout_s``:
        :class:`Dropped`.
        """
        raw = bytearray(hello.size)
        try:
            await self._within(self._recv_all(conn, memoryview(raw)),
                               self._hello_left(conn), "waiting for HELLO")
        except Dropped:
            raise Dropped(f"no HELLO within {self.limits.hello_timeout_s:g} s of accept "
                          f"(data_plane.hello_timeout_s)") from None
        got, session_id, token = hello.unpack(raw)
        s = self.authenticate(session_id, token) if got == magic else None
        if s is None:
            await self._fail(conn, reply(Status.UNAUTHENTICATED),
                             f"bad HELLO magic {got!r}" if got != magic else
                             f"unknown session {session_id} or wrong token")
        stream = self._streams.get(conn)
        if self.tls is not None and self.tls.mutual and (
                stream is None or stream.peer_tenant != s.tenant):
            await self._fail(conn, reply(Status.UNAUTHENTICATED),
                             f"the client certificate names tenant "
                             f"{stream.peer_tenant if stream else None!r}, the HELLO's "
                             f"session is tenant {s.tenant!r}")
        cap = self.limits.max_connections_per_tenant
        if self._per_tenant[s.tenant] >= cap:
            await self._fail(conn, reply(Status.TOO_MANY_CONNECTIONS),
                             f"tenant {s.tenant!r} already has {cap} data connections "
                             f"(data_plane.max_connections_per_tenant)")
        info = self._info.setdefault(conn, _ConnInfo("an unknown peer"))
        if info.ticket is not None:  # authenticated: no longer counted, nor evictable
            info.ticket.done()
            info.ticket = None
        info.tenant = s.tenant
        self._per_tenant[s.tenant] += 1
        await self._sendall(conn, reply(Status.OK), "answering HELLO")
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


def _shutter(conn: socket.socket) -> Callable[[], None]:
    """Closes ``conn`` for :class:`Unauthenticated` (an evicted connection): a shutdown,
    so its task's next read sees the end and its own ``finally`` closes the socket."""
    def shut() -> None:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
    return shut


def _ours(task: asyncio.Task[None]) -> bool:
    """Whether ``task`` runs on the running loop (only then can close wait for it)."""
    try:
        return task.get_loop() is asyncio.get_running_loop()
    except RuntimeError:
        return False
