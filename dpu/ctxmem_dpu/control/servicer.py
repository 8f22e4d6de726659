"""The ``ctxmem.v1.ContextMemory`` servicer: protobuf in, BlockStore calls, protobuf out.

Only this layer knows about gRPC. Domain errors (:class:`CtxmemError`) become a status
code plus the ``ctxmem-error`` trailing metadata, so the shim re-raises the same class.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from ctxmem_common import __version__
from ctxmem_common.errors import (
    ERROR_METADATA_KEY,
    CtxmemError,
    ErrorCode,
    Expired,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from ctxmem_common.identity import tenant_scope
from ctxmem_common.packed_slots import pack_acquire
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.proto import ctxmem_pb2_grpc as pb_grpc
from ctxmem_common.protoconv import (
    TIER_DRAM,
    TIER_FLASH,
    TIER_NONE,
    TIER_REMOTE,
    layout_from_pb,
    tier_from_pb,
    tier_to_pb,
    transport_from_pb,
    transport_to_pb,
)
from ctxmem_common.rdma_wire import QpInfo
from ctxmem_dpu import faults
from ctxmem_dpu.blocks import Session
from ctxmem_dpu.control import block_ops
from ctxmem_dpu.control.auth import connect_tenant, peer_cert
from ctxmem_dpu.control.localpeer import LocalUsers
from ctxmem_dpu.control.locate import locate
from ctxmem_dpu.control.lookup_wire import key_list, lookup_response, request_keys
from ctxmem_dpu.store import BlockStore

if TYPE_CHECKING:
    from ctxmem_dpu.pod.node import PodNode
    from ctxmem_dpu.transport.rdma import RdmaServer

log = logging.getLogger(__name__)

_STATUS = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNKNOWN_NAMESPACE: grpc.StatusCode.NOT_FOUND,
    # Unknown session and wrong session token look the same (control/auth.py).
    ErrorCode.UNKNOWN_SESSION: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.EXPIRED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.SHED: grpc.StatusCode.RESOURCE_EXHAUSTED,
}

Req = TypeVar("Req")
Resp = TypeVar("Resp")


async def _abort(context: grpc.aio.ServicerContext, name: str, exc: Exception) -> None:
    """End the call with ``exc`` as a status code plus the ``ctxmem-error`` metadata.

    gRPC's ``AbortError`` and the call's state refer to each other, and the error's
    traceback holds the frames it passed: whatever those frames hold lives until the
    next full garbage collection. So ``exc``'s own traceback (the handler's frame, with
    the request in it) is dropped once logged, and the wrappers delete their ``request``
    before the abort passes through them: a failed call no longer keeps its request (up
    to 64 MiB) alive (``ctxmem fuzz`` saw the heap swing by +40-60% from this)."""
    if isinstance(exc, grpc.aio.AbortError):  # already aborted
        raise exc
    if isinstance(exc, CtxmemError):
        code, message = exc.code, exc.message
    else:
        log.exception("%s failed", name)
        code, message = ErrorCode.INTERNAL, f"{name}: internal error: {exc}"
    exc.__traceback__ = None
    context.set_trailing_metadata(((ERROR_METADATA_KEY, code.value),))
    await context.abort(_STATUS[code], message)


def _rpc(
    fn: Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]:
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        try:
            return await fn(self, request, context)
        except Exception as exc:
            del request  # not kept alive by the abort's reference cycle (see _abort)
            await _abort(context, fn.__name__, exc)
            raise  # pragma: no cover - abort raises

    return wrapper


def _stream_rpc(
    fn: Callable[[Any, Req, grpc.aio.ServicerContext], AsyncGenerator[Resp, None]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext], AsyncIterator[Resp]]:
    """:func:`_rpc` for server-streaming calls. The handler is closed (its ``finally``
    blocks run) as soon as the call ends, however it ends."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[Resp]:
        try:
            async with contextlib.aclosing(fn(self, request, context)) as responses:
                async for response in responses:
                    yield response
        except Exception as exc:
            del request  # see _abort
            await _abort(context, fn.__name__, exc)
            raise  # pragma: no cover - abort raises

    return wrapper


