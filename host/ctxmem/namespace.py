"""A namespace of the shim's client: the blocks of one (tenant, model, layout, tags).

:class:`Namespace` holds the batched block operations (lookup, put, get, prefetch, delete,
evict); :class:`~ctxmem.client.Client` owns the connection and the per-tenant sessions
they run in. After a service restart or a dropped connection an operation reconnects,
reopens the namespace and retries once (``_retrying``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from ctxmem.buffers import DeferredStaged
from ctxmem.transport.base import DataChannel, FastPathUnsupported, Grant, TransportError
from ctxmem.transport.verified import ReadProgress
from ctxmem_common.errors import (
    CtxmemError,
    InvalidArgument,
    Shed,
    Unavailable,
    UnknownSession,
)
from ctxmem_common.keys import namespace_digest, pack_keys, validate_keys
from ctxmem_common.layout import KVLayout
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.protoconv import (
    TIER_DRAM,
    layout_to_pb,
    tier_from_pb,
    tier_to_pb,
    tiers_from_codes,
)
from ctxmem_common.shm_ops import (
    decode_acquire_reply,
    decode_allocate_reply,
    decode_commit_reply,
    decode_lookup_reply,
    decode_release_reply,
    encode_commit,
    encode_keys_request,
    encode_release,
)
from ctxmem_common.wire import (
    SHM_OP_ACQUIRE,
    SHM_OP_ALLOCATE,
    SHM_OP_COMMIT,
    SHM_OP_LOOKUP,
    SHM_OP_RELEASE,
)

if TYPE_CHECKING:
    from ctxmem.client import Client, _Session

__all__ = ["LookupResult", "Namespace", "PutResult"]

log = logging.getLogger(__name__)
T = TypeVar("T")

@dataclass(frozen=True)
class LookupResult:
    num_hits: int
    """How many leading keys are stored."""
    tiers: list[str] = field(default_factory=list)
    """Per hit, where it is: ``"dram"`` or ``"flash"``."""


@dataclass(frozen=True)
class LocateResult:
    num_hits: int
    """How many leading keys are held by this node or another member of its pod."""
    tiers: list[str] = field(default_factory=list)
    """Per hit, its tier on the node that holds it: ``"dram"`` or ``"flash"``."""
    nodes: list[str] = field(default_factory=list)
    """Per hit, the holding node's ``pod.node_id`` (``""`` on a service without a pod)."""
    node_id: str = ""
    """The node that answered."""


@dataclass(frozen=True)
class PutResult:
    stored: int
    """Blocks newly committed by this call."""
    existing: int
    """Blocks already stored (nothing was written for them)."""


def _lookup_request(session_id: bytes, handle: int, keys: Sequence[bytes], prefix: bool
                    ) -> pb.LookupRequest:
    """Equal-length keys go packed (one bytes field, not a protobuf object per key), and
    the answer is asked for as one byte per key (``tier_codes``): see
    ctxmem_dpu.control.lookup_wire."""
    packed = pack_keys(keys) if len(keys) >= 64 else None
    if packed is not None:
        return pb.LookupRequest(session_id=session_id, namespace_handle=handle, prefix=prefix,
                                packed_keys=packed[0], key_len=packed[1],
                                want_tier_codes=True)
    return pb.LookupRequest(session_id=session_id, namespace_handle=handle, keys=keys,
                            prefix=prefix, want_tier_codes=True)


def _fast(s: _Session, keys: Sequence[bytes], key_len: int | None = None
          ) -> tuple[DataChannel, bytes, int] | None:
    """(channel, packed keys, key length) when this call can take the control fast path
    (shared memory or TCP): the channel carries it, and the keys are of one length.
    ``key_len``: the keys' common length as :func:`validate_keys` returned it, so they
    are not measured again; None: measured here (also where it returned 0: keys of
    several lengths, or not all ``bytes``, which ``pack_keys`` still packs)."""
    ch = s.channel
    if not ch.ops:
        return None
    if key_len:
        return ch, b"".join(keys), key_len
    packed = pack_keys(keys)
    return None if packed is None else (ch, packed[0], packed[1])


def _lookup_tiers(r: pb.LookupResponse) -> list[str]:
    """Tier names of a Lookup answer: ``tier_codes``, or ``tiers`` from a service that
    predates it (it ignores ``want_tier_codes``)."""
    if r.tiers:
        return [tier_from_pb(t) for t in r.tiers]
    return tiers_from_codes(r.tier_codes)


