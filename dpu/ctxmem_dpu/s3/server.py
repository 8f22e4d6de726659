"""The S3-compatible endpoint (docs/s3.md): aiohttp's HTTP server on a bounded listener.

HTTP is parsed by aiohttp's server (its C parser, header limits), never by hand. The
listener is bounded like every other one (docs/security.md, "Listeners"): the door
accepts itself, admits each connection through
:class:`~ctxmem_dpu.listenguard.Unauthenticated` (``s3.max_unauthenticated`` in total,
``s3.max_unauthenticated_per_source`` per peer IP, the oldest closed over a cap, none
while free fds are below ``service.fd_reserve``), gives it ``s3.head_timeout_s`` from
accept for the TLS handshake and a request whose AWS Signature V4 verifies, and caps all
connections at ``s3.max_connections``. TLS comes from the ``tls:`` section (the same
certificate, rotated the same way). Each request has ``s3.request_timeout_s``.

The tenant of a request is its access key's owner (``s3.access_keys``); its objects are
that tenant's blocks (:mod:`ctxmem_dpu.s3.objects`). A refusal is an S3 XML error
(AccessDenied, SignatureDoesNotMatch, ...), never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import xml.etree.ElementTree as ET
from typing import Any
from urllib.parse import unquote

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from ctxmem_common.config import Config
from ctxmem_common.config_s3 import s3_secret
from ctxmem_common.errors import (
    ConfigError,
    CtxmemError,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
)
from ctxmem_common.netaddr import split_hostport
from ctxmem_common.tlsident import tenant_of_der
from ctxmem_dpu.lifetime import AsyncResource
from ctxmem_dpu.listenguard import FdReserve, Ticket, Unauthenticated
from ctxmem_dpu.logthrottle import throttled
from ctxmem_dpu.s3.objects import ObjectStore, S3Error
from ctxmem_dpu.s3.ops import STREAMING, Operations, cut_short, xml_response
from ctxmem_dpu.s3.sigv4 import AuthError, verify
from ctxmem_dpu.store import BlockStore
from ctxmem_dpu.tls import ServerTls

__all__ = ["S3Door"]

log = logging.getLogger(__name__)


class _Conn:
    """One accepted connection: its ticket until its first request authenticates."""

    __slots__ = ("handler", "peer", "sock", "ticket", "timer", "transport")

    def __init__(self, sock: socket.socket, peer: str, ticket: Ticket | None) -> None:
        self.sock = sock
        self.peer = peer
        self.ticket: Ticket | None = ticket
        self.timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.BaseTransport | None = None
        self.handler: RequestHandler | None = None

    def authenticated(self) -> None:
        if self.ticket is not None:
            self.ticket.done()
            self.ticket = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def shut(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        if self.transport is not None:
            self.transport.abort()  # type: ignore[attr-defined]


class _Server(web.Server):
    """aiohttp's low-level server, telling the door when a connection ends."""

    def __init__(self, door: S3Door, **kwargs: Any) -> None:
        super().__init__(door.handle, **kwargs)
        self.door = door

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None
                        ) -> None:
        super().connection_lost(handler, exc)
        self.door.lost(handler)


