"""The shim's client: a blocking core (:class:`Client`: connection, sessions, RPCs); its
namespaces are in :mod:`ctxmem.namespace` and the asyncio facade (:class:`AsyncClient`) in
:mod:`ctxmem.aio`.

One request = one batched RPC per phase, never one per block::

    put:  Allocate(keys) -> write bytes into the slots -> Commit(CRCs)
    get:  Acquire(keys)  -> read bytes out of the slots -> Release

Why the core is blocking and the async API runs it on worker threads: engines fork their
worker processes (vLLM's default), and ``grpc.aio`` does not survive ``fork()`` (the child
crashes inside gRPC). Blocking gRPC with ``GRPC_ENABLE_FORK_SUPPORT`` does: the child
drops the parent's channel and sessions (detected by a changed pid) and reconnects on
first use. ``import ctxmem`` sets that variable (and the ``poll`` strategy it needs)
unless the process already chose; import ctxmem before grpc for it to take effect.

Sessions are per tenant; a namespace belongs to one session. When the service restarts
(unknown session) or drops the connection, the client reconnects, reopens its namespaces
and retries the request once; a put's bytes are still in the caller's buffers, so nothing
is lost, and a get that cannot be completed is a miss, never wrong data.

Sessions end on the service, never leak (docs/security.md, "Session lifetime"): each one
keeps a ``Hold`` call open while it lives, so when this process dies or its connection
drops the service ends it ``service.session_orphan_s`` later; :meth:`Client.close` (and
the ``with`` exit) sends ``Disconnect`` for each, bounded by :data:`CLOSE_TIMEOUT_S`, errors
logged, never raised; a session replaced after a failure is ended the same way.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import grpc

if TYPE_CHECKING:
    from ctxmem.staging import StagingRegion

from ctxmem.group import NamespaceGroup
from ctxmem.namespace import LookupResult, Namespace, PutResult
from ctxmem.tls import TlsConfig
from ctxmem.transport.base import DataChannel, fast_ops_wanted
from ctxmem_common.errors import (
    ERROR_METADATA_KEY,
    CtxmemError,
    InvalidArgument,
    Unavailable,
    UnknownSession,
    error_for_code,
)
from ctxmem_common.identity import SESSION_TOKEN_METADATA_KEY
from ctxmem_common.layout import KVLayout
from ctxmem_common.netaddr import split_hostport
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.proto import ctxmem_pb2_grpc as pb_grpc
from ctxmem_common.protoconv import TRANSPORTS, transport_to_pb

__all__ = ["Client", "LookupResult", "Namespace", "PutResult", "TransportName"]

log = logging.getLogger(__name__)
TransportName = Literal["auto", "shm", "tcp", "rdma"]

CLOSE_TIMEOUT_S = 2.0
"""The longest :meth:`Client.close` waits for the service to end its sessions (all of
them together; less when the client's ``timeout_s`` is less). A service that does not
answer in time (down, stopped, unreachable) ends them itself once their Hold calls end."""

# A Hold call that ended with one of these is not opened again (the service has no Hold:
# an older one; or the session is gone: the next call reconnects).
_HOLD_FINAL = (grpc.StatusCode.OK, grpc.StatusCode.UNIMPLEMENTED,
               grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def _rpc_error(exc: grpc.RpcError, endpoint: str, method: str) -> CtxmemError:
    call: Any = exc
    for key, value in call.trailing_metadata() or ():
        if key == ERROR_METADATA_KEY:
            return error_for_code(str(value), call.details() or method)
    code = call.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return Unavailable(
            f"ctxmem service at {endpoint} is unavailable during {method}: {call.details()}; "
            f"is `ctxmem serve` running there?")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Unavailable(f"ctxmem {method} at {endpoint} timed out: {call.details()}")
    return CtxmemError(f"ctxmem {method} failed: {code.name}: {call.details()}")


# Every Client, so their Hold calls are dropped at interpreter exit (below).
_CLIENTS: weakref.WeakSet[Client] = weakref.WeakSet()


@atexit.register
def _drop_holds_at_exit() -> None:
    """Cancel the Hold calls of clients never closed while gRPC is still importable: a
    call object collected after the interpreter tore gRPC's modules down prints an
    "Exception ignored" traceback. Their sessions end on the service as orphans once
    this process is gone."""
    for client in list(_CLIENTS):
        client._drop_holds()


class _Ending(NamedTuple):
    """A session to end on the service: its id, token and Hold call (or None)."""

    id: bytes
    token: bytes
    hold: Any


class _Session:
    def __init__(self, tenant: str, session_id: bytes, token: bytes, channel: DataChannel,
                 epoch: int, hold: Any = None, acting: str = "") -> None:
        self.tenant = tenant
        # The tenant the service says this session acts for (ConnectResponse.tenant): the
        # requested one, or NAME@uidN for another local user of an insecure-mode service.
        self.acting = acting or tenant
        self.id = session_id
        self.token = token
        self.channel = channel
        self.epoch = epoch
        # The session's open Hold call (a grpc.Future), while the session lives.
        self.hold = hold


class Client:
    """Blocking client; safe from any thread and across ``fork()``.

    ``transport``: ``"shm"`` (same host), ``"tcp"``, or ``"auto"`` (shared memory when the
    service's socket is reachable here, else TCP). Commit always carries the client's
    CRC32C of each block (the service requires it), so a block damaged between the
    caller's buffer and the service is never committed. (``verify_puts``, which once
    turned that off, does nothing: passing it warns, DeprecationWarning, and it will be
    removed; drop it.) ``verify_gets`` (default on, every
    transport) checks each block against the CRC32C committed with it as it is copied out
    (fused with the copy, through a one-block bounce), and writes it into the caller's
    buffer only if it matches: a get then returns exactly the committed bytes or a miss,
    and leaves the buffers past its count untouched, whatever other clients do.
    ``verify_gets=False`` copies unchecked; it is unsafe with untrusted writers on shared
    memory (a client that once held a slot can still write its slab) and voids the
    untouched guarantee.

    ``copy_threads`` (shared memory): how many threads copy one batch of a get or a put
    between the service's slabs and the caller's buffers (default ``min(2, the CPUs this
    process may run on)``; 1 copies on the calling thread only). Only a batch of at least
    16 MiB is split (``ctxmem.transport.shm.COPY_THREADS_MIN_BYTES``), into contiguous
    parts; the
    ``copy_threads - 1`` helper threads are made on first use, per channel. A verified get
    split this way still ends at the first block that fails its check, but a buffer
    after it that another thread had already filled is zeroed, not left untouched.

    ``channel_options``: extra gRPC channel arguments, merged with the client's own
    (64 MiB message size limits); one of the same name replaces the client's. For example
    ``[("grpc.use_local_subchannel_pool", 1)]`` gives this client subchannels of its own:
    gRPC otherwise shares them, with their reconnect backoff, between every channel to
    one address in the process, so a fresh client to a just-restarted service could fail
    its first calls for a second or more (the chaos campaign restarts services often).
    """

    def __init__(
        self,
        endpoint: str = "127.0.0.1:50051",
        *,
        transport: TransportName = "auto",
        tenant_token: str = "",
        timeout_s: float = 30.0,
        verify_puts: bool | None = None,
        verify_gets: bool = True,
        max_batch_bytes: int = 256 << 20,
        copy_threads: int | None = None,
        client_name: str = "",
        channel_options: Sequence[tuple[str, Any]] = (),
        tls: TlsConfig | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.transport = transport
        self.tenant_token = tenant_token
        self.tls = tls
        self.timeout_s = timeout_s
        if verify_puts is not None:
            warnings.warn(
                f"ctxmem.Client(verify_puts={verify_puts}) does nothing: every Commit "
                f"carries the client's CRC32C of each block and the service requires it. "
                f"Drop the argument; it will be removed in a later release.",
                DeprecationWarning, stacklevel=2)
        #: Puts the service shed (``Shed``: its stores backed up); engines' integrations
        #: report it. Counted per put call, whatever its size.
        self.puts_shed = 0
        self.verify_gets = verify_gets
        self.max_batch_bytes = max_batch_bytes
        if copy_threads is not None and copy_threads < 1:
            raise InvalidArgument(f"copy_threads={copy_threads}: pass 1 or more (1: copy on "
                                  f"the calling thread only), or None for the default")
        # The CPUs this process may run on, not the machine's: an engine pinned to one
        # core gains nothing from a second copy thread time-sliced on the same core.
        self.copy_threads = copy_threads if copy_threads is not None else min(
            2, len(os.sched_getaffinity(0)))
        self.client_name = client_name or f"{socket.gethostname()}:{os.getpid()}"
        # One entry per name (the caller's replaces ours): gRPC's own rule for a repeated
        # argument is not one to rely on.
        options: dict[str, Any] = {
            "grpc.max_receive_message_length": 64 << 20,
            "grpc.max_send_message_length": 64 << 20,
        }
        if tls is not None:
            options.update(tls.grpc_options())
        options.update(channel_options)
        self.channel_options: list[tuple[str, Any]] = list(options.items())
        self._lock = threading.RLock()
        self._pid = -1
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.ContextMemoryStub | None = None
        self._sessions: dict[str, _Session] = {}
        # session id -> session token: every call after Connect carries its session's
        # token as call metadata (the service's interceptor checks it).
        self._tokens: dict[bytes, bytes] = {}
        self._epoch = 0
        self.transport_in_use = ""
        # Disconnect calls not waited for: kept referenced until done, since gRPC cancels
        # a call whose future is garbage collected.
        self._unanswered_ends: set[Any] = set()
        _CLIENTS.add(self)

    # -- plumbing --------------------------------------------------------------------
    def _stub_(self) -> pb_grpc.ContextMemoryStub:
        with self._lock:
            if self._pid != os.getpid():
                # New process (or first use): the parent's channel and sessions are not
                # ours to use or close; start over.
                self._pid = os.getpid()
                self._channel = None
                self._sessions = {}
                self._tokens = {}
                self._unanswered_ends = set()
                self._epoch += 1
            if self._stub is None or self._channel is None:
                if self.tls is not None:
                    self._channel = grpc.secure_channel(
                        self.endpoint, self.tls.grpc_credentials(),
                        options=self.channel_options)
                else:
                    self._channel = grpc.insecure_channel(self.endpoint,
                                                          options=self.channel_options)
                self._stub = pb_grpc.ContextMemoryStub(self._channel)
            return self._stub

    def _rpc(self, method: str, request: Any) -> Any:
        fn = getattr(self._stub_(), method)
        # The token of the session the request names; empty for one this client no longer
        # holds (a stale id after a reconnect): the service answers "unknown session".
        session_id = getattr(request, "session_id", b"")
        metadata = ((SESSION_TOKEN_METADATA_KEY, self._tokens.get(session_id, b"")),) \
            if session_id else None
        if session_id:
            # A verified get's Release went on the data channel without an answer; a gRPC
            # call after it (an Evict, a Delete: leased blocks are kept) must
            # not overtake it, so wait for the channel to catch up first (one round trip,
            # only when such a frame is outstanding).
            for s in list(self._sessions.values()):
                if s.id == session_id and s.channel.unanswered:
                    s.channel.flush()
        try:
            return fn(request, timeout=self.timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            raise _rpc_error(exc, self.endpoint, method) from None

    def health(self) -> pb.HealthResponse:
        """The service's status, instance id, offered transports and data endpoints."""
        return self._rpc("Health", pb.HealthRequest())

    def stats(self) -> dict[str, float]:
        """Every counter and gauge of the service, by name."""
        return dict(self._rpc("Stats", pb.StatsRequest()).values)

    def _choose_transport(self, health: pb.HealthResponse) -> str:
        offered = {name for name in TRANSPORTS if transport_to_pb(name) in health.transports}
        if self.transport != "auto":
            if self.transport not in offered:
                raise InvalidArgument(
                    f"transport {self.transport!r} is not offered by the service at "
                    f"{self.endpoint} (it offers {sorted(offered)})")
            return self.transport
        if "shm" in offered and health.shm_socket and os.path.exists(health.shm_socket):
            return "shm"
        if "tcp" in offered:
            return "tcp"
        raise InvalidArgument(f"no usable transport: the service offers {sorted(offered)}; "
                              f"pass transport= explicitly")

    def _open_channel(self, name: str, health: pb.HealthResponse, session_id: bytes,
                      token: bytes) -> DataChannel:
        if name == "shm":
            from ctxmem.transport.shm import ShmChannel

            return ShmChannel(health.shm_socket, session_id, token, self.timeout_s,
                              ops=health.shm_ops and fast_ops_wanted(),
                              copy_threads=self.copy_threads)
        if name == "tcp":
            from ctxmem.transport.tcp import TcpChannel

            host, port = split_hostport(health.data_endpoint, "Health.data_endpoint",
                                        default_host="")
            if host in ("", "0.0.0.0", "::"):  # the service listens on every address
                host = self.endpoint.rpartition(":")[0].strip("[]") or "127.0.0.1"
            return TcpChannel(host, port, session_id, token, self.timeout_s, tls=self.tls,
                              ops=health.tcp_ops and fast_ops_wanted())
        if name == "rdma":  # RDMA (issue 3): QPs connected over this gRPC channel
            from ctxmem.transport.rdma import RdmaChannel

            assert self._channel is not None
            return RdmaChannel(self._channel, session_id, token, self.timeout_s)
        raise InvalidArgument(f"transport {name!r} is not available in this build of the shim")

    def _session(self, tenant: str, stale: _Session | None = None) -> _Session:
        """The tenant's session; a new one when ``stale`` is the current one."""
        self._stub_()  # resets state in a forked child
        with self._lock:
            s = self._sessions.get(tenant)
            if s is not None and (stale is None or s is not stale):
                self._keep_held(s)
                return s
            if s is not None:
                # Replaced: end it on the service too (without waiting: the service may be
                # the reason it failed; dropping its Hold ends it there anyway).
                del self._sessions[tenant]
                s.channel.close()
                self._end_sessions([_Ending(s.id, s.token, s.hold)], wait_s=0.0)
                s.hold = None
            health = self.health()
            name = self._choose_transport(health)
            resp = self._rpc("Connect", pb.ConnectRequest(
                client_name=self.client_name, transport=transport_to_pb(name), tenant=tenant,
                tenant_token=self.tenant_token, hold=True))
            self._tokens[resp.session_id] = resp.session_token
            # Right after Connect: the service ends a held session that has no Hold for
            # service.session_orphan_s.
            hold = self._open_hold(resp.session_id)
            try:
                channel = self._open_channel(name, health, resp.session_id,
                                             resp.session_token)
            except BaseException:
                self._end_sessions([_Ending(resp.session_id, resp.session_token, hold)],
                                   wait_s=0.0)
                raise
            self._epoch += 1
            s = _Session(tenant, resp.session_id, resp.session_token, channel, self._epoch,
                         hold, acting=resp.tenant)
            self._sessions[tenant] = s
            self.transport_in_use = name
            return s

    # -- session lifetime on the service ----------------------------------------------
    def _open_hold(self, session_id: bytes) -> Any:
        """Open the session's Hold call (no deadline; it ends when the session does or
        this client goes away); None if it could not be started."""
        stub = self._stub_()
        metadata = ((SESSION_TOKEN_METADATA_KEY, self._tokens.get(session_id, b"")),)
        try:
            return stub.Hold(pb.HoldRequest(session_id=session_id), metadata=metadata)
        except Exception as exc:  # the call object is made at once; failures arrive later
            log.debug("ctxmem: opening the Hold of session %s failed: %s", session_id.hex(),
                      exc)
            return None

    def _keep_held(self, s: _Session) -> None:
        """Open ``s``'s Hold again if it ended with the connection (the channel dropped
        and came back): the service then keeps the session. Not after a final status
        (the service has no Hold, or the session ended: the next call reconnects)."""
        call = s.hold
        if call is None or not call.done():
            return
        try:
            code = call.code()
        except Exception:
            code = None
        if code in _HOLD_FINAL:
            return
        s.hold = self._open_hold(s.id)

    def _end_sessions(self, sessions: Sequence[_Ending], wait_s: float) -> None:
        """Ask the service to end ``sessions`` (Disconnect), waiting at most ``wait_s``
        in all (0: do not wait), then drop their Hold calls. Errors are logged, never
        raised: a session the service no longer knows is already ended, and one it could
        not be told about ends there once its Hold call is gone."""
        if not sessions:
            return
        deadline = time.monotonic() + wait_s
        pending = []
        try:
            stub = self._stub_()
            for s in sessions:
                metadata = ((SESSION_TOKEN_METADATA_KEY, s.token),)
                pending.append((s, stub.Disconnect.future(
                    pb.DisconnectRequest(session_id=s.id), metadata=metadata,
                    timeout=max(wait_s, CLOSE_TIMEOUT_S))))
        except Exception as exc:
            log.info("ctxmem: ending %d session(s) at %s: %s", len(sessions), self.endpoint,
                     exc)
        if wait_s <= 0:
            for _s, fut in pending:
                self._unanswered_ends.add(fut)
                fut.add_done_callback(self._unanswered_ends.discard)
        else:
            for s, fut in pending:
                try:
                    fut.result(timeout=max(0.0, deadline - time.monotonic()))
                except grpc.FutureTimeoutError:
                    fut.cancel()
                    log.info("ctxmem: session %s at %s: no answer to Disconnect within "
                             "%.1f s; the service ends it once its Hold call is gone",
                             s.id.hex(), self.endpoint, wait_s)
                except grpc.RpcError as exc:
                    code = getattr(exc, "code", lambda: None)()
                    if code != grpc.StatusCode.UNAUTHENTICATED:  # unknown: already ended
                        log.info("ctxmem: Disconnect of session %s at %s failed: %s",
                                 s.id.hex(), self.endpoint, _rpc_error(
                                     exc, self.endpoint, "Disconnect"))
                except Exception as exc:
                    log.info("ctxmem: Disconnect of session %s at %s failed: %s",
                             s.id.hex(), self.endpoint, exc)
        for s in sessions:
            if s.hold is not None:
                s.hold.cancel()
            self._tokens.pop(s.id, None)

    def _drop_holds(self) -> None:
        """Cancel and drop this process's Hold calls (a forked child only drops the
        parent's) and forget unanswered Disconnects: at exit, without ending sessions."""
        with self._lock:
            for s in self._sessions.values():
                if s.hold is not None and self._pid == os.getpid():
                    s.hold.cancel()
                s.hold = None
            self._unanswered_ends = set()

    def open_namespace(self, layout: KVLayout, *, model_id: str, tenant: str = "default",
                       tags: Mapping[str, str] | None = None,
                       weights_revision: str = "") -> Namespace:
        """Open (model, layout, tags) for ``tenant``; blocks live in the returned namespace.

        ``weights_revision``: the revision or digest of the model's weights (at most 256
        bytes), part of the namespace: KV stored under one revision is never returned
        under another with the same ``model_id``. Empty (the default): no revision, the
        namespace is the one earlier versions opened. With a revision, the shim checks
        that the service's namespace digest includes it (a service too old to know the
        field would silently ignore it) and raises CtxmemError if not."""
        ns = Namespace(self, layout, model_id, tenant, dict(tags or {}), weights_revision)
        try:
            ns._open()
        except (UnknownSession, Unavailable):
            # The cached session died with a restarted service: reconnect once.
            ns._open(stale=self._sessions.get(tenant))
        return ns

    def open_group(self, members: Sequence[Namespace]) -> NamespaceGroup:
        """A block group over ``members`` (namespaces this client opened, of one tenant):
        each key's blocks in every member are stored, counted and loaded as one unit,
        whole or not at all (:mod:`ctxmem.group`)."""
        return NamespaceGroup(members)

    def staging(self, nbytes: int, tenant: str = "default") -> StagingRegion:
        """A staging region of at least ``nbytes`` data bytes: service-owned memory
        mapped here, counted in ``tenant``'s quota, that puts are made from in one call
        per batch (:mod:`ctxmem.staging`; shared memory only). Close it (or use it as a
        context manager); :meth:`close` frees it on the service too."""
        from ctxmem.staging import open_region

        return open_region(self, nbytes, tenant)

    def close(self) -> None:
        """Close the data channels, end this client's sessions on the service
        (Disconnect; at most :data:`CLOSE_TIMEOUT_S`, or ``timeout_s`` if less, errors
        logged and swallowed) and close the connection. Idempotent."""
        with self._lock:
            if self._pid == os.getpid():
                sessions = list(self._sessions.values())
                for s in sessions:
                    s.channel.close()
                if self._channel is not None:
                    self._end_sessions([_Ending(s.id, s.token, s.hold) for s in sessions],
                                       min(self.timeout_s, CLOSE_TIMEOUT_S))
                    self._channel.close()
            self._sessions = {}
            self._tokens = {}
            self._channel = None
            self._stub = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def __getattr__(name: str) -> Any:
    # ``from ctxmem.client import AsyncClient`` kept working after the asyncio facade moved
    # to ctxmem.aio (imported lazily: ctxmem.aio imports this module).
    if name in ("AsyncClient", "AsyncNamespace"):
        from ctxmem import aio

        return getattr(aio, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