class Namespace:
    """Blocks of one (tenant, model, layout, tags). Created by :meth:`Client.open_namespace`."""

    def __init__(self, client: Client, layout: KVLayout, model_id: str, tenant: str,
                 tags: dict[str, str], weights_revision: str = "") -> None:
        self.client = client
        self.layout = layout
        self.model_id = model_id
        self.tenant = tenant
        self.tags = tags
        self.weights_revision = weights_revision
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
            layout=layout_to_pb(self.layout), weights_revision=self.weights_revision))
        if resp.block_nbytes != self.block_nbytes:
            raise CtxmemError(f"service computes {resp.block_nbytes} bytes per block for this "
                              f"layout, the shim {self.block_nbytes}: version mismatch")
        # With a revision, the digest the service must answer, under the tenant the
        # service says the session acts for (another local user's is NAME@uidN).
        if self.weights_revision and resp.namespace_digest != namespace_digest(
                s.acting, self.model_id, self.layout, self.tags, self.weights_revision):
            raise CtxmemError(
                f"model {self.model_id!r}: the service's namespace does not include "
                f"weights_revision {self.weights_revision!r} (a service older than the "
                f"shim ignores it, and would serve KV of other weights): upgrade the "
                f"service, or open the namespace without weights_revision")
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

    def _lookup_fast(self, s: _Session, keys: Sequence[bytes], prefix: bool
                     ) -> tuple[int, bytes] | None:
        """(hits, tier codes) over the control fast path; None: ask over gRPC."""
        fast = _fast(s, keys)
        if fast is None:
            return None
        ch, packed, key_len = fast
        try:
            body = ch.call(SHM_OP_LOOKUP, encode_keys_request(self.handle, packed, key_len,
                                                              prefix))
        except FastPathUnsupported:
            return None
        return decode_lookup_reply(body, len(keys))

    # -- API -------------------------------------------------------------------------
    @property
    def acting_tenant(self) -> str:
        """The tenant the service says this namespace's session acts for: :attr:`tenant`,
        or ``TENANT@uidN`` where an insecure-mode service scoped the name to this local
        user (``service.local_users: separate``, docs/security.md)."""
        return self._open().acting

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """How many leading ``keys`` are stored, and in which tier. Side-effect free.

        Keys are validated by the service (same errors), not twice on this hot path."""

        def op(s: _Session) -> LookupResult:
            fast = self._lookup_fast(s, keys, True)
            if fast is not None:
                return LookupResult(fast[0], tiers_from_codes(fast[1]))
            r = self.client._rpc("Lookup", _lookup_request(s.id, self.handle, keys, True))
            return LookupResult(r.num_hits, _lookup_tiers(r))

        return self._retrying(op)

    def locate(self, keys: Sequence[bytes]) -> LocateResult:
        """Where the leading ``keys`` are held across the pod, for KV-aware routers: per
        hit, the holding node and its tier there (this node's index first, then the
        cluster index, in one round trip; docs/operations.md, "Routers"). What the index
        says now, not a lease: a block may leave a node right after. Side-effect free."""

        def op(s: _Session) -> LocateResult:
            r = self.client._rpc("Locate", _lookup_request(s.id, self.handle, keys, True))
            return LocateResult(r.num_hits, [tier_from_pb(x.tier) for x in r.locations],
                                [x.node_id for x in r.locations], r.node_id)

        return self._retrying(op)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Per-key presence (not prefix-based)."""
        return [tier != "" for tier in self.tiers(keys)]

    def tiers(self, keys: Sequence[bytes]) -> list[str]:
        """Per key (not prefix-based), where it is stored now: ``"dram"``, ``"flash"``, or
        ``""`` when it is not stored. A block in both tiers reports ``"dram"``.
        Side-effect free: one Lookup, like :meth:`exists`, which is this answer as booleans.
        Tools use it to see a block move between tiers (e.g. flash-only after
        :meth:`evict`)."""

        def op(s: _Session) -> list[str]:
            fast = self._lookup_fast(s, keys, False)
            if fast is not None:
                return tiers_from_codes(fast[1])
            r = self.client._rpc("Lookup", _lookup_request(s.id, self.handle, keys, False))
            return _lookup_tiers(r)

        return self._retrying(op)

    def put(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> PutResult:
        """Store one buffer per key (each exactly ``block_nbytes``)."""
        validate_keys(keys)
        if len(keys) != len(buffers):
            raise InvalidArgument(f"put got {len(keys)} keys and {len(buffers)} buffers; "
                                  f"pass one buffer per key")
        # The buffers are viewed while the service answers the first Allocate (a bad one
        # is still refused, its allocation aborted, before any byte is written).
        staged = DeferredStaged(list(buffers), self.block_nbytes, writable=False)
        stored = existing = 0
        start = 0
        while start < len(keys):
            sl = self._batch(start, len(keys))
            try:
                st, ex = self._put_batch(list(keys[sl]), staged, sl.start)
            except Shed:
                self.client.puts_shed += 1
                raise
            stored += st
            existing += ex
            start = sl.stop
        staged.check()  # bad buffers are refused even when every block existed
        return PutResult(stored, existing)

    def _put_batch(self, keys: list[bytes], staged: DeferredStaged, start: int
                   ) -> tuple[int, int]:
        rpc = self.client._rpc

        def views(new: list[int]) -> list[memoryview]:
            every = staged.views
            return [every[start + i] for i in new]

        def op(s: _Session) -> tuple[int, int]:
            fast = _fast(s, keys)
            if fast is not None:
                return self._put_fast(fast[0], fast[1], fast[2], keys, staged, views)
            staged.prepare()
            a = rpc("Allocate", pb.AllocateRequest(
                session_id=s.id, namespace_handle=self.handle, keys=keys))
            new = [i for i, e in enumerate(a.exists) if not e]
            if not new:
                rpc("Commit", pb.CommitRequest(session_id=s.id, allocation_id=a.allocation_id,
                                               abort=True))
                return 0, len(keys)
            grant = Grant.allocation(a.allocation_id, a.slots)
            try:
                # Commit requires the CRCs (end-to-end integrity); the channel computes
                # them in the same pass as its copy where it can (shared memory).
                crcs = s.channel.write_grant(grant, views(new))
            except (TransportError, InvalidArgument):  # a bad buffer: nothing written
                grant.release()
                with contextlib.suppress(CtxmemError):
                    rpc("Commit", pb.CommitRequest(session_id=s.id,
                                                   allocation_id=a.allocation_id, abort=True))
                raise
            grant.release()
            c = rpc("Commit", pb.CommitRequest(
                session_id=s.id, allocation_id=a.allocation_id,
                crc32c=crcs))
            return c.committed, len(keys) - len(new)

        return self._retrying(op)

    def _put_fast(self, ch: DataChannel, packed: bytes, key_len: int, keys: list[bytes],
                  staged: DeferredStaged, views: Callable[[list[int]], list[memoryview]]
                  ) -> tuple[int, int]:
        """:meth:`_put_batch` over the control fast path: ALLOCATE (the buffers viewed
        meanwhile), the channel's write of the grant (:meth:`DataChannel.write_grant`),
        COMMIT (or an abort when nothing is new, a buffer is bad or the write failed).
        ``views``: the buffers of the batch's new blocks."""
        a = decode_allocate_reply(
            ch.call(SHM_OP_ALLOCATE, encode_keys_request(self.handle, packed, key_len),
                    meanwhile=staged.prepare),
            len(keys), self.block_nbytes)
        new = [i for i, e in enumerate(a.exists) if not e]
        if not new:
            ch.call(SHM_OP_COMMIT, [encode_commit(a.allocation_id, [], abort=True)])
            return 0, len(keys)
        grant = Grant.allocation(a.allocation_id, a.slots)
        try:
            crcs = ch.write_grant(grant, views(new))
        except (TransportError, InvalidArgument):  # a bad buffer: nothing written
            grant.release()
            with contextlib.suppress(CtxmemError):
                ch.call(SHM_OP_COMMIT, [encode_commit(a.allocation_id, [], abort=True)])
            raise
        grant.release()
        committed = decode_commit_reply(
            ch.call(SHM_OP_COMMIT, [encode_commit(a.allocation_id, crcs, abort=False)]))
        return committed, len(keys) - len(new)

    def get(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> int:
        """Fill ``buffers`` for the longest stored leading run of ``keys``; return its length.

        Blocks after the returned count are untouched (or zeroed, where a shared-memory
        batch copied by several threads had copied them: ``Client(copy_threads=...)``).
        Each block is checked against the CRC32C committed with it before it is written
        into its buffer (unless the client was made with ``verify_gets=False``), so a block
        that fails the check, a lease that expired while reading, or a service that went
        away makes the run shorter (a miss), never returns wrong bytes. Blocks that passed
        the check count whatever happens after: a retry after a reconnect goes on from the
        first block not yet delivered.
        """
        key_len = validate_keys(keys)  # once per get: every batch reuses its key length
        if len(keys) != len(buffers):
            raise InvalidArgument(f"get got {len(keys)} keys and {len(buffers)} buffers; "
                                  f"pass one buffer per key")
        # The buffers are viewed while the service answers the first Acquire (they are
        # still checked, and a bad one refused, before any byte is written).
        staged = DeferredStaged(list(buffers), self.block_nbytes, writable=True)
        total = 0
        while total < len(keys):
            # A batch may come back short because the run hit a miss, or because the
            # service could only stage part of it in DRAM; asking again from where it
            # stopped tells the two apart (a miss answers 0).
            sl = self._batch(total, len(keys))
            n, go_on = self._get_batch(list(keys[sl]), staged, sl.start, key_len)
            total += n
            if n == 0 or not go_on:
                break
        staged.check()  # bad buffers are refused even when nothing was leased
        staged.finish_get(total)
        return total

    def _get_batch(self, keys: list[bytes], staged: DeferredStaged, start: int,
                   key_len: int | None = None) -> tuple[int, bool]:
        """Get one batch into ``staged``'s views from ``start`` on; returns (leading blocks
        delivered, whether the get may go on after them: ``False`` after a failed check or
        an unavailable service). ``key_len``: :func:`validate_keys`' answer for the get's
        keys.

        With verification, ``done`` advances block by block as blocks pass their CRC, so
        a read that raises midway (service gone, lease refused) is retried, after a
        reconnect, from ``keys[done:]`` only. Without it (``verify_gets=False``), nothing
        counts until the whole read ended under a lease still valid at Release."""
        rpc = self.client._rpc
        verify = self.client.verify_gets
        done = 0
        failed = False

        def op(s: _Session) -> None:
            nonlocal done, failed
            if done == len(keys):
                return
            ch = s.channel
            base = done
            fast = _fast(s, keys[base:], key_len or None)  # 0: pack_keys decides
            rep = None
            if fast is not None:
                with contextlib.suppress(FastPathUnsupported):
                    rep = decode_acquire_reply(
                        fast[0].call(SHM_OP_ACQUIRE, encode_keys_request(
                            self.handle, fast[1], fast[2]), meanwhile=staged.prepare),
                        len(keys) - base, self.block_nbytes)
            a: pb.AcquireResponse | None = None
            if rep is not None:
                lease_id, n = rep.lease_id, len(rep.slots)
            else:
                staged.prepare()
                a = rpc("Acquire", pb.AcquireRequest(
                    session_id=s.id, namespace_handle=self.handle, keys=keys[base:],
                    want_packed=ch.packed_slots))
                lease_id, n = a.lease_id, a.num_acquired
            progress = ReadProgress()
            grant: Grant | None = None
            try:
                # A bad buffer raises here, and the lease is released below.
                dst = staged.views[start + base : start + base + n] if n else []
                if n:
                    if rep is not None:
                        grant = Grant.of_lease(lease_id, rep.slots, rep.slots.crcs)
                    else:
                        assert a is not None
                        grant = Grant.of_acquire(a, len(keys) - base, dst[0].nbytes,
                                                 ch.packed_slots)
                    ch.read_grant(grant, dst, verify, progress)
            finally:
                if verify:
                    done = base + progress.done  # checked bytes are right, whatever follows
                if grant is not None:
                    grant.release()
                valid = self._release(s, lease_id, fast is not None and rep is not None,
                                      wait=not verify)
            if progress.bad is not None:
                log.warning("ctxmem: block %d of lease %s failed its CRC32C; the run ends "
                            "there (a miss)", base + progress.bad, lease_id.hex())
                failed = True
            elif not verify:
                if ch.maps_slots and not valid:
                    # Unverified: the slots may have been reused while we copied.
                    log.warning("ctxmem: lease %s expired during an unverified copy; "
                                "treating as a miss", lease_id.hex())
                    failed = True
                else:
                    done = base + n

        try:
            self._retrying(op)
        except Unavailable as exc:
            log.warning("ctxmem get ends after %d verified blocks of this batch (a miss "
                        "from there): %s", done, exc)
            return done, False
        return done, not failed

    def _release(self, s: _Session, lease_id: bytes, fast: bool, wait: bool) -> bool:
        """End a lease; whether it was still valid. A verified get does not need the
        answer (every block was checked), so on the fast path its RELEASE is sent
        flagged no-reply and the get returns without a round trip (answers True)."""
        if fast:
            ch = s.channel
            body = ch.call(SHM_OP_RELEASE, [encode_release([lease_id], no_reply=not wait)],
                           reply=wait)
            return decode_release_reply(body, 1)[0] if wait else True
        rel = self.client._rpc("Release", pb.ReleaseRequest(session_id=s.id,
                                                            lease_ids=[lease_id]))
        return bool(rel.valid[0])

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Ask the service to promote flash blocks of ``keys`` to DRAM ahead of need;
        returns how many were queued."""
        validate_keys(keys)

        def op(s: _Session) -> int:
            return int(self.client._rpc("Prefetch", pb.PrefetchRequest(
                session_id=s.id, namespace_handle=self.handle, keys=keys)).queued)

        return self._retrying(op)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Delete ``keys`` on this service; returns how many it held. In a pod: send it to
        the node that wrote them; once it returns, no node serves those blocks (copies
        fetched elsewhere included). Raises Unavailable when the pod's index did not
        confirm (the keys are deleted here; retry). See docs/pod.md, "Deletes and re-puts
        across nodes"."""
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