class S3Door(AsyncResource):
    """The S3 endpoint on ``s3.listen``; :attr:`port` is the bound port after start."""

    def __init__(self, store: BlockStore, cfg: Config, tls: ServerTls | None = None,
                 fd_reserve: FdReserve | None = None) -> None:
        self.cfg = cfg.s3
        self.tls = tls
        self.host, self.port = split_hostport(cfg.s3.listen, "s3.listen")
        self.tenants = {k: v.tenant for k, v in cfg.s3.access_keys.items()}
        self.secrets = {k: s3_secret(k, v) for k, v in cfg.s3.access_keys.items()}
        self.objects = ObjectStore(store, cfg)
        self.ops = Operations(self.objects, cfg.s3)
        self._unauth = Unauthenticated("S3", cfg.s3.max_unauthenticated,
                                       cfg.s3.max_unauthenticated_per_source, fd_reserve)
        self._conns: dict[RequestHandler, _Conn] = {}
        self._open: set[_Conn] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._server: _Server | None = None
        self.refused = 0

    async def start(self) -> None:
        if self._sock is not None:
            return
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise ConfigError(
                f"s3.listen: cannot bind {self.host}:{self.port}: [errno {exc.errno}] "
                f"{exc.strerror}; pick another port, or set s3.listen: \"\" to serve no S3 "
                f"endpoint") from None
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._server = _Server(self, keepalive_timeout=self.cfg.keepalive_s,
                               access_log=None, auto_decompress=False)
        self._accepting = asyncio.create_task(self._accept(), name="ctxmem-s3-accept")
        log.info("S3 endpoint on %s:%d (%s, %d access keys)", self.host, self.port,
                 "TLS" if self.tls is not None else "no TLS", len(self.tenants))

    async def close(self) -> None:
        task, self._accepting = self._accepting, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for t in list(self._tasks):  # connections still in their TLS handshake
            t.cancel()
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        for c in list(self._open):
            c.shut()
        server, self._server = self._server, None
        if server is not None:
            with contextlib.suppress(Exception):
                await server.shutdown(1.0)

    # -- connections -------------------------------------------------------------------
    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                sock, addr = await loop.sock_accept(self._sock)
            except OSError as exc:  # EMFILE and friends: keep serving, back off
                throttled(log, logging.WARNING, "s3.accept", "S3 accept failed (%s); "
                          "retrying in 0.1 s", exc)
                await asyncio.sleep(0.1)
                continue
            peer = str(addr[0])
            if len(self._open) >= self.cfg.max_connections:
                throttled(log, logging.WARNING, "s3.refused", "S3 connection from %s "
                          "refused: %d connections open (s3.max_connections)", peer,
                          len(self._open))
                sock.close()
                continue
            conn = _Conn(sock, peer, None)
            ticket = self._unauth.admit(peer, conn.shut)
            if ticket is None:
                sock.close()
                continue
            conn.ticket = ticket
            conn.timer = loop.call_later(self.cfg.head_timeout_s, self._late, conn)
            self._open.add(conn)
            task = asyncio.create_task(self._connect(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            await asyncio.sleep(0)  # a flood of accepts lets requests in between

    def _late(self, conn: _Conn) -> None:
        conn.timer = None
        if conn.ticket is not None:
            throttled(log, logging.WARNING, "s3.head_timeout", "S3 connection from %s "
                      "closed: no signed request within %g s of accept (s3.head_timeout_s)",
                      conn.peer, self.cfg.head_timeout_s)
            conn.shut()

    async def _connect(self, conn: _Conn) -> None:
        loop = asyncio.get_running_loop()
        assert self._server is not None
        server = self._server

        def protocol() -> RequestHandler:
            h = server()
            self._conns[h] = conn
            conn.handler = h
            return h

        try:
            transport, _ = await loop.connect_accepted_socket(
                protocol, conn.sock,
                ssl=self.tls.ssl_context() if self.tls is not None else None,
                ssl_handshake_timeout=self.cfg.head_timeout_s if self.tls else None)
            conn.transport = transport
        except Exception as exc:  # a failed or cut TLS handshake: never connected
            throttled(log, logging.INFO, "s3.handshake", "S3 connection from %s ended "
                      "before its first request: %r", conn.peer, exc)
            if conn.handler is not None:
                self._conns.pop(conn.handler, None)
            self._drop(conn)
            conn.sock.close()

    def _drop(self, conn: _Conn) -> None:
        conn.authenticated()  # gives the ticket back, stops the timer
        self._open.discard(conn)

    def lost(self, handler: RequestHandler) -> None:
        conn = self._conns.pop(handler, None)
        if conn is not None:
            self._drop(conn)

    # -- requests ----------------------------------------------------------------------
    def _address(self, request: web.BaseRequest) -> tuple[str, str]:
        """(bucket, key) from the host (virtual-hosted) or the path (path-style)."""
        path = unquote(request.raw_path.split("?", 1)[0])
        host = request.headers.get("Host", "").rsplit(":", 1)[0].lower()
        domain = self.cfg.domain.lower()
        if domain and host.endswith("." + domain):
            return host[:-len(domain) - 1], path[1:]
        bucket, _, key = path[1:].partition("/")
        return bucket, key

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        rid = secrets.token_hex(8)
        conn = self._conns.get(request.protocol)
        try:
            return await self._handle(request, conn, rid)
        except Exception:
            streaming = request.get(STREAMING)
            if streaming is None:
                raise
            cut_short(request)  # headers out already: no error answer can follow them
            return streaming

    async def _handle(self, request: web.BaseRequest, conn: _Conn | None, rid: str
                      ) -> web.StreamResponse:
        try:
            signed = verify(request.method, request.raw_path, request.headers.items(),
                            request.headers, self.secrets, self.cfg.region,
                            self.cfg.max_clock_skew_s)
        except AuthError as exc:
            self.refused += 1
            throttled(log, logging.WARNING, "s3.auth", "S3 request from %s refused: %s %s",
                      conn.peer if conn else "?", exc.code, exc)
            return self._error(request, exc.status, exc.code, str(exc), rid, close=True)
        tenant = self.tenants[signed.access_key]
        named = self._certificate_tenant(request)
        if named is not None and named != tenant:  # mutual TLS: the certificate names it too
            self.refused += 1
            throttled(log, logging.WARNING, "s3.auth", "S3 request from %s refused: its "
                      "client certificate names tenant %r, its access key %s is tenant %r",
                      conn.peer if conn else "?", named, signed.access_key, tenant)
            return self._error(request, 403, "AccessDenied", f"the client certificate names "
                               f"tenant {named!r}; access key {signed.access_key} belongs to "
                               f"another tenant", rid, close=True)
        if conn is not None:
            conn.authenticated()
        try:
            bucket, key = self._address(request)
            return await asyncio.wait_for(
                self.ops.dispatch(request, tenant, bucket, key, signed.content_sha256),
                self.cfg.request_timeout_s)
        except Exception as exc:
            if request.get(STREAMING) is not None:
                raise  # headers out already: handle() cuts the connection short
            return self._failed(request, exc, tenant, rid)

    def _certificate_tenant(self, request: web.BaseRequest) -> str | None:
        """The tenant a mutual-TLS client certificate names (None without mutual TLS)."""
        if self.tls is None or not self.tls.mutual or request.transport is None:
            return None
        obj = request.transport.get_extra_info("ssl_object")
        der = obj.getpeercert(binary_form=True) if obj is not None else None
        return (tenant_of_der(der) or "") if der else ""

    def _failed(self, request: web.BaseRequest, exc: Exception, tenant: str, rid: str
                ) -> web.StreamResponse:
        """The S3 error answer for ``exc``, raised while serving ``request``."""
        if isinstance(exc, S3Error):
            # A body left unread is not drained: the connection closes after the answer.
            return self._error(request, exc.status, exc.code, str(exc), rid,
                               close=not request.content.is_eof())
        if isinstance(exc, asyncio.TimeoutError):
            return self._error(request, 400, "RequestTimeout", f"the request took over "
                               f"{self.cfg.request_timeout_s:g} s (s3.request_timeout_s)",
                               rid, close=True)
        if isinstance(exc, ResourceExhausted):
            return self._error(request, 503, "SlowDown", str(exc), rid)
        if isinstance(exc, PermissionDenied):
            return self._error(request, 403, "AccessDenied", str(exc), rid)
        if isinstance(exc, InvalidArgument):
            return self._error(request, 400, "InvalidArgument", str(exc), rid)
        if isinstance(exc, CtxmemError):
            log.warning("S3 %s %s of tenant %r failed: %s", request.method, request.path,
                        tenant, exc)
            return self._error(request, 503, "ServiceUnavailable", str(exc), rid)
        log.error("S3 %s %s of tenant %r failed", request.method, request.path, tenant,
                  exc_info=exc)
        return self._error(request, 500, "InternalError", f"internal error (request {rid}: "
                           f"see the service log)", rid, close=True)

    def _error(self, request: web.BaseRequest, status: int, code: str, message: str,
               rid: str, close: bool = False) -> web.StreamResponse:
        if request.method == "HEAD":
            resp: web.StreamResponse = web.Response(status=status)
        else:
            root = ET.Element("Error")
            for tag, text in (("Code", code), ("Message", message),
                              ("Resource", request.path), ("RequestId", rid)):
                ET.SubElement(root, tag).text = text
            resp = xml_response(root, status, namespace=False)
        resp.headers["x-amz-request-id"] = rid
        if close:
            resp.force_close()
        return resp