# Hold calls one session may have open at once: the shim keeps one (two for a moment
# when it opens a new one after its connection dropped); each costs the service a task.
MAX_HOLDS_PER_SESSION = 4


def _caller_gave_up(context: Any) -> bool:
    """Whether the call's deadline has passed: its caller no longer waits for the answer
    (``time_remaining`` is 0 then; None without a deadline)."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


# Every handler takes ``list(request.keys)`` once: the protobuf container builds a new
# bytes object on each access, so validating, hashing and looking keys up straight from it
# would convert all 10,000 keys several times (measured: ~30% of a 10k-key Lookup).


class ContextMemoryServicer(pb_grpc.ContextMemoryServicer):
    def __init__(self, store: BlockStore, instance_id: str, shm_socket: str,
                 data_endpoint: str, health: Callable[[], str]) -> None:
        self.store = store
        self.instance_id = instance_id
        self.shm_socket = shm_socket
        self.data_endpoint = data_endpoint
        self.health = health
        self.rdma: RdmaServer | None = None  # set by the app when 'rdma' is enabled
        self.pod: PodNode | None = None  # set by the app when 'pod.enabled'
        # Insecure mode: who a loopback caller is (set by the app once gRPC has bound).
        self.local_users: LocalUsers | None = None
        # Session id -> an event per open Hold call, set when the session ends.
        self._holds: dict[bytes, set[asyncio.Event]] = {}
        self._closing = False  # the service is stopping: a new Hold ends at once
        store.on_session_end.append(self._end_holds)

    def _end_holds(self, s: Session) -> None:
        for ended in self._holds.pop(s.id, ()):
            ended.set()

    def close_holds(self) -> None:
        """End every Hold call (the service is stopping): gRPC's graceful stop would
        otherwise wait its whole grace for these calls, which never end by themselves."""
        self._closing = True
        for events in self._holds.values():
            for ended in events:
                ended.set()
        self._holds.clear()

    async def _grant_rdma(self, s: Any, grant_id: bytes, refs: Sequence[Any],
                          slots: Sequence[pb.Slot], write: bool) -> None:
        """RDMA sessions: the address and rkey of each slot, valid for this grant only."""
        if s.transport != "rdma" or self.rdma is None or not slots:
            return
        keys = await self.rdma.grant(s, grant_id, refs, [x.length for x in slots], write)
        for slot, (addr, rkey) in zip(slots, keys, strict=True):
            slot.remote_addr, slot.rkey = addr, rkey

    @_rpc
    async def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthResponse:
        cfg = self.store.cfg
        return pb.HealthResponse(
            status=self.health(), instance_id=self.instance_id, version=__version__,
            transports=[transport_to_pb(t) for t in cfg.service.transports],
            shm_socket=self.shm_socket, data_endpoint=self.data_endpoint, mode=cfg.mode,
            # The fast path answers from this node's index only: not in a pod.
            shm_ops=bool(self.shm_socket) and cfg.service.shm_op_max_bytes > 0
            and self.pod is None,
            tcp_ops=bool(self.data_endpoint) and cfg.service.shm_op_max_bytes > 0
            and self.pod is None,
        )

    @_rpc
    async def Connect(self, request: pb.ConnectRequest, context: Any) -> pb.ConnectResponse:
        transport = transport_from_pb(request.transport)
        if transport is None:
            raise InvalidArgument("Connect.transport must be SHM, TCP or RDMA")
        tenant = connect_tenant(self.store.cfg, request, context, self.local_users)
        # A caller that gave up (its deadline passed while the call waited, e.g. on a busy
        # service) gets no session: nobody would use or end it, and it would count against
        # the tenant's cap until it idled out (issue 26). Nothing in between yields to the
        # event loop, so past the second check the answer goes out at once.
        faults.point("connect.before_session")
        if _caller_gave_up(context):
            self.store.counters["connects_abandoned"] += 1
            raise Expired(f"Connect for tenant {tenant!r}: the caller's deadline passed "
                          f"before the session was made; no session was made")
        s = self.store.connect(tenant, request.tenant_token, transport, request.client_name,
                               hold=request.hold)
        faults.point("connect.after_session")
        if _caller_gave_up(context):
            self.store.close_session(s)
            self.store.counters["connects_abandoned"] += 1
            raise Expired(f"Connect for tenant {tenant!r}: the caller's deadline passed "
                          f"while the session was made; it was ended at once")
        if self.store.cfg.tls.mutual:  # ends if a rotated client CA no longer trusts it
            s.peer_cert = peer_cert(context) or b""
        cfg = self.store.cfg.service
        return pb.ConnectResponse(
            session_id=s.id, session_token=s.token, instance_id=self.instance_id,
            lease_ttl_ms=int(cfg.lease_ttl_s * 1000),
            allocation_ttl_ms=int(cfg.allocation_ttl_s * 1000), tenant=s.tenant,
        )

    @_rpc
    async def OpenNamespace(self, request: pb.OpenNamespaceRequest, context: Any
                            ) -> pb.OpenNamespaceResponse:
        s = self.store.session(request.session_id)
        layout = layout_from_pb(request.layout)
        handle, ns = self.store.open_namespace(s, request.model_id, layout, dict(request.tags),
                                               request.weights_revision)
        return pb.OpenNamespaceResponse(namespace_handle=handle, namespace_digest=ns.digest,
                                        block_nbytes=ns.block_nbytes)

    @_rpc
    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        s, ns = block_ops.open_namespace(self.store, request.session_id,
                                         request.namespace_handle)
        keys, checked = request_keys(request)  # bounded and, when packed, validated
        if request.group_namespace_handles:
            return await self._group_lookup(s, ns, key_list(keys), request, checked)
        if self.pod is not None:  # the local index first, the cluster for the rest
            return await self._pod_lookup(ns, key_list(keys), request.prefix,
                                           request.want_tier_codes)
        n, codes = block_ops.lookup(self.store, ns, keys, request.prefix, checked)
        return lookup_response(n, codes, request.want_tier_codes)

    @_rpc
    async def Locate(self, request: pb.LookupRequest, context: Any) -> pb.LocateResponse:
        return await locate(self.store, self.pod, request)

    async def _group_lookup(self, s: Any, ns: Any, keys: list[bytes],
                            request: pb.LookupRequest, checked: bool) -> pb.LookupResponse:
        """A block group's Lookup: each member's tiers (this node's index, in a pod the
        cluster's for the rest), a key held only where every member holds it."""
        members = block_ops.group_members(self.store, s, ns, request.group_namespace_handles)
        self.store.declare_group(members)
        per: list[list[str]] = []
        for m in members:
            if self.pod is not None:
                per.append(await self._pod_names(m, keys))
            else:
                found = self.store.lookup_blocks(m, keys, False, checked=checked)
                checked = True
                per.append([TIER_NONE if b is None else TIER_DRAM if b.dram is not None
                            else TIER_FLASH for b in found])
        n, names = block_ops.group_tiers(per, request.prefix)
        return lookup_response(n, [tier_to_pb(t) for t in names], request.want_tier_codes)

    async def _pod_names(self, ns: Any, keys: list[bytes]) -> list[str]:
        """Per key, its tier on this node, else remote where another node holds it."""
        assert self.pod is not None
        local, remote = await self.pod.fetch.merged(ns, keys)
        return [TIER_NONE if b is None and e is None else TIER_REMOTE if b is None
                else TIER_DRAM if b.dram is not None else TIER_FLASH
                for b, e in zip(local, remote, strict=True)]

    async def _pod_lookup(self, ns: Any, keys: list[bytes], prefix: bool, packed: bool
                          ) -> pb.LookupResponse:
        names = await self._pod_names(ns, keys)
        if prefix:
            n = names.index(TIER_NONE) if TIER_NONE in names else len(names)
            names = names[:n]
        else:
            n = len(names) - names.count(TIER_NONE)
        return lookup_response(n, [tier_to_pb(t) for t in names], packed)

    @_rpc
    async def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        s, ns = block_ops.open_namespace(self.store, request.session_id,
                                         request.namespace_handle)
        a, exists, (regions, gens, offsets, lengths, _) = await block_ops.allocate(
            self.store, s, ns, list(request.keys))
        slots = [pb.Slot(region=r, generation=g, offset=o, length=n)
                 for r, g, o, n in zip(regions, gens, offsets, lengths, strict=True)]
        try:
            await self._grant_rdma(s, a.id, a.slots, slots, write=True)
        except BaseException:
            with contextlib.suppress(CtxmemError):  # frees the slots, unless already gone
                await self.store.commit(s, a.id, [], abort=True)
            raise
        return pb.AllocateResponse(
            allocation_id=a.id, exists=exists, slots=slots,
            expires_in_ms=int(self.store.cfg.service.allocation_ttl_s * 1000),
        )

    @_rpc
    async def Commit(self, request: pb.CommitRequest, context: Any) -> pb.CommitResponse:
        if request.group_allocation_ids and request.abort:
            s = self.store.session(request.session_id)
            for aid in [request.allocation_id, *request.group_allocation_ids]:
                with contextlib.suppress(Expired):  # already gone: nothing to give back
                    await self.store.commit(s, aid, [], abort=True)
            return pb.CommitResponse(committed=0)
        if request.group_allocation_ids:
            n = await block_ops.commit_group(self.store, request.session_id,
                                             request.allocation_id, request.crc32c,
                                             request.group_allocation_ids,
                                             request.group_crc32c)
            return pb.CommitResponse(committed=n)
        n = await block_ops.commit(self.store, request.session_id, request.allocation_id,
                                   request.crc32c, request.abort)
        return pb.CommitResponse(committed=n)

    @_rpc
    async def Acquire(self, request: pb.AcquireRequest, context: Any) -> pb.AcquireResponse:
        s, ns = block_ops.open_namespace(self.store, request.session_id,
                                         request.namespace_handle)
        if request.group_namespace_handles:
            return await self._group_acquire(s, ns, request)
        if self.pod is not None:  # remote blocks of the run into local DRAM first
            await self.pod.fetch.pull(ns, list(request.keys))
        lease, sources = await block_ops.acquire(self.store, s, ns, list(request.keys))
        resp = pb.AcquireResponse(
            lease_id=lease.id, num_acquired=len(lease.blocks), source_tiers=sources,
            expires_in_ms=int(self.store.cfg.service.lease_ttl_s * 1000),
        )
        regions, gens, offsets, lengths, crcs = block_ops.lease_slots(self.store, lease)
        if request.want_packed and s.transport == "shm":
            # one array per field instead of a Slot message per block (packed_slots)
            pack_acquire(resp, regions, gens, offsets, lengths, crcs)
            return resp
        refs = [b.dram for b in lease.blocks]
        slots = [pb.Slot(region=r, generation=g, offset=o, length=n)
                 for r, g, o, n in zip(regions.tolist(), gens.tolist(), offsets.tolist(),
                                       lengths.tolist(), strict=True)]
        try:
            await self._grant_rdma(s, lease.id, refs, slots, write=False)
        except BaseException:
            self.store.release(s, [lease.id])
            raise
        resp.slots.extend(slots)
        resp.crc32c.extend(crcs.tolist())
        return resp

    async def _group_acquire(self, s: Any, ns: Any, request: pb.AcquireRequest
                             ) -> pb.AcquireResponse:
        """A block group's Acquire: one lease per member over the leading run every
        member holds and verifies (``BlockStore.acquire_group``); in a pod each member's
        remote blocks are pulled first (a member whose holder is gone is a miss, so its
        keys are misses for the whole group)."""
        members = block_ops.group_members(self.store, s, ns, request.group_namespace_handles)
        keys = list(request.keys)
        recheck = None
        if self.pod is not None:  # (recheck: copies adopted between members are dropped)
            recheck = await self.pod.fetch.pull_group(members, keys)
        leases, tiers = await self.store.acquire_group(s, members, keys, recheck)
        resp = pb.AcquireResponse(
            lease_id=leases[0].id, num_acquired=len(leases[0].blocks),
            source_tiers=[tier_to_pb(t) for t in tiers],
            expires_in_ms=int(self.store.cfg.service.lease_ttl_s * 1000))
        try:
            for i, lease in enumerate(leases):
                regions, gens, offsets, lengths, crcs = block_ops.lease_slots(self.store,
                                                                              lease)
                slots = [pb.Slot(region=r, generation=g, offset=o, length=n)
                         for r, g, o, n in zip(regions.tolist(), gens.tolist(),
                                               offsets.tolist(), lengths.tolist(),
                                               strict=True)]
                await self._grant_rdma(s, lease.id, [b.dram for b in lease.blocks], slots,
                                       write=False)
                if i == 0:
                    resp.slots.extend(slots)
                    resp.crc32c.extend(crcs.tolist())
                else:
                    resp.members.add(lease_id=lease.id, slots=slots, crc32c=crcs.tolist())
        except BaseException:
            self.store.release(s, [lease.id for lease in leases])
            raise
        return resp

    @_rpc
    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        s = self.store.session(request.session_id)
        return pb.ReleaseResponse(valid=self.store.release(s, request.lease_ids))

    @_rpc
    async def Prefetch(self, request: pb.PrefetchRequest, context: Any) -> pb.PrefetchResponse:
        s = self.store.session(request.session_id)
        ns = self.store.namespace(s, request.namespace_handle)
        queued, in_dram = await self.store.prefetch(ns, list(request.keys))
        if self.pod is not None:  # remote blocks ahead of need, in the background
            self.pod.prefetch(ns, list(request.keys))
        return pb.PrefetchResponse(queued=queued, in_dram=in_dram)

    @_rpc
    async def Delete(self, request: pb.DeleteRequest, context: Any) -> pb.DeleteResponse:
        s = self.store.session(request.session_id)
        ns = self.store.namespace(s, request.namespace_handle)
        keys = list(request.keys)
        deleted = await self.store.delete(ns, keys)
        if self.pod is not None:  # this node's index entries gone before the answer
            await self.pod.confirm_delete(ns.digest, keys)
        return pb.DeleteResponse(deleted=deleted)

    @_rpc
    async def Evict(self, request: pb.EvictRequest, context: Any) -> pb.EvictResponse:
        s = self.store.session(request.session_id)
        ns = self.store.namespace(s, request.namespace_handle)
        tier = tier_from_pb(request.tier)
        return pb.EvictResponse(evicted=await self.store.evict(ns, list(request.keys), tier))

    @_rpc
    async def Disconnect(self, request: pb.DisconnectRequest, context: Any
                         ) -> pb.DisconnectResponse:
        """End the session (Client.close). The interceptor checked its token; a session
        already ended is refused there as unknown, which the shim takes as done."""
        self.store.disconnect(self.store.session(request.session_id))
        return pb.DisconnectResponse()

    @_stream_rpc
    async def Hold(self, request: pb.HoldRequest, context: Any
                   ) -> AsyncGenerator[pb.HoldEvent, None]:
        """Open while the session lives: the client's liveness. When the call ends because
        the client went away (cancelled: process killed, connection dropped), the session
        is orphaned and the reaper ends it ``service.session_orphan_s`` later unless
        another Hold opens; when the session ends first, the call ends OK."""
        s = self.store.session(request.session_id)
        if len(self._holds.get(s.id, ())) >= MAX_HOLDS_PER_SESSION:
            raise ResourceExhausted(
                f"Hold for session {s.id.hex()}: {MAX_HOLDS_PER_SESSION} Hold calls are open "
                f"already; a client keeps one per session")
        ended = asyncio.Event()
        self._holds.setdefault(s.id, set()).add(ended)
        self.store.hold_opened(s)
        done = False

        def end(_ctx: object = None) -> None:
            nonlocal done
            if not done:  # once per call, however it ends
                done = True
                self.store.hold_ended(s)
                events = self._holds.get(s.id)
                if events is not None:
                    events.discard(ended)
                    if not events:
                        del self._holds[s.id]

        # A call abandoned without a clean cancel still ends its context.
        context.add_done_callback(end)
        try:
            orphan_ms = int(self.store.cfg.service.session_orphan_s * 1000)
            yield pb.HoldEvent(orphan_ms=orphan_ms)
            if not self._closing:
                await ended.wait()
        finally:
            end()

    @_rpc
    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        """Every counter and gauge. Stats needs no session, so beyond one trust domain
        (tenant tokens or mTLS) the per-tenant entries (``tenant.NAME.*``) are left out:
        a tenant must not learn which other tenants exist or what they hold. The operator
        reads them on the loopback metrics endpoint."""
        values = self.store.stats()
        if not self.store.cfg.service.insecure:
            values = {k: v for k, v in values.items() if not k.startswith("tenant.")}
        elif self.local_users is not None and self.local_users.policy != "shared":
            values = self._own_user_stats(values, context)
        return pb.StatsResponse(values=values)

    def _own_user_stats(self, values: dict[str, float], context: Any) -> dict[str, float]:
        """Insecure mode with local users told apart: another local user sees only its
        own tenants' entries (the service's own user, the operator, sees all)."""
        lu = self.local_users
        assert lu is not None
        try:
            uid = lu.uid_of(context.peer())
        except OSError:
            uid = -1  # unknown: no tenant's entries
        if uid == lu.own_uid:
            return values
        mine = f"uid{uid}"
        return {k: v for k, v in values.items() if not k.startswith("tenant.")
                or tenant_scope(k[len("tenant."):].rpartition(".")[0]) == mine}

    # -- RDMA connection exchange ----------------------------------------------------
    def _rdma(self, call: str, session_id: bytes) -> RdmaServer:
        if self.rdma is None:
            raise Unavailable(
                f"{call} for session {session_id.hex()}: this service has no RDMA transport "
                f"(service.transports is {self.store.cfg.service.transports}); use transport "
                f"'tcp' or 'shm', or add 'rdma' to service.transports and restart it")
        return self.rdma

    @_rpc
    async def RdmaInfo(self, request: pb.RdmaInfoRequest, context: Any) -> pb.RdmaInfoResponse:
        dev = self._rdma("RdmaInfo", request.session_id).info(request.session_id,
                                                              request.session_token)
        return pb.RdmaInfoResponse(gid=dev.gid, lid=dev.lid, mtu=dev.mtu,
                                   rd_atomic=dev.responder_depth)

    @_stream_rpc
    async def RdmaAttach(self, request: pb.RdmaAttachRequest, context: Any
                         ) -> AsyncGenerator[pb.RdmaAttachResponse, None]:
        """One response (the service's QP), then open until the connection ends: the
        client ending the call drops the session's endpoint, and the endpoint closing
        (service shutdown, a broken QP) ends the call."""
        rdma = self._rdma("RdmaAttach", request.session_id)
        ep = rdma.open_endpoint(request.session_id, request.session_token,
                                QpInfo.from_pb(request.qp))
        # A stream the client abandons without a clean cancel still ends its context.
        context.add_done_callback(lambda _ctx: rdma.drop_endpoint(ep))
        try:
            yield pb.RdmaAttachResponse(qp=ep.info().to_pb())
            await ep.ended.wait()  # close(), or the endpoint broke (a failed bind)
        finally:
            rdma.drop_endpoint(ep)
