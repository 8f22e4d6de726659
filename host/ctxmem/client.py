"""The shim's client: an async core (:class:`AsyncClient`) and a sync facade (:class:`Client`).

One request = one batched RPC per phase, never one per block::

    put:  Allocate(keys) -> write bytes into the slots -> Commit(CRCs)
    get:  Acquire(keys)  -> read bytes out of the slots -> Release

Sessions are per tenant; a namespace belongs to one session. When the service restarts
(unknown session) or drops the connection, the client reconnects, reopens its namespaces
and retries the request once; a put's bytes are still in the caller's buffers, so nothing
is lost, and a get that cannot be completed is a miss, never wrong data.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import grpc

from ctxmem import _sync
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
from ctxmem_common.keys import validate_keys
from ctxmem_common.layout import KVLayout
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.proto import ctxmem_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")
TransportName = Literal["auto", "shm", "tcp", "rdma"]
_TIER_NAMES = {pb.TIER_DRAM: "dram", pb.TIER_FLASH: "flash", pb.TIER_UNSPECIFIED: ""}
_TRANSPORT_PB = {"shm": pb.TRANSPORT_SHM, "tcp": pb.TRANSPORT_TCP, "rdma": pb.TRANSPORT_RDMA}


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


def _rpc_error(exc: grpc.aio.AioRpcError, endpoint: str, method: str) -> CtxmemError:
    md = exc.trailing_metadata() or ()
    for key, value in md:
        if key == ERROR_METADATA_KEY:
            return error_for_code(str(value), exc.details() or method)
    if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return Unavailable(
            f"ctxmem service at {endpoint} is unavailable during {method}: {exc.details()}; "
            f"is `ctxmem serve` running there?")
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Unavailable(f"ctxmem {method} at {endpoint} timed out: {exc.details()}")
    return CtxmemError(f"ctxmem {method} failed: {exc.code().name}: {exc.details()}")


class _Session:
    def __init__(self, tenant: str, session_id: int, channel: DataChannel, instance: str) -> None:
        self.tenant = tenant
        self.id = session_id
        self.channel = channel
        self.instance = instance
        self.epoch = 0


class AsyncClient:
    """Asyncio client. Use inside an engine's own event loop; everything is awaitable."""

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
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.ContextMemoryStub | None = None
        self._sessions: dict[str, _Session] = {}
        self._session_locks: dict[str, asyncio.Lock] = {}
        self._health: pb.HealthResponse | None = None
        self.transport_in_use: str = ""

    # -- plumbing --------------------------------------------------------------------
    def _stub_(self) -> pb_grpc.ContextMemoryStub:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.endpoint, options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20),
            ])
            self._stub = pb_grpc.ContextMemoryStub(self._channel)
        return self._stub

    async def _rpc(self, method: str, request: Any) -> Any:
        fn = getattr(self._stub_(), method)
        try:
            return await fn(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error(exc, self.endpoint, method) from None

    async def health(self) -> pb.HealthResponse:
        self._health = await self._rpc("Health", pb.HealthRequest())
        return self._health

    async def stats(self) -> dict[str, float]:
        resp = await self._rpc("Stats", pb.StatsRequest())
        return dict(resp.values)

    def _choose_transport(self, health: pb.HealthResponse) -> str:
        offered = {name for name, v in _TRANSPORT_PB.items() if v in health.transports}
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

            host, _, port = health.data_endpoint.rpartition(":")
            if host in ("", "0.0.0.0", "::", "[::]"):
                host = self.endpoint.rpartition(":")[0].strip("[]") or "127.0.0.1"
            return TcpChannel(host, int(port), session_id, token, self.timeout_s)
        raise InvalidArgument(f"transport {name!r} is not available in this build of the shim")

    async def _session(self, tenant: str, fresh: bool = False) -> _Session:
        lock = self._session_locks.setdefault(tenant, asyncio.Lock())
        async with lock:
            s = self._sessions.get(tenant)
            if s is not None and not fresh:
                return s
            old_epoch = s.epoch if s is not None else 0
            if s is not None:
                s.channel.close()
            health = await self.health()
            name = self._choose_transport(health)
            resp = await self._rpc("Connect", pb.ConnectRequest(
                client_name=self.client_name, transport=_TRANSPORT_PB[name], tenant=tenant,
                tenant_token=self.tenant_token))
            loop = asyncio.get_running_loop()
            channel = await loop.run_in_executor(
                None, self._open_channel, name, health, resp.session_id, resp.session_token)
            s = _Session(tenant, resp.session_id, channel, resp.instance_id)
            s.epoch = old_epoch + 1
            self._sessions[tenant] = s
            self.transport_in_use = name
            return s

    async def open_namespace(
        self,
        layout: KVLayout,
        *,
        model_id: str,
        tenant: str = "default",
        tags: Mapping[str, str] | None = None,
    ) -> AsyncNamespace:
        ns = AsyncNamespace(self, layout, model_id, tenant, dict(tags or {}))
        await ns._open()
        return ns

    async def close(self) -> None:
        for s in self._sessions.values():
            s.channel.close()
        self._sessions.clear()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncNamespace:
    """Blocks of one (tenant, model, layout, tags). Created by :meth:`AsyncClient.open_namespace`."""

    def __init__(self, client: AsyncClient, layout: KVLayout, model_id: str, tenant: str,
                 tags: dict[str, str]) -> None:
        self.client = client
        self.layout = layout
        self.model_id = model_id
        self.tenant = tenant
        self.tags = tags
        self.block_nbytes = layout.block_nbytes
        self.handle = 0
        self.digest = b""
        self._epoch = -1
        self._session: _Session | None = None

    async def _open(self, fresh: bool = False) -> _Session:
        s = await self.client._session(self.tenant, fresh=fresh)
        if self._epoch == s.epoch and self._session is s:
            return s
        lay = self.layout
        resp = await self.client._rpc("OpenNamespace", pb.OpenNamespaceRequest(
            session_id=s.id, model_id=self.model_id, tags=self.tags,
            layout=pb.Layout(
                dtype=lay.dtype, num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads,
                head_dim=lay.head_dim, tokens_per_block=lay.tokens_per_block,
                kv_lora_rank=lay.kv_lora_rank or 0, qk_rope_head_dim=lay.qk_rope_head_dim or 0,
                tp_rank=lay.tp_rank, tp_size=lay.tp_size)))
        if resp.block_nbytes != self.block_nbytes:
            raise CtxmemError(f"service computes {resp.block_nbytes} bytes per block for this "
                              f"layout, the shim {self.block_nbytes}: version mismatch")
        self.handle = resp.namespace_handle
        self.digest = resp.namespace_digest
        self._session = s
        self._epoch = s.epoch
        return s

    async def _retrying(self, op: Callable[[_Session], Awaitable[T]]) -> T:
        """Run ``op``; after a service restart or dropped connection, reconnect and retry
        once."""
        s = await self._open()
        try:
            return await op(s)
        except (UnknownSession, Unavailable) as exc:
            log.info("ctxmem: %s; reconnecting and retrying once", exc)
            s = await self._open(fresh=self._session is s)
            return await op(s)

    def _batches(self, n: int) -> list[slice]:
        per = max(1, self.client.max_batch_bytes // max(1, self.block_nbytes))
        return [slice(i, min(i + per, n)) for i in range(0, n, per)]

    # -- API -------------------------------------------------------------------------
    async def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        validate_keys(keys)

        async def op(s: _Session) -> LookupResult:
            r = await self.client._rpc("Lookup", pb.LookupRequest(
                session_id=s.id, namespace_handle=self.handle, keys=keys, prefix=True))
            return LookupResult(r.num_hits, [_TIER_NAMES[t] for t in r.tiers])

        return await self._retrying(op)

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Per-key presence (not prefix-based)."""
        validate_keys(keys)

        async def op(s: _Session) -> list[bool]:
            r = await self.client._rpc("Lookup", pb.LookupRequest(
                session_id=s.id, namespace_handle=self.handle, keys=keys, prefix=False))
            return [t != pb.TIER_UNSPECIFIED for t in r.tiers]

        return await self._retrying(op)

    async def put(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> PutResult:
        """Store one buffer per key (each exactly ``block_nbytes``)."""
        validate_keys(keys)
        if len(keys) != len(buffers):
            raise InvalidArgument(f"put got {len(keys)} keys and {len(buffers)} buffers; "
                                  f"pass one buffer per key")
        staged = Staged(list(buffers), self.block_nbytes, writable=False)
        stored = existing = 0
        for sl in self._batches(len(keys)):
            st, ex = await self._put_batch(list(keys[sl]), staged.views[sl])
            stored += st
            existing += ex
        return PutResult(stored, existing)

    async def _put_batch(self, keys: list[bytes], views: list[memoryview]) -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        crcs: list[int] = []
        if self.client.verify_puts:
            crcs = await loop.run_in_executor(None, lambda: [crc32c(v) for v in views])

        async def op(s: _Session) -> tuple[int, int]:
            a = await self.client._rpc("Allocate", pb.AllocateRequest(
                session_id=s.id, namespace_handle=self.handle, keys=keys))
            new = [i for i, e in enumerate(a.exists) if not e]
            if not new:
                await self.client._rpc("Commit", pb.CommitRequest(
                    session_id=s.id, allocation_id=a.allocation_id, abort=True))
                return 0, len(keys)
            try:
                await loop.run_in_executor(None, s.channel.write, a.allocation_id, a.slots,
                                           [views[i] for i in new])
            except TransportError:
                try:
                    await self.client._rpc("Commit", pb.CommitRequest(
                        session_id=s.id, allocation_id=a.allocation_id, abort=True))
                except CtxmemError:
                    pass
                raise
            c = await self.client._rpc("Commit", pb.CommitRequest(
                session_id=s.id, allocation_id=a.allocation_id,
                crc32c=[crcs[i] for i in new] if crcs else []))
            return c.committed, len(keys) - len(new)

        return await self._retrying(op)

    async def get(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> int:
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
            sl = self._batches(len(keys) - total)[0]
            sl = slice(total + sl.start, total + sl.stop)
            n = await self._get_batch(list(keys[sl]), staged.views[sl])
            total += n
            if n == 0:
                break
        staged.finish_get(total)
        return total

    async def _get_batch(self, keys: list[bytes], views: list[memoryview]) -> int:
        loop = asyncio.get_running_loop()

        async def op(s: _Session) -> int:
            a = await self.client._rpc("Acquire", pb.AcquireRequest(
                session_id=s.id, namespace_handle=self.handle, keys=keys))
            n = a.num_acquired
            try:
                if n:
                    await loop.run_in_executor(None, s.channel.read, a.lease_id, a.slots,
                                               views[:n])
            finally:
                rel = await self.client._rpc("Release", pb.ReleaseRequest(
                    session_id=s.id, lease_ids=[a.lease_id]))
            if s.channel.name == "shm" and not rel.valid[0]:
                # The lease expired while we copied: the slots may have been reused.
                log.warning("ctxmem: lease %d expired during the copy; treating as a miss",
                            a.lease_id)
                return 0
            verify = self.client.verify_gets
            if verify is None:
                verify = s.channel.name != "shm"
            if verify and n:
                got = await loop.run_in_executor(None, lambda: [crc32c(v) for v in views[:n]])
                for i, (c, want) in enumerate(zip(got, a.crc32c, strict=False)):
                    if c != want:
                        log.warning("ctxmem: block %d failed its CRC32C after transfer; miss", i)
                        return i
            return n

        try:
            return await self._retrying(op)
        except Unavailable as exc:
            log.warning("ctxmem get degraded to a miss: %s", exc)
            return 0

    async def prefetch(self, keys: Sequence[bytes]) -> int:
        """Ask the service to promote flash blocks of ``keys`` to DRAM ahead of need."""
        validate_keys(keys)

        async def op(s: _Session) -> int:
            r = await self.client._rpc("Prefetch", pb.PrefetchRequest(
                session_id=s.id, namespace_handle=self.handle, keys=keys))
            return int(r.queued)

        return await self._retrying(op)

    async def delete(self, keys: Sequence[bytes]) -> int:
        validate_keys(keys)

        async def op(s: _Session) -> int:
            r = await self.client._rpc("Delete", pb.DeleteRequest(
                session_id=s.id, namespace_handle=self.handle, keys=keys))
            return int(r.deleted)

        return await self._retrying(op)

    async def evict(self, keys: Sequence[bytes], tier: str = "dram") -> int:
        """Make ``keys`` durable on flash and drop their DRAM copies (admin and tests)."""
        validate_keys(keys)
        tier_pb = {"dram": pb.TIER_DRAM, "flash": pb.TIER_FLASH}.get(tier)
        if tier_pb is None:
            raise InvalidArgument(f"tier must be 'dram', got {tier!r}")

        async def op(s: _Session) -> int:
            r = await self.client._rpc("Evict", pb.EvictRequest(
                session_id=s.id, namespace_handle=self.handle, keys=keys, tier=tier_pb))
            return int(r.evicted)

        return await self._retrying(op)


class Client:
    """Blocking client, safe to use from any thread and after ``fork()``.

    Calls run on a private event loop thread (:mod:`ctxmem._sync`) and wait at most
    ``timeout_s``. In a forked child the loop is rebuilt and sessions are reopened on
    first use.
    """

    def __init__(self, endpoint: str = "127.0.0.1:50051", **kwargs: Any) -> None:
        self.endpoint = endpoint
        self._kwargs = kwargs
        self.timeout_s = float(kwargs.get("timeout_s", 30.0))
        self._gen = -1
        self._async: AsyncClient | None = None

    @property
    def aclient(self) -> AsyncClient:
        gen = _sync.loop_generation()
        if self._async is None or gen != self._gen:
            self._async = AsyncClient(self.endpoint, **self._kwargs)
            self._gen = gen
        return self._async

    def _run(self, coro_fn: Callable[[], Awaitable[T]]) -> T:
        async def wrapper() -> T:
            return await coro_fn()

        # Slack over the RPC timeout: a call is several RPCs plus the data transfer.
        return _sync.run(wrapper(), timeout=self.timeout_s * 4)

    def health(self) -> pb.HealthResponse:
        return self._run(lambda: self.aclient.health())

    def stats(self) -> dict[str, float]:
        return self._run(lambda: self.aclient.stats())

    @property
    def transport_in_use(self) -> str:
        return self.aclient.transport_in_use

    def open_namespace(self, layout: KVLayout, *, model_id: str, tenant: str = "default",
                       tags: Mapping[str, str] | None = None) -> Namespace:
        ns = Namespace(self, layout, model_id, tenant, dict(tags or {}))
        ns._ns()
        return ns

    def close(self) -> None:
        if self._async is not None and self._gen == _sync.loop_generation():
            a = self._async
            self._run(lambda: a.close())
        self._async = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Namespace:
    """Sync handle on a namespace; see :class:`AsyncNamespace` for the semantics."""

    def __init__(self, client: Client, layout: KVLayout, model_id: str, tenant: str,
                 tags: dict[str, str]) -> None:
        self.client = client
        self.layout = layout
        self.model_id = model_id
        self.tenant = tenant
        self.tags = tags
        self.block_nbytes = layout.block_nbytes
        self._async: AsyncNamespace | None = None
        self._owner: AsyncClient | None = None

    def _ns(self) -> AsyncNamespace:
        ac = self.client.aclient
        if self._async is None or self._owner is not ac:
            self._async = AsyncNamespace(ac, self.layout, self.model_id, self.tenant, self.tags)
            self._owner = ac
            ns = self._async
            self.client._run(lambda: ns._open())
        return self._async

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        ns = self._ns()
        return self.client._run(lambda: ns.lookup(keys))

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        ns = self._ns()
        return self.client._run(lambda: ns.exists(keys))

    def put(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> PutResult:
        ns = self._ns()
        return self.client._run(lambda: ns.put(keys, buffers))

    def get(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> int:
        ns = self._ns()
        return self.client._run(lambda: ns.get(keys, buffers))

    def prefetch(self, keys: Sequence[bytes]) -> int:
        ns = self._ns()
        return self.client._run(lambda: ns.prefetch(keys))

    def delete(self, keys: Sequence[bytes]) -> int:
        ns = self._ns()
        return self.client._run(lambda: ns.delete(keys))

    def evict(self, keys: Sequence[bytes], tier: str = "dram") -> int:
        ns = self._ns()
        return self.client._run(lambda: ns.evict(keys, tier))
