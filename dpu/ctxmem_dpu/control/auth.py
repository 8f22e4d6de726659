"""Authentication of control-plane calls: who a Connect is, and that every later call is
made by the session it names.

* :func:`connect_tenant` decides a Connect's tenant from the request and the call's peer
  context. It is the one hook for identity: mtls mode takes the tenant from the verified
  client certificate (``context.auth_context()``; a request naming another tenant is
  refused), tokens mode checks the tenant's token, the insecure mode (loopback only)
  trusts the name within one local user (``service.local_users``: the kernel names the
  caller's uid, ``control/localpeer.py``).
* :class:`SessionAuthInterceptor` is the one check of every call after Connect: the
  request's ``session_id`` must name a live session whose token the call carries as the
  metadata ``ctxmem-session-token-bin``. An unknown session id and a wrong token get the
  same answer, so a guess tells nothing about which ids exist. It also parses every
  request leniently (:class:`MalformedRequest`): bytes that are not a valid message of the
  method's request type are answered INVALID_ARGUMENT with one log line, where gRPC
  itself would log a traceback and answer UNKNOWN (found by ``ctxmem fuzz``).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

from ctxmem_common.config import Config
from ctxmem_common.errors import ERROR_METADATA_KEY, ErrorCode, InvalidArgument, PermissionDenied
from ctxmem_common.identity import SESSION_TOKEN_METADATA_KEY, check_identity_mode
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.tlsident import tenant_of_pem
from ctxmem_dpu.blocks import Session
from ctxmem_dpu.control.localpeer import LocalUsers

if TYPE_CHECKING:
    from ctxmem_dpu.store.blockstore import BlockStore
from ctxmem_dpu.logthrottle import throttled
from ctxmem_dpu.tls import ServerTls, tls_version_ok

log = logging.getLogger(__name__)

# Calls that need no session: Connect makes one; Health and Stats name none.
OPEN_METHODS = frozenset({"Health", "Connect", "Stats"})


def connect_tenant(cfg: Config, request: pb.ConnectRequest, context: Any,
                   local_users: LocalUsers | None = None) -> str:
    """The tenant a Connect opens its session for, or PermissionDenied.

    In mtls mode the tenant is the one the verified client certificate names
    (:func:`ctxmem_common.tlsident.tenant_of_certificate`: URI SAN
    ``ctxmem://tenant/NAME``, else the subject CN), read from ``context`` (the call's
    ``grpc.aio.ServicerContext``); a request naming another tenant is refused, and with
    ``service.tenant_tokens`` also set the token is checked too. In insecure mode
    ``local_users`` (``service.local_users``) tells the local users apart: the caller's
    uid, asked of the kernel, scopes the name (:class:`LocalUsers`).
    """
    tenant = request.tenant
    if not tenant:
        raise InvalidArgument("Connect.tenant must not be empty")
    mode = check_identity_mode(cfg)  # the service refused to start without a valid one
    if mode == "mtls":
        peer = peer_tenant(context)
        if peer is None:
            raise PermissionDenied(
                "Connect: the client certificate names no tenant (no URI SAN "
                "ctxmem://tenant/NAME and no subject CN); issue one that does")
        if peer != tenant:
            raise PermissionDenied(
                f"Connect: tenant {tenant!r} refused: this client's certificate is for "
                f"tenant {peer!r}; connect as {peer!r} or use that tenant's certificate")
        if not cfg.service.tenant_tokens:
            return tenant
    if mode == "insecure":
        if local_users is None:
            return tenant
        try:
            return local_users.tenant(tenant, context.peer())
        except PermissionError as exc:
            raise PermissionDenied(str(exc)) from exc
    want = cfg.service.tenant_tokens.get(tenant, "")
    # Compare even for an unknown tenant (against itself), so timing tells nothing.
    ok = hmac.compare_digest(want.encode() or b"\0", request.tenant_token.encode())
    if not (ok and want):
        raise PermissionDenied(
            f"tenant {tenant!r}: missing or wrong tenant token; pass the tenant's token "
            f"from service.tenant_tokens (Client(tenant_token=...))")
    return tenant


def end_untrusted_sessions(store: BlockStore, tls: ServerTls) -> None:
    """Close every session opened with a client certificate that the current client CA
    no longer trusts (after a rotation; ``ServerTls.on_ca_change``): its allocations,
    leases and data-plane access end with it."""
    gone = [s for s in list(store.sessions.values())
            if s.peer_cert and not tls.peer_trusted(s.peer_cert)]
    for s in gone:
        store.close_session(s)
    if gone:
        log.warning("TLS client CA changed: ended %d session(s) opened with a client "
                    "certificate it no longer trusts (tenants %s)", len(gone),
                    sorted({s.tenant for s in gone}))


class MalformedRequest:
    """Stands in for a request whose bytes are not a valid message of its type."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    """``deserialize`` that returns a :class:`MalformedRequest` instead of raising: an
    exception in a deserializer is logged by gRPC with its traceback (a client could fill
    the log with them) and answered UNKNOWN."""
    def parse(data: bytes) -> Any:
        if deserialize is None:
            return data
        try:
            return deserialize(data)
        except DecodeError as exc:
            return MalformedRequest(str(exc))

    return parse


async def _refuse_malformed(method: str, request: MalformedRequest, context: Any) -> NoReturn:
    throttled(log, logging.WARNING, "grpc.malformed", "%s: malformed request refused (%s)",
              method, request.error)
    await _deny(context, grpc.StatusCode.INVALID_ARGUMENT, ErrorCode.INVALID_ARGUMENT,
                f"{method}: the request is not a valid message: {request.error}")


def peer_cert(context: Any) -> bytes | None:
    """The PEM of the call's verified client certificate, or None (not a TLS call, or no
    client certificate)."""
    try:
        pems = context.auth_context().get("x509_pem_cert") or []
    except Exception:  # no auth context: not a TLS call
        return None
    if not pems:
        return None
    return pems[0] if isinstance(pems[0], bytes) else str(pems[0]).encode()


def peer_tenant(context: Any) -> str | None:
    """The tenant the call's verified client certificate names, or None (no certificate,
    or one naming no tenant)."""
    pem = peer_cert(context)
    return tenant_of_pem(pem) if pem is not None else None


def session_with_token(sessions: Callable[[bytes], Session | None], session_id: Any,
                       token: bytes) -> Session | None:
    """The live session ``session_id`` when ``token`` is its token, else None: the one
    check of a session token, for gRPC calls (:class:`SessionAuthInterceptor`) and the
    metrics port's JSON Locate (:mod:`ctxmem_dpu.control.locate_http`). The token is
    compared in constant time, against a dummy when the session is unknown (same work,
    same answer), so an answer tells nothing about which session ids exist."""
    s = sessions(session_id) if isinstance(session_id, bytes) else None
    want = s.token if s is not None else b"\0" * 16
    if not hmac.compare_digest(want, token) or s is None:
        return None
    return s


class SessionAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses any call after Connect that does not carry its session's token.

    With ``tls`` (the listener is TLS), every call, Connect and Health included, is also
    refused unless its connection negotiated TLS 1.3 (gRPC's Python server API cannot set
    the minimum version itself). With ``server_tls`` in mutual mode, every call but Health
    is refused UNAUTHENTICATED when its client certificate no longer verifies against the
    current client CA (a rotation; :meth:`ctxmem_dpu.tls.ServerTls.peer_trusted`).
    """

    def __init__(self, sessions: Callable[[bytes], Session | None], tls: bool = False,
                 server_tls: ServerTls | None = None) -> None:
        self._sessions = sessions
        self._tls = tls or server_tls is not None
        self._server_tls = server_tls if server_tls is not None and server_tls.mutual \
            else None

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: Any,
    ) -> Any:
        handler = await continuation(details)
        method = str(details.method).rpartition("/")[2]
        if handler is None:
            return handler
        needs_session = method not in OPEN_METHODS
        token: bytes | None = None  # None: no token metadata at all
        for key, value in details.invocation_metadata or ():
            if key == SESSION_TOKEN_METADATA_KEY:
                token = value if isinstance(value, bytes) else b""
        check = self._check
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: Any) -> Any:
                try:
                    if isinstance(request, MalformedRequest):
                        await _refuse_malformed(method, request, context)
                    await check(method, getattr(request, "session_id", b""), token,
                                context, needs_session)
                except grpc.aio.AbortError:
                    del request  # not kept alive by the abort's reference cycle
                    raise
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary, request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
                try:
                    if isinstance(request, MalformedRequest):
                        await _refuse_malformed(method, request, context)
                    await check(method, getattr(request, "session_id", b""), token,
                                context, needs_session)
                except grpc.aio.AbortError:
                    del request  # see unary
                    raise
                async for response in inner_stream(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        return _refuse_handler(f"{method}: streaming requests are not served")

    async def _check(self, method: str, session_id: Any, token: bytes | None, context: Any,
                     needs_session: bool = True) -> None:
        """Abort the call unless ``session_id`` (the request's) is a live session and
        ``token`` is its token (constant-time compare). No token metadata at all is a
        client that does not speak this protocol (PERMISSION_DENIED); a wrong or empty one
        is answered as an unknown session (the shim reconnects). It is given the id, not
        the request, so an abort's reference cycle does not hold the request. With TLS,
        first the connection must be TLS 1.3; a call that ``needs_session`` false (Health,
        Connect, Stats) needs nothing more."""
        if self._tls and not tls_version_ok(context):
            await _deny(context, grpc.StatusCode.PERMISSION_DENIED,
                        ErrorCode.PERMISSION_DENIED,
                        f"{method}: the connection negotiated less than TLS 1.3; the "
                        f"service requires TLS 1.3")
        if self._server_tls is not None and method != "Health" \
                and self._server_tls.ca_changed():
            pem = peer_cert(context)
            if pem is not None and not self._server_tls.peer_trusted(pem):
                await _deny(context, grpc.StatusCode.UNAUTHENTICATED,
                            ErrorCode.PERMISSION_DENIED,
                            f"{method}: this connection's client certificate is no longer "
                            f"trusted: tls.client_ca_file changed and does not verify it; "
                            f"use a certificate issued by the current client CA (a new "
                            f"connection)")
        if not needs_session:
            return
        if token is None:
            await _deny(context, grpc.StatusCode.UNAUTHENTICATED, ErrorCode.PERMISSION_DENIED,
                        f"{method}: no session token; send the session_token from Connect as "
                        f"the call metadata {SESSION_TOKEN_METADATA_KEY!r} (the ctxmem shim "
                        f"does this)")
        if session_with_token(self._sessions, session_id, token) is None:
            await _deny(context, grpc.StatusCode.UNAUTHENTICATED, ErrorCode.UNKNOWN_SESSION,
                        f"{method}: unknown session or wrong session token (the service "
                        f"restarted or the session closed); reconnect")


async def _deny(context: Any, status: grpc.StatusCode, code: ErrorCode, message: str
                ) -> NoReturn:
    """End the call with ``status`` and the ``ctxmem-error`` the shim maps to a class."""
    context.set_trailing_metadata(((ERROR_METADATA_KEY, code.value),))
    await context.abort(status, message)
    raise AssertionError("grpc.aio context.abort returned")  # it always raises


def _refuse_handler(message: str) -> Any:
    async def refuse(request_iterator: Any, context: Any) -> Any:
        await _deny(context, grpc.StatusCode.UNIMPLEMENTED, ErrorCode.INVALID_ARGUMENT, message)

    return grpc.stream_unary_rpc_method_handler(refuse)
