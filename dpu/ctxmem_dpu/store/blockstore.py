"""The facade: :class:`BlockStore`, the one object the servicer, transports and app use.

Flows (see docs/architecture.md):

* put: ``allocate`` reserves DRAM slots (evicting if needed) → the client writes them →
  ``commit`` computes the CRC32C (and checks the client's), then makes the blocks visible.
  Write-back: a background task demotes committed blocks to flash; write-through: commit
  returns after the flash write is durable.
* get: ``acquire`` walks the keys while they are stored, promotes flash-only blocks into
  DRAM (read → decrypt → verify CRC; a failure ends the run and is counted, never served),
  pins the blocks under a lease → the client reads → ``release``.

Invariant: a block is in the index only once complete; a pinned block's slots are never
freed; an extent is freed only once nothing can read it.

The delete and evict flows live here, the put flow in :mod:`~ctxmem_dpu.store.puts`, the
get flow in :mod:`~ctxmem_dpu.store.gets` (the methods here delegate to them); each
concept they use (sessions, index, placement, demotion, promotion, invalidation,
recovery, health, stats) is its own module, wired together in ``__init__`` through
explicit objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from ctxmem_common.config import Config
from ctxmem_common.errors import InvalidArgument
from ctxmem_common.keys import validate_keys
from ctxmem_common.layout import KVLayout
from ctxmem_common.protoconv import TIER_DRAM, TIER_REMOTE
from ctxmem_dpu import faults
from ctxmem_dpu.alloc import SlotRef
from ctxmem_dpu.blocks import Allocation, Block, Lease, Namespace, Session, SessionTables
from ctxmem_dpu.keyring import Keyring
from ctxmem_dpu.pod.entries import SharedLocation
from ctxmem_dpu.policy import SegmentedLRU
from ctxmem_dpu.store.context import IOPool, StoreContext
from ctxmem_dpu.store.deletes import Deletes
from ctxmem_dpu.store.demotion import Demotion
from ctxmem_dpu.store.devices import open_devices
from ctxmem_dpu.store.flash_room import FlashRoom
from ctxmem_dpu.store.gets import GetPath
from ctxmem_dpu.store.groups import GroupSiblings
from ctxmem_dpu.store.health import DeviceHealth
from ctxmem_dpu.store.index import BlockIndex, tier_of
from ctxmem_dpu.store.invalidation import Invalidator
from ctxmem_dpu.store.ns_tenants import default_path as ns_tenants_path
from ctxmem_dpu.store.promotion import Promotion
from ctxmem_dpu.store.puts import PutPath
from ctxmem_dpu.store.quotas import Quotas
from ctxmem_dpu.store.recovery import Recovery, audit
from ctxmem_dpu.store.remote import RemoteBlocks
from ctxmem_dpu.store.room import Room
from ctxmem_dpu.store.sessions import SessionRegistry
from ctxmem_dpu.store.staging import StagingRegion, StagingRegions
from ctxmem_dpu.store.staging import outcomes as staging_outcomes
from ctxmem_dpu.store.stats import new_counters, snapshot
from ctxmem_dpu.store.writethrough import WriteThrough
from ctxmem_dpu.tiers import flash_owner
from ctxmem_dpu.tiers.dram import DramTier
from ctxmem_dpu.tiers.flash import FlashTier

if TYPE_CHECKING:  # the pod's slab leases (and redis) load only where a device is shared
    from ctxmem_dpu.pod.slab_leases import SlabLeaseKeeper, SlabLeases

log = logging.getLogger("ctxmem_dpu.store")


class BlockStore:
    """All service state, on one event loop: the index over the DRAM and flash tiers,
    sessions and their grants, and the background demoter and reaper.

    ``flash_paths`` are (device name, path) pairs; ``master_key`` keys the flash records'
    authenticators and, when ``encryption.enabled``, AES-XTS at rest;
    ``software_crypto_off`` names devices whose storage backend encrypts in hardware,
    which get plaintext records.

    Use ``async with BlockStore(...) as store`` or :meth:`start` / :meth:`close`.
    """

    def __init__(
        self,
        cfg: Config,
        flash_paths: Sequence[tuple[str, str]] = (),
        master_key: bytes | None = None,
        software_crypto_off: Iterable[str] = (),
        slab_leases: SlabLeases | None = None,
    ) -> None:
        self.cfg = cfg
        self._flash_paths = list(flash_paths)
        # Shared flash (a pod): the devices several services write, each only the slabs
        # it leases through ``slab_leases`` (ctxmem_dpu.pod.slab_leases).
        self._slab_leases = slab_leases
        self._keeper: SlabLeaseKeeper | None = None
        self._ctx = StoreContext(
            cfg, DramTier(cfg.dram.size, cfg.dram.slab_size, cfg.dram.prefault),
            FlashTier([]), new_counters(), IOPool(cfg.service.io_threads, _io_weights(cfg)))
        #: Every counter of :data:`~ctxmem_dpu.store.COUNTERS` (Stats, /metrics, tests).
        self.counters = self._ctx.counters
        # The master key keys the records' authenticators even with encryption off.
        keyring = Keyring(master_key, software_crypto_off, encrypt=cfg.encryption.enabled)
        if not keyring.keyed and flash_paths:
            log.warning("no master key configured (encryption off, no encryption.key_file "
                        "or key_env): flash records' authenticators are made under a public "
                        "key and prove nothing against anyone who can write the flash; set "
                        "encryption.key_file")
        self._index = BlockIndex(cfg)
        self._health = DeviceHealth(self._ctx)
        self._invalidator = Invalidator(self._ctx, self._health)
        tables = SessionTables()  # the registry's, counted by the quotas
        self._quotas = Quotas(self._ctx, self._index, tables)
        self._registry = SessionRegistry(cfg, self._ctx.dram, self._index,
                                         self._invalidator.unpin, tables, self._quotas)
        # Making room, one way down (store/room.py): DRAM room demotes victims, whose
        # extents come from the flash room.
        self._flash_room = FlashRoom(self._ctx, self._index, self._invalidator, self._quotas)
        self._demotion = Demotion(self._ctx, self._index, self._flash_room, self._invalidator,
                                  self._health, keyring)
        self._room = Room(self._ctx, self._index, self._health, self._quotas,
                          self._demotion)
        self._promotion = Promotion(self._ctx, self._index, self._room, self._invalidator,
                                    self._health, keyring)
        self._write_through = WriteThrough(self._ctx, self._index, self._demotion,
                                           self._invalidator)
        self._recovery = Recovery(self._ctx, self._index, self._invalidator, keyring)
        self._puts = PutPath(self._ctx, self._index, self._registry, self._quotas,
                             self._room, self._write_through)
        self._remote = RemoteBlocks(self._ctx, self._index, self._room, self._promotion,
                                    self._invalidator, self._registry)
        self._deletes = Deletes(self._ctx, self._index, self._invalidator)
        self._groups = GroupSiblings(self._ctx, self._index, self._deletes.delete)
        self._gets = GetPath(self._ctx, self._index, self._registry, self._quotas,
                             self._room, self._promotion, self._invalidator, self._groups)
        #: Staging regions (service-owned memory clients put from; issue 27 item 1),
        #: freed with their session.
        self.staging = StagingRegions(cfg, self._ctx.dram, self.counters)
        self._registry.on_session_end.append(self.staging.session_ended)
        #: What has started, closed in reverse by :meth:`close`, also after a failed
        #: start (as ``Service``'s). What this constructor made goes last, unwound in
        #: this order: the I/O threads stop (their queued work done), then the Commit
        #: check's and the staging copies' threads, before the tiers they read and
        #: write close (the flash tier holds the devices once :meth:`start` opened them).
        self._stack = contextlib.AsyncExitStack()
        self._stack.callback(self._ctx.dram.close)
        self._stack.callback(self._close_flash)
        self._stack.callback(self.staging.close)
        self._stack.callback(self._puts.close)
        self._stack.callback(self._ctx.io.shutdown)
        #: Awaited after a Commit made blocks visible, with the namespace and the
        #: allocation's keys, before the Commit is answered (the pod tier: a re-put of a
        #: key whose earlier removal the cluster index has not confirmed is published
        #: first; it raises to fail the Commit). ``None``: nothing to wait for.
        self.commit_hook: Callable[[Namespace, Sequence[bytes]], Awaitable[None]] | None = None

    # -- state the servicer, transports and tests read -----------------------------------
    @property
    def dram(self) -> DramTier:
        """The DRAM tier (slot views for the data-plane servers)."""
        return self._ctx.dram

    @property
    def flash(self) -> FlashTier:
        """The flash tier (its devices and their health)."""
        return self._ctx.flash

    @property
    def index(self) -> dict[bytes, dict[bytes, Block]]:
        """Namespace digest → key → committed block."""
        return self._index.blocks

    @property
    def dram_lru(self) -> SegmentedLRU[Block]:
        """The DRAM tier's eviction order."""
        return self._index.dram_lru

    @property
    def flash_lru(self) -> SegmentedLRU[Block]:
        """The flash tier's eviction order."""
        return self._index.flash_lru

    @property
    def sessions(self) -> dict[bytes, Session]:
        """Open sessions by id (the data-plane servers authenticate against them)."""
        return self._registry.sessions

    @property
    def namespaces(self) -> dict[bytes, Namespace]:
        """Namespaces opened since start, by digest."""
        return self._registry.namespaces

    @property
    def allocations(self) -> dict[bytes, Allocation]:
        """Open allocations by id."""
        return self._registry.allocations

    @property
    def leases(self) -> dict[bytes, Lease]:
        """Open leases by id."""
        return self._registry.leases

    @property
    def on_grant_end(self) -> list[Callable[[bytes], None]]:
        """Hooks called with an allocation's or lease's id when it ends (commit, abort,
        release, expiry, session close), before its slots are unpinned: transports revoke
        the client's access there (RDMA memory windows)."""
        return self._registry.on_grant_end

    @property
    def full_devices(self) -> list[str]:
        """Names of devices whose filesystem was full at their last write."""
        return [self._ctx.flash.devices[d].name for d in sorted(self._health.full)]

    @property
    def locators(self) -> dict[str, Callable[[], str | None]]:
        """Device name → where the device is now (its storage backend's ``locate``); a
        failed device that moved is reopened there."""
        return self._health.locators

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Open the flash devices, rebuild the index from them, start the demoter and the
        reaper (and, on shared flash, the slab-lease keeper).

        Each thing registers its close on the exit stack as soon as it has started, so
        :meth:`close` unwinds exactly what started, in reverse: the reaper, the demoter
        (it finishes its batch) and the keeper's task stop; the background tasks (prefetch,
        invalidations) end; blocks still only in DRAM are written to flash and parked
        headers zeroed; the keeper gives back its empty slabs; then what ``__init__``
        made (the threads, the tiers and with them the devices)."""
        stack = self._stack
        faults.install_from_env()
        devices, keeper = await open_devices(self.cfg, self._ctx.io, self._flash_paths,
                                             self._slab_leases)
        self._keeper = keeper
        self._ctx.flash = FlashTier(devices)  # closed with the tier (see __init__)
        if keeper is not None:
            stack.push_async_callback(keeper.close)
        stack.push_async_callback(self._flush)
        stack.push_async_callback(self._await_background)
        await self._recovery.rebuild()
        # Who owns the recovered blocks' namespaces (issue 25: charged to their tenant,
        # not to nobody, before their tenant comes back).
        self._quotas.load_ns_tenants(ns_tenants_path(self.cfg),
                                     (d for d, blocks in self._index.blocks.items() if blocks))
        if keeper is not None:
            self._flash_room.attach_keeper(keeper)
            await keeper.top_up()
            self._start_task(keeper.run(), "ctxmem-slab-leases", cancel=True)
        # The demoter is never cancelled mid-I/O (that would strand blocks with half-done
        # bookkeeping): it sees ``closed`` and returns after its current batch.
        self._start_task(self._demotion.run(), "ctxmem-demoter", cancel=False)
        self._start_task(self._reaper(), "ctxmem-reaper", cancel=True)

    def _start_task(self, coro: Coroutine[Any, Any, None], name: str, cancel: bool) -> None:
        """Run ``coro`` as the task ``name``; :meth:`close` cancels it (``cancel``) or
        waits for it to see ``closed`` and return."""
        task = asyncio.create_task(coro, name=name)
        self._stack.push_async_callback(_stop_task, task, cancel)

    async def _await_background(self) -> None:
        """At close: the short background tasks (prefetch, invalidations, work whose
        request was cancelled) end; they are never cancelled mid-I/O."""
        for job in list(self._ctx.io.tasks):
            await _ended(job)

    async def _flush(self) -> None:
        """At close, before the tiers close: dirty blocks written to flash (write-back),
        then the headers a failed write or invalidation left behind zeroed."""
        if self._ctx.flash.enabled and self._index.dirty:
            try:
                await self._demotion.demote(list(self._index.dirty))
            except Exception:
                log.exception("flushing dirty blocks to flash at shutdown failed")
        await self._invalidator.retry_parked(log_errors=True)

    def _close_flash(self) -> None:
        # The tier of the context at close: the devices once start opened them.
        self._ctx.flash.close()

    async def close(self) -> None:
        """Stop background work, flush dirty blocks to flash (write-back), close tiers:
        what started, in reverse (see :meth:`start`). Idempotent; after a failed start
        it closes what did start."""
        if self._ctx.closed:
            return
        self._ctx.closed = True
        await self._stack.aclose()

    async def __aenter__(self) -> BlockStore:
        try:
            await self.start()
        except BaseException:
            # What started is closed (the devices' locks and owner records, the I/O
            # threads): ``async with`` never reaches __aexit__ after a failed enter.
            await self.close()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def _reaper(self) -> None:
        """Expire allocations and leases; re-probe failed flash devices; zero the headers
        of parked extents once their device works."""
        probe_at = 0.0
        owner_at = time.monotonic() + flash_owner.LEASE_S / 3
        while True:
            await asyncio.sleep(min(0.2, self.cfg.flash.probe_interval_s))
            now = time.monotonic()
            self._registry.expire(self.counters, now)
            if now >= probe_at:
                probe_at = now + self.cfg.flash.probe_interval_s
                await self._health.revive()
            if now >= owner_at:
                owner_at = now + flash_owner.LEASE_S / 3
                await self._health.refresh_owners()
            await self._invalidator.retry_parked()

    # -- shared flash (a pod) -------------------------------------------------------
    def shared_location(self, b: Block) -> SharedLocation | None:
        """Where any node of the pod reads ``b`` on shared flash: its device's UUID (hex),
        the payload's byte offset and length; ``None`` unless ``b`` is durable on a
        shared device (what the cluster index publishes with the block)."""
        return self._ctx.flash.shared_location(b.flash, b.length) if b.durable else None

    # -- sessions and namespaces -----------------------------------------------------
    def connect(self, tenant: str, token: str, transport: str, client_name: str,
                hold: bool = False) -> Session:
        """Open a session for ``tenant`` (checked against ``service.tenant_tokens``) on an
        enabled ``transport``; ``hold``: its client keeps a Hold call open while it lives
        (``store.sessions``: the orphan rule)."""
        return self._registry.connect(tenant, token, transport, client_name, hold)

    def session(self, session_id: bytes) -> Session:
        """The open session ``session_id``; UnknownSession (reconnect) otherwise."""
        return self._registry.session(session_id)

    def live_session(self, session_id: bytes) -> Session | None:
        """The session ``session_id`` unless unknown or being ended (what calls and data
        connections authenticate against)."""
        return self._registry.live(session_id)

    def open_namespace(
        self, s: Session, model_id: str, layout: KVLayout, tags: dict[str, str],
        weights_revision: str = "",
    ) -> tuple[int, Namespace]:
        """(handle in ``s``, namespace) for (tenant, model, layout, tags, weights
        revision); the same handle when ``s`` opened it before. Refuses layouts whose
        block exceeds a slab."""
        return self._registry.open_namespace(s, model_id, layout, tags, weights_revision)

    def namespace(self, s: Session, handle: int) -> Namespace:
        """The namespace open in ``s`` under ``handle``; UnknownNamespace otherwise."""
        return self._registry.namespace(s, handle)

    def close_session(self, s: Session) -> None:
        """End ``s`` now: its allocations, leases and quarantined slots end with it (a
        session no client has used yet: an abandoned Connect)."""
        self._registry.close_session(s)

    def disconnect(self, s: Session) -> bool:
        """The client ends ``s`` (Disconnect): refused from now on, ended now or once its
        shared-memory connections are closed; whether it ended now."""
        return self._registry.disconnect(s, self.counters)

    def hold_opened(self, s: Session) -> None:
        """A Hold call of ``s`` opened (``store.sessions``: the orphan rule)."""
        self._registry.hold_opened(s)

    def hold_ended(self, s: Session) -> None:
        """A Hold call of ``s`` ended; with its last, ``s`` may be orphaned."""
        self._registry.hold_ended(s)

    @property
    def on_session_end(self) -> list[Callable[[Session], None]]:
        """Hooks called with a session once it has ended (the servicer ends its Holds)."""
        return self._registry.on_session_end

    def shm_attached(self, s: Session) -> None:
        """A shared-memory connection of ``s`` opened: see ``sessions`` (quarantine)."""
        self._registry.shm_attached(s.id)

    def shm_detached(self, s: Session) -> None:
        """One closed; after its last, the session's quarantined slots are freed."""
        self._registry.shm_detached(s.id)

    # -- lookup ----------------------------------------------------------------------
    def lookup_blocks(self, ns: Namespace, keys: Sequence[bytes] | np.ndarray, prefix: bool,
                      checked: bool = False) -> list[Block | None]:
        """The blocks of ``keys`` (``None`` = miss); with ``prefix``, only the leading run.

        Side-effect free: does not count hits for eviction or refresh recency (engines
        ask the same question repeatedly while scheduling). ``checked``: the caller
        validated ``keys`` already (``packed_key_array``: then ``keys`` may be that numpy
        array), so they are not checked twice.
        """
        if not checked:
            validate_keys(keys.tolist() if isinstance(keys, np.ndarray) else keys)
        found = self._index.lookup(ns.digest, keys, prefix)
        hits = len(found) if prefix else len(found) - found.count(None)
        self.counters["lookup_keys"] += len(keys)
        self.counters["lookup_hits"] += hits
        return found

    def lookup(self, ns: Namespace, keys: Sequence[bytes], prefix: bool) -> tuple[int, list[str]]:
        """(hits, tier per key: "dram", "flash" or "" for a miss)."""
        found = self.lookup_blocks(ns, keys, prefix)
        tiers = ["" if b is None else tier_of(b) for b in found]
        return (len(found) if prefix else len(found) - found.count(None)), tiers

    # -- put -------------------------------------------------------------------------
    async def allocate(
        self, s: Session, ns: Namespace, keys: Sequence[bytes]
    ) -> tuple[Allocation, list[bool]]:
        """Reserve one DRAM slot per key not yet stored, under an allocation with a TTL;
        returns it and, per key, whether it is already stored (no slot for those)."""
        return await self._puts.allocate(s, ns, keys)

    def allocation(self, s: Session, allocation_id: bytes) -> Allocation:
        """The open allocation ``allocation_id`` of ``s``; Expired otherwise."""
        return self._registry.allocation(s, allocation_id)

    def writing(self, a: Allocation) -> contextlib.AbstractContextManager[None]:
        """``with store.writing(a):`` while a data-plane server writes into ``a``'s slots:
        the reaper does not recycle them underneath, even past the TTL."""
        return self._registry.held(a)

    async def commit(
        self, s: Session, allocation_id: bytes, client_crcs: Sequence[int], abort: bool
    ) -> int:
        """Make an allocation's blocks visible (``abort``: return its slots instead).

        Computes each slot's CRC32C; a block whose CRC differs from the client's (when
        sent) is dropped, as is one another writer committed meanwhile. Write-through
        makes blocks visible once durable on flash, or fails (``store.writethrough``);
        write-back queues them for the demoter. Returns how many were committed.
        With :attr:`commit_hook` set, it is awaited before returning."""
        hook = self.commit_hook
        if hook is None or abort:
            return await self._puts.commit(s, allocation_id, client_crcs, abort)
        a = self._registry.allocation(s, allocation_id)
        n = await self._puts.commit(s, allocation_id, client_crcs, abort)
        await hook(a.ns, a.keys)
        return n

    async def put_staged(self, s: Session, ns: Namespace, region: StagingRegion,
                         keys: Sequence[bytes], offsets: np.ndarray,
                         declared: np.ndarray | None) -> np.ndarray:
        """A staged put (:mod:`~ctxmem_dpu.store.staging`): a slot per key not stored,
        each block copied from ``region`` at ``offsets[i]`` with its CRC32C fused, then
        committed (a block whose CRC differs from ``declared``, when given, is not
        stored). The entries were checked by ``staging.check_entries``. Returns the
        outcome per key (``staging_wire.STORED``, ``EXISTING``, ``REFUSED_CRC``)."""
        with self.staging.using(region):  # mapped until the copy is done, whatever frees it
            a, exists = await self._puts.allocate(s, ns, keys)
            new = [i for i, e in enumerate(exists) if not e]
            offs: list[int] = offsets[new].tolist()
            computed: list[int] = []

            async def fill() -> list[int]:
                computed[:] = await self.staging.copy(region, offs, a.slots, ns.block_nbytes)
                return computed

            want: list[int] = [] if declared is None else declared[new].tolist()
            await self._puts.commit_filled(a, fill, want)
        if self.commit_hook is not None:
            await self.commit_hook(ns, a.keys)
        return staging_outcomes(exists, computed, declared)

    async def commit_group(self, s: Session, allocation_ids: Sequence[bytes],
                           client_crcs: Sequence[Sequence[int]]) -> int:
        """Commit a block group's allocations (one per member namespace, for the same
        keys) together, all or nothing per key (:meth:`PutPath.commit_group`); returns
        how many blocks were committed, every member's. :attr:`commit_hook` is awaited
        for each member before returning."""
        allocs = [self._registry.allocation(s, i) for i in allocation_ids]
        self._groups.declare([a.ns.digest for a in allocs])
        n = await self._puts.commit_group(s, allocation_ids, client_crcs)
        hook = self.commit_hook
        if hook is not None:
            for a in allocs:
                await hook(a.ns, a.keys)
        return n

    # -- get -------------------------------------------------------------------------
    async def acquire_group(self, s: Session, members: Sequence[Namespace],
                            keys: Sequence[bytes],
                            recheck: Callable[[Namespace], None] | None = None
                            ) -> tuple[list[Lease], list[str]]:
        """Lease a block group's leading run: the leading ``keys`` that every member
        namespace holds and whose every member block verifies (promoted and checked as
        :meth:`acquire` does). One lease per member, in ``members``' order, each of the
        same length; each block's source tier is the farthest of its members'. A key that
        one member lacks, or whose block in one member fails its check, ends the run
        there in every member: a whole miss, never part of a group
        (:meth:`GetPath.acquire_group`; ``recheck``: run for each member right before its
        index is looked at)."""
        return await self._gets.acquire_group(s, members, keys, recheck)

    async def acquire(self, s: Session, ns: Namespace, keys: Sequence[bytes],
                      keys_checked: bool = False) -> tuple[Lease, list[str]]:
        """Lease the longest stored leading run of ``keys``, promoting flash blocks into
        DRAM; returns the lease and each leased block's source tier. The run is cut where
        a block fails its check or DRAM could stage no more (the shim continues with
        another Acquire from there). ``keys_checked``: the caller already refused bad and
        duplicate keys (the shm fast path's ``packed_key_array``), so the batch is not
        checked a second time (≈ 10% of a 64 KiB Acquire's service time). The flow is
        :meth:`GetPath.acquire`."""
        return await self._gets.acquire(s, ns, keys, keys_checked)

    def release(self, s: Session, lease_ids: Sequence[bytes]) -> list[bool]:
        """End leases; per lease, whether it was still valid (not expired) at release."""
        return self._registry.release(s, lease_ids)

    def lease(self, s: Session, lease_id: bytes) -> Lease:
        """The valid, unexpired lease ``lease_id`` of ``s``; Expired otherwise."""
        return self._registry.lease(s, lease_id)

    def pin(self, b: Block) -> None:
        """Keep ``b``'s slots from being evicted or reused until :meth:`unpin` (a
        data-plane server sending it)."""
        self._index.pin(b)

    def unpin(self, b: Block) -> None:
        """Undo one :meth:`pin`; the last unpin of a deleted block frees its storage."""
        self._invalidator.unpin(b)

    # -- prefetch, delete, evict -----------------------------------------------------
    async def prefetch(self, ns: Namespace, keys: Sequence[bytes]) -> tuple[int, int]:
        """Promote the flash-only blocks of ``keys`` in the background; returns (how many
        are being promoted, how many are in DRAM already)."""
        validate_keys(keys)
        return self._promotion.prefetch(ns, keys, self.unpin)

    def declare_group(self, members: Sequence[Namespace]) -> None:
        """``members`` are a block group's namespaces (a group call named them): once one
        member's block of a key leaves the index, the others' are reclaimed
        (:mod:`~ctxmem_dpu.store.groups`)."""
        self._groups.declare([ns.digest for ns in members])

    async def delete(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """Remove ``keys``; returns how many were stored. When this returns, the deleted
        blocks' flash headers are zeroed and synced: a restart cannot bring them back."""
        validate_keys(keys)
        return await self._deletes.delete(ns.digest, keys)

    async def evict(self, ns: Namespace, keys: Sequence[bytes], tier: str) -> int:
        """Drop DRAM copies of ``keys`` after making sure they are durable on flash;
        returns how many were dropped (leased blocks keep theirs)."""
        validate_keys(keys)
        if tier != TIER_DRAM:
            raise InvalidArgument(f"evict supports tier 'dram' only, got {tier!r}")
        if not self._ctx.flash.enabled:
            raise InvalidArgument("evict to flash needs a flash tier; none is configured")
        return await self._room.evict(self._index.get(ns.digest), keys)

    # -- the pod tier (ctxmem_dpu.pod) -----------------------------------------------
    @property
    def block_listeners(self) -> list[Callable[[Block, bool], None]]:
        """Called with (block, present) as committed blocks enter or leave the index."""
        return self._index.listeners

    def announce(self, blocks: Iterable[Block], present: bool) -> None:
        """Tell :attr:`block_listeners` that ``blocks`` are held (again, somewhere new) or
        gone: a tier that moved a block where peers should learn of it calls this."""
        self._index.announce(blocks, present)

    async def adopt(self, ns: Namespace, items: Sequence[tuple[bytes, bytes, int]],
                    origins: Sequence[bytes] | None = None) -> int:
        """Store blocks fetched from another node (key, bytes, CRC32C) in DRAM, as copies
        of the index entries ``origins`` when given; see :meth:`RemoteBlocks.adopt`."""
        return await self._remote.adopt(ns, items, origins)

    async def landing(self, ns: Namespace, n: int) -> list[SlotRef]:
        """DRAM slots for fetched blocks to land in; see :meth:`RemoteBlocks.landing`."""
        return await self._remote.landing(ns, n)

    def adopt_landed(self, ns: Namespace, refs: Sequence[SlotRef],
                     items: Sequence[tuple[bytes, int, bytes | None]],
                     landed: Sequence[bool], fetched: str = TIER_REMOTE) -> int:
        """Index fetched blocks that landed, verified, in their slots (key, CRC32C,
        origin per slot; ``fetched``: the source their first Acquire reports); see
        :meth:`RemoteBlocks.adopt_landed`."""
        return self._remote.adopt_landed(ns, refs, items, landed, fetched)

    def free_landing(self, refs: Sequence[SlotRef]) -> None:
        self._remote.free_landing(refs)

    def fetched_copies(self, ns_digest: bytes) -> dict[bytes, Block]:
        """Key → copy fetched from another node, in namespace ``ns_digest`` (read only)."""
        return self._index.copies_of(ns_digest)

    def drop_copies(self, blocks: Sequence[Block]) -> None:
        """Fetched copies the cluster index no longer names: misses from now; see
        :meth:`RemoteBlocks.drop_copies`."""
        self._remote.drop_copies(blocks)

    async def pin_for_peer(self, ns_digest: bytes, keys: Sequence[bytes]
                           ) -> list[Block | None]:
        """Blocks of ``keys`` pinned in DRAM for a peer (unpin each after sending)."""
        return await self._remote.pin_for_peer(ns_digest, keys)

    def holdings(self) -> Iterable[tuple[bytes, Block]]:
        """(namespace digest, block) of every stored block (a full republish)."""
        return self._remote.holdings()

    # -- consistency and stats -------------------------------------------------------
    def audit(self) -> list[str]:
        """Cross-check the index against the flash allocators (tests): every extent the
        index names is allocated, to a slab of the block's slot size, and named once;
        every allocated slot is accounted for (an indexed block, a quarantined slot, one
        parked until its header is zeroed, or one a demotion or invalidation has in
        flight). Call it on the event loop between awaits. Returns the problems found
        (empty: sound)."""
        return audit(self._ctx, self._index, self._invalidator)

    def parked_extents(self) -> int:
        """How many extents wait for their record header to be zeroed (a write or an
        invalidation failed on a failing device) before they can be reused."""
        return sum(len(v) for v in self._invalidator.parked.values())

    def stats(self) -> dict[str, float]:
        """Every counter and gauge (the Stats RPC and /metrics)."""
        return snapshot(self._ctx, self._index, self._registry, self._quotas)


def _io_weights(cfg: Config) -> Callable[[str], float]:
    """Each tenant's ``io_weight`` (its own quota entry, else the default's)."""
    tenants, default = cfg.quotas.tenants, cfg.quotas.default.io_weight
    return lambda tenant: tenants[tenant].io_weight if tenant in tenants else default


async def _ended(job: Awaitable[object]) -> None:
    """Await a background task at close; its failure is logged, not raised."""
    try:
        await job
    except asyncio.CancelledError:
        pass
    except Exception:
        log.exception("background task failed at shutdown")


async def _stop_task(task: asyncio.Task[None], cancel: bool) -> None:
    """Stop a task :meth:`BlockStore.start` started (cancelled first when ``cancel``)."""
    if cancel:
        task.cancel()
    await _ended(task)
