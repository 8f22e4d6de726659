"""The shim's client: a blocking core (:class:`Client`) and an asyncio facade
(:class:`AsyncClient`).

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
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import grpc

from ctxmem.buffers import Staged
from ctxmem.transport.base import DataChannel, TransportError
from ctxmem_common.codecs import crc32c
from ctxmem_common.errors import (
    ERROR_METADATA_KEY,
    CtxmemError,
    InvalidArgument,
    Unavailable,
    UnknownSession,
    error_for_code,
)
from ctxmem_common.keys import pack_keys, validate_keys
from ctxmem_common.layout import KVLayout
from ctxmem_common.netaddr import split_hostport
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.proto import ctxmem_pb2_grpc as pb_grpc
from ctxmem_common.protoconv import (
    TIER_DRAM,
    TRANSPORTS,
    layout_to_pb,
    tier_from_pb,
    tier_to_pb,
    transport_to_pb,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
TransportName = Literal["auto", "shm", "tcp", "rdma"]


@dataclass(frozen=True)
class LookupResult:
    num_hits: int
    """How many leading keys are stored."""
    tiers: list[str] = field(default_factory=list)
    """Per hit, where it is: ``"dram"`` or ``"flash"``."""


@dataclass(frozen=True)
class PutResult:
    stored: int
    """Blocks newly committed by this call."""
    existing: int
    """Blocks already stored (nothing was written for them)."""


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


def _lookup_request(session_id: int, handle: int, keys: Sequence[bytes], prefix: bool
                    ) -> pb.LookupRequest:
    packed = pack_keys(keys) if len(keys) >= 64 else None
    if packed is not None:
        return pb.LookupRequest(session_id=session_id, namespace_handle=handle, prefix=prefix,
                                packed_keys=packed[0], key_len=packed[1])
    return pb.LookupRequest(session_id=session_id, namespace_handle=handle, keys=keys,
                            prefix=prefix)


class _Session:
    def __init__(self, tenant: str, session_id: int, channel: DataChannel, epoch: int) -> None:
        self.tenant = tenant
        self.id = session_id
        self.channel = channel
        self.epoch = epoch


class Client:
    """Blocking client; safe from any thread and across ``fork()``.

    ``transport``: ``"shm"`` (same host), ``"tcp"``, or ``"auto"`` (shared memory when the
    service's socket is reachable here, else TCP). ``verify_puts`` sends the client's
    CRC32C of each block with Commit, so a block damaged between the caller's buffer and
    the service is never committed; ``verify_gets`` checks each block's CRC32C after the
    transfer (default: on for TCP; for shared memory the lease check covers it).
    """

    def __init__(
        self,
        endpoint: str = "127.0.0.1:50051",
        *,
        transport: TransportName = "auto",
        tenant_token: str = "",
        timeout_s: float = 30.0,
        verify_puts: bool = True,
        verify_gets: bool | None = None,
        max_batch_bytes: int = 256 << 20,
        client_name: str = "",
    ) -> None:
        self.endpoint = endpoint
        self.transport = transport
        self.tenant_token = tenant_token
        self.timeout_s = timeout_s
        self.verify_puts = verify_puts
        self.verify_gets = verify_gets
        self.max_batch_bytes = max_batch_bytes
        self.client_name = client_name or f"{socket.gethostname()}:{os.getpid()}"
        self._lock = threading.RLock()
        self._pid = -1
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.ContextMemoryStub | None = None
        self._sessions: dict[str, _Session] = {}
        self._epoch = 0
        self.transport_in_use = ""

    # -- plumbing --------------------------------------------------------------------
    def _stub_(self) -> pb_grpc.ContextMemoryStub:
        with self._lock:
            if self._pid != os.getpid():
                # New process (or first use): the parent's channel and sessions are not
                # ours to use or close; start over.
                self._pid = os.getpid()
                self._channel = None
                self._sessions = {}
                self._epoch += 1
            if self._stub is None or self._channel is None:
                self._channel = grpc.insecure_channel(self.endpoint, options=[
                    ("grpc.max_receive_message_length", 64 << 20),
                    ("grpc.max_send_message_length", 64 << 20),
                ])
                self._stub = pb_grpc.ContextMemoryStub(self._channel)
            return self._stub

    def _rpc(self, method: str, request: Any) -> Any:
        fn = getattr(self._stub_(), method)
        try:
            return fn(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise _rpc_error(exc, self.endpoint, method) from None

    def health(self) -> pb.HealthResponse:
        return self._rpc("Health", pb.HealthRequest())

    def stats(self) -> dict[str, float]:
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

    def _open_channel(self, name: str, health: pb.HealthResponse, session_id: int,
                      token: bytes) -> DataChannel:
        if name == "shm":
            from ctxmem.transport.shm import ShmChannel

            return ShmChannel(health.shm_socket, session_id, token, self.timeout_s)
        if name == "tcp":
            from ctxmem.transport.tcp import TcpChannel

            host, port = split_hostport(health.data_endpoint, "Health.data_endpoint",
                                        default_host="")
            if host in ("", "0.0.0.0", "::"):  # the service listens on every address
                host = self.endpoint.rpartition(":")[0].strip("[]") or "127.0.0.1"
            return TcpChannel(host, port, session_id, token, self.timeout_s)
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
                return s
            if s is not None:
                s.channel.close()
            health = self.health()
            name = self._choose_transport(health)
            resp = self._rpc("Connect", pb.ConnectRequest(
                client_name=self.client_name, transport=transport_to_pb(name), tenant=tenant,
                tenant_token=self.tenant_token))
            channel = self._open_channel(name, health, resp.session_id, resp.session_token)
            self._epoch += 1
            s = _Session(tenant, resp.session_id, channel, self._epoch)
            self._sessions[tenant] = s
            self.transport_in_use = name
            return s

    def open_namespace(self, layout: KVLayout, *, model_id: str, tenant: str = "default",
                       tags: Mapping[str, str] | None = None) -> Namespace:
        ns = Namespace(self, layout, model_id, tenant, dict(tags or {}))
        try:
            ns._open()
        except (UnknownSession, Unavailable):
            # The cached session died with a restarted service: reconnect once.
            ns._open(stale=self._sessions.get(tenant))
        return ns

    def close(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                for s in self._sessions.values():
                    s.channel.close()
                if self._channel is not None:
                    self._channel.close()
            self._sessions = {}
            self._channel = None
            self._stub = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Namespace:
    """Blocks of one (tenant, model, layout, tags). Created by :meth:`Client.open_namespace`."""

    def __init__(self, client: Client, layout: KVLayout, model_id: str, tenant: str,
                 tags: dict[str, str]) -> None:
        self.client = client
        self.layout = layout
        self.model_id = model_id
        self.tenant = tenant
        self.tags = tags
        self.block_nbytes = layout.block_nbytes
        self.handle = 0
        self.digest = b""
        self._session: _Session | None = None

    def _open(self, stale: _Session | None = None) -> _Session:
        s = self.client._session(self.tenant, stale)
        if self._session is s:
            return s
        resp = self.client._rpc("OpenNamespace", pb.OpenNamespaceRequest(
            session_id=s.id, model_id=self.model_id, tags=self.tags,
            layout=layout_to_pb(self.layout)))
        if resp.block_nbytes != self.block_nbytes:
            raise CtxmemError(f"service computes {resp.block_nbytes} bytes per block for this "
                              f"layout, the shim {self.block_nbytes}: version mismatch")
        self.handle = resp.namespace_handle
        self.digest = resp.namespace_digest
        self._session = s
        return s

    def _retrying(self, op: Callable[[_Session], T]) -> T:
        """Run ``op``; after a service restart or a dropped connection, reconnect and retry
        once."""
        s = self._open()
        try:
            return op(s)
        except (UnknownSession, Unavailable) as exc:
            log.info("ctxmem: %s; reconnecting and retrying once", exc)
            return op(self._open(stale=s))

    def _batch(self, start: int, n: int) -> slice:
        per = max(1, self.client.max_batch_bytes // max(1, self.block_nbytes))
        return slice(start, min(start + per, n))

    # -- API -------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """How many leading ``keys`` are stored, and in which tier. Side-effect free.

        Keys are validated by the service (same errors), not twice on this hot path."""

        def op(s: _Session) -> LookupResult:
            r = self.client._rpc("Lookup", _lookup_request(s.id, self.handle, keys, True))
            return LookupResult(r.num_hits, [tier_from_pb(t) for t in r.tiers])

        return self._retrying(op)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Per-key presence (not prefix-based)."""

        def op(s: _Session) -> list[bool]:
            r = self.client._rpc("Lookup", _lookup_request(s.id, self.handle, keys, False))
            return [t != pb.TIER_UNSPECIFIED for t in r.tiers]

        return self._retrying(op)

    def put(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> PutResult:
        """Store one buffer per key (each exactly ``block_nbytes``)."""
        validate_keys(keys)
        if len(keys) != len(buffers):
            raise InvalidArgument(f"put got {len(keys)} keys and {len(buffers)} buffers; "
                                  f"pass one buffer per key")
        staged = Staged(list(buffers), self.block_nbytes, writable=False)
        stored = existing = 0
        start = 0
        while start < len(keys):
            sl = self._batch(start, len(keys))
            st, ex = self._put_batch(list(keys[sl]), staged.views[sl])
            stored += st
            existing += ex
            start = sl.stop
        return PutResult(stored, existing)

    def _put_batch(self, keys: list[bytes], views: list[memoryview]) -> tuple[int, int]:
        crcs = [crc32c(v) for v in views] if self.client.verify_puts else []
        rpc = self.client._rpc

        def op(s: _Session) -> tuple[int, int]:
            a = rpc("Allocate", pb.AllocateRequest(
                session_id=s.id, namespace_handle=self.handle, keys=keys))
            new = [i for i, e in enumerate(a.exists) if not e]
            if not new:
                rpc("Commit", pb.CommitRequest(session_id=s.id, allocation_id=a.allocation_id,
                                               abort=True))
                return 0, len(keys)
            try:
                s.channel.write(a.allocation_id, a.slots, [views[i] for i in new])
            except TransportError:
                with contextlib.suppress(CtxmemError):
                    rpc("Commit", pb.CommitRequest(session_id=s.id,
                                                   allocation_id=a.allocation_id, abort=True))
                raise
            c = rpc("Commit", pb.CommitRequest(
                session_id=s.id, allocation_id=a.allocation_id,
                crc32c=[crcs[i] for i in new] if crcs else []))
            return c.committed, len(keys) - len(new)

        return self._retrying(op)

    def get(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> int:
        """Fill ``buffers`` for the longest stored leading run of ``keys``; return its length.

        Blocks after the returned count are untouched. A block that fails a check, a lease
        that expired while reading, or a service that went away makes the run shorter
        (a miss), never returns wrong bytes.
        """
        validate_keys(keys)
        if len(keys) != len(buffers):
            raise InvalidArgument(f"get got {len(keys)} keys and {len(buffers)} buffers; "
                                  f"pass one buffer per key")
        staged = Staged(list(buffers), self.block_nbytes, writable=True)
        total = 0
        while total < len(keys):
            # A batch may come back short because the run hit a miss, or because the
            # service could only stage part of it in DRAM; asking again from where it
            # stopped tells the two apart (a miss answers 0).
            sl = self._batch(total, len(keys))
            n = self._get_batch(list(keys[sl]), staged.views[sl])
            total += n
            if n == 0:
                break
        staged.finish_get(total)
        return total

    def _get_batch(self, keys: list[bytes], views: list[memoryview]) -> int:
        rpc = self.client._rpc

        def op(s: _Session) -> int:
            a = rpc("Acquire", pb.AcquireRequest(
                session_id=s.id, namespace_handle=self.handle, keys=keys))
            n = a.num_acquired
            try:
                if n:
                    s.channel.read(a.lease_id, a.slots, views[:n])
            finally:
                rel = rpc("Release", pb.ReleaseRequest(session_id=s.id, lease_ids=[a.lease_id]))
            if s.channel.name == "shm" and not rel.valid[0]:
                # The lease expired while we copied: the slots may have been reused.
                log.warning("ctxmem: lease %d expired during the copy; treating as a miss",
                            a.lease_id)
                return 0
            verify = self.client.verify_gets
            if verify is None:
                verify = s.channel.name != "shm"
            if verify:
                for i, (v, want) in enumerate(zip(views[:n], a.crc32c, strict=True)):
                    if crc32c(v) != want:
                        log.warning("ctxmem: block %d failed its CRC32C after transfer; miss", i)
                        return i
            return n

        try:
            return self._retrying(op)
        except Unavailable as exc:
            log.warning("ctxmem get degraded to a miss: %s", exc)
            return 0

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Ask the service to promote flash blocks of ``keys`` to DRAM ahead of need;
        returns how many were queued."""
        validate_keys(keys)

        def op(s: _Session) -> int:
            return int(self.client._rpc("Prefetch", pb.PrefetchRequest(
                session_id=s.id, namespace_handle=self.handle, keys=keys)).queued)

        return self._retrying(op)

    def delete(self, keys: Sequence[bytes]) -> int:
        validate_keys(keys)

        def op(s: _Session) -> int:
            return int(self.client._rpc("Delete", pb.DeleteRequest(
                session_id=s.id, namespace_handle=self.handle, keys=keys)).deleted)

        return self._retrying(op)

    def evict(self, keys: Sequence[bytes], tier: str = "dram") -> int:
        """Make ``keys`` durable on flash and drop their DRAM copies (admin and tests)."""
        validate_keys(keys)
        if tier != TIER_DRAM:
            raise InvalidArgument(f"tier must be 'dram', got {tier!r}")
        tier_pb = tier_to_pb(tier)

        def op(s: _Session) -> int:
            return int(self.client._rpc("Evict", pb.EvictRequest(
                session_id=s.id, namespace_handle=self.handle, keys=keys, tier=tier_pb)).evicted)

        return self._retrying(op)


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))


class AsyncClient:
    """Asyncio facade: every call runs the blocking client on the loop's default executor,
    so an engine's event loop never waits on the service."""

    def __init__(self, endpoint: str = "127.0.0.1:50051", **kwargs: Any) -> None:
        self.sync = Client(endpoint, **kwargs)

    async def health(self) -> pb.HealthResponse:
        return await _in_thread(self.sync.health)

    async def stats(self) -> dict[str, float]:
        return await _in_thread(self.sync.stats)

    async def open_namespace(self, layout: KVLayout, *, model_id: str, tenant: str = "default",
                             tags: Mapping[str, str] | None = None) -> AsyncNamespace:
        ns = await _in_thread(functools.partial(self.sync.open_namespace, layout,
                                                model_id=model_id, tenant=tenant, tags=tags))
        return AsyncNamespace(ns)

    async def close(self) -> None:
        await _in_thread(self.sync.close)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncNamespace:
    """Awaitable twin of :class:`Namespace`."""

    def __init__(self, ns: Namespace) -> None:
        self.sync = ns
        self.layout = ns.layout
        self.block_nbytes = ns.block_nbytes

    async def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        return await _in_thread(self.sync.lookup, keys)

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return await _in_thread(self.sync.exists, keys)

    async def put(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> PutResult:
        return await _in_thread(self.sync.put, keys, buffers)

    async def get(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> int:
        return await _in_thread(self.sync.get, keys, buffers)

    async def prefetch(self, keys: Sequence[bytes]) -> int:
        return await _in_thread(self.sync.prefetch, keys)

    async def delete(self, keys: Sequence[bytes]) -> int:
        return await _in_thread(self.sync.delete, keys)

    async def evict(self, keys: Sequence[bytes], tier: str = "dram") -> int:
        return await _in_thread(self.sync.evict, keys, tier)
