"""The block store: index, placement, leases, demotion and promotion.

One object owns all service state and runs on one asyncio event loop; every mutation of
the index happens on that loop's thread, so no locks. Byte work (CRC32C, AES-XTS, device
I/O) runs on a small thread pool; those functions get the slot views they need and never
touch the index.

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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import itertools
import logging
import mmap
import os
import secrets
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from itertools import repeat
from typing import Any, TypeVar

from ctxmem_common.codecs import XtsCipher, crc32c, derive_namespace_key
from ctxmem_common.config import Config
from ctxmem_common.errors import (
    Expired,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    UnknownNamespace,
    UnknownSession,
)
from ctxmem_common.keys import namespace_digest, validate_keys
from ctxmem_common.layout import KVLayout
from ctxmem_common.protoconv import TIER_DRAM, TIER_FLASH
from ctxmem_dpu import faults
from ctxmem_dpu.alloc import SlotRef
from ctxmem_dpu.blocks import Allocation, Block, Lease, Namespace, Session
from ctxmem_dpu.policy import SegmentedLRU
from ctxmem_dpu.tiers import flash as flash_mod
from ctxmem_dpu.tiers.dram import DramTier, round_up
from ctxmem_dpu.tiers.flash import (
    Extent,
    FlashDevice,
    FlashIOError,
    FlashTier,
    ReadFailure,
    ShortRead,
)
from ctxmem_dpu.tiers.flash_format import RecordHeader, TableColumns, slots_per_slab

log = logging.getLogger(__name__)
T = TypeVar("T")


# Every counter the store keeps; all are reported (as 0 until they move) by Stats and
# /metrics, so dashboards and tests see the same names from the start.
COUNTERS = (
    "lookup_keys", "lookup_hits", "put_blocks", "put_bytes", "put_crc_mismatch",
    "get_blocks", "get_bytes", "hits_dram", "hits_flash", "misses", "prefetch_blocks",
    "promoted_blocks", "promote_no_space", "demoted_blocks", "demoted_bytes",
    "evictions_dram", "evictions_flash", "deleted_blocks", "integrity_failures",
    "flash_read_errors", "flash_write_errors", "flash_device_failures", "flash_full",
    "dram_full", "expired_allocations", "expired_leases", "recovered_blocks",
    "recovery_seconds_x1e6", "quarantined_extents", "dirty_dropped", "flash_device_recoveries",
    "flash_device_reopened",
)
# How often failed flash devices are probed (see FlashDevice.probe). Tests and the chaos
# campaign lower it with CTXMEM_FLASH_PROBE_INTERVAL_S.
PROBE_INTERVAL_S = float(os.environ.get("CTXMEM_FLASH_PROBE_INTERVAL_S", "2.0"))
# The demoter's poll period, and the longest it waits between tries that made no progress.
DEMOTE_POLL_S = 0.02
DEMOTE_BACKOFF_MAX_S = 1.0
# Bound on one call of a device's locator (a storage backend's locate(), a sysfs walk).
LOCATE_TIMEOUT_S = 5.0
# "flash tier full" is logged at most this often (each occurrence is counted in flash_full).
FLASH_FULL_LOG_INTERVAL_S = 30.0


class BlockStore:
    def __init__(
        self,
        cfg: Config,
        flash_paths: Sequence[tuple[str, str]] = (),
        master_key: bytes | None = None,
        software_crypto_off: Iterable[str] = (),
    ) -> None:
        self.cfg = cfg
        self._flash_paths = list(flash_paths)
        self._master_key = master_key if cfg.encryption.enabled else None
        self._crypto_off_devices = set(software_crypto_off)
        self.dram = DramTier(cfg.dram.size, cfg.dram.slab_size, cfg.dram.prefault)
        self.flash = FlashTier([])
        self.index: dict[bytes, dict[bytes, Block]] = {}
        self.namespaces: dict[bytes, Namespace] = {}
        self.sessions: dict[int, Session] = {}
        self.allocations: dict[int, Allocation] = {}
        self.leases: dict[int, Lease] = {}
        self.dram_lru: SegmentedLRU[Block] = SegmentedLRU(
            cfg.eviction.protect_after_hits, cfg.eviction.protected_fraction
        )
        self.flash_lru: SegmentedLRU[Block] = SegmentedLRU(
            cfg.eviction.protect_after_hits, cfg.eviction.protected_fraction
        )
        self._dirty: dict[Block, None] = {}  # committed, DRAM only, waiting for demotion
        # Session, allocation and lease ids start at a random point per service instance:
        # after a restart a client still holding an old session id must get "unknown
        # session" (and reconnect), never alias a new session of another tenant — ids that
        # restarted at 1 did exactly that (found by ``ctxmem chaos``).
        self._ids = itertools.count(secrets.randbits(48) + 1)
        self._seq = itertools.count(1)
        self._ciphers: dict[bytes, XtsCipher | None] = {}
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, cfg.service.io_threads), thread_name_prefix="ctxmem-io"
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        # Extents whose header may still hold a record (a write or an invalidation failed
        # on a failing device): never reused until the header is zeroed, which the reaper
        # does once the device is healthy again.
        self._needs_zero: dict[int, list[Extent]] = {}
        # Extents allocated but named by no block for the moment: a demotion's, between
        # reservation and completion; an invalidation's, between zeroing and freeing.
        self._in_flight: Counter[Extent] = Counter()
        self._slow_seen: dict[int, int] = {}
        self._flash_full_logged = -FLASH_FULL_LOG_INTERVAL_S
        # Called with an allocation's or lease's id when it ends (commit, abort, release,
        # expiry, session close), before its slots are unpinned: see _grant_ended.
        self.on_grant_end: list[Callable[[int], None]] = []
        # Device name -> where the device is now (its storage backend's locate(): e.g. the
        # NVMe namespace's current block node, from sysfs; None while it is not there). A
        # failed device whose probe fails is looked up and reopened there when it moved.
        self.locators: dict[str, Callable[[], str | None]] = {}

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        faults.install_from_env()
        devices = []
        for i, (name, path) in enumerate(self._flash_paths):
            devices.append(
                await self._io(
                    FlashDevice, i, name, path, self.cfg.flash.slab_size, self.cfg.flash.o_direct
                )
            )
        self.flash = FlashTier(devices)
        await self._rebuild()
        self._tasks = [
            asyncio.create_task(self._demoter(), name="ctxmem-demoter"),
            asyncio.create_task(self._reaper(), name="ctxmem-reaper"),
        ]

    async def close(self) -> None:
        """Stop background work, flush dirty blocks to flash (write-back), close tiers."""
        if self._closed:
            return
        self._closed = True
        # The demoter and prefetch/invalidate tasks are never cancelled mid-I/O (that
        # would strand blocks with half-done bookkeeping): the demoter sees ``_closed``
        # and returns after its current batch; the others are short and awaited.
        for t in self._tasks:
            if t.get_name() == "ctxmem-reaper":
                t.cancel()
        for t in self._tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
            except Exception:
                log.exception("background task failed at shutdown")
        if self.flash.enabled and self._dirty:
            try:
                await self._demote(list(self._dirty))
            except Exception:
                log.exception("flushing dirty blocks to flash at shutdown failed")
        for d in list(self._needs_zero):  # headers a failed write may have left behind
            if self.flash.devices[d].healthy:
                try:
                    await self._invalidate(self._needs_zero.pop(d))
                except Exception:
                    log.exception("invalidating parked extents at shutdown failed")
        self._pool.shutdown(wait=True)
        self.flash.close()
        self.dram.close()

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking byte work (I/O, CRC, crypto) on the I/O threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    async def _io_parallel(self, fn: Callable[[list[Any]], list[T]], jobs: list[Any]
                           ) -> list[T]:
        """``fn`` over ``jobs`` split into one contiguous part per I/O thread, in parallel:
        device reads and writes overlap (queue depth > 1) with AES-XTS and CRC32C on the
        other thread (all three release the GIL). Results keep the jobs' order."""
        n = max(1, min(self.cfg.service.io_threads, len(jobs)))
        size = -(-len(jobs) // n)
        parts = [jobs[i:i + size] for i in range(0, len(jobs), size)]
        done = await asyncio.gather(*(self._io(fn, part) for part in parts))
        return [r for part in done for r in part]

    # -- rebuild ---------------------------------------------------------------------
    async def _rebuild(self) -> None:
        """Rebuild the index from the self-describing records on every flash device.

        Reads each used slab's header table (one read per slab, up to ``io_threads`` slabs
        in flight) while the loop indexes the previous one. Every valid header names a
        payload that was synced before it (see ``_demote``), so every record found is a
        complete, durable block. Two records for one key (a crash between rewriting and
        invalidating, or a copied record): the higher sequence number wins; on a tie, the
        one whose payload verifies. Losers' headers are zeroed and their extents freed.
        """
        t0 = time.perf_counter()
        # No cyclic GC while a million long-lived objects are created (each collection
        # would walk all of them: quadratic), and, for a large index, afterwards move them
        # to the permanent generation so later collections on the event loop do not walk
        # them either (they are freed by reference counting when they go).
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            await self._rebuild_index()
        finally:
            if gc_was_enabled:
                gc.enable()
            if sum(len(v) for v in self.index.values()) >= 100_000:
                gc.freeze()
        self.counters["recovered_blocks"] = sum(len(v) for v in self.index.values())
        self.counters["recovery_seconds_x1e6"] = int((time.perf_counter() - t0) * 1e6)
        if self.counters["recovered_blocks"]:
            log.info("rebuilt index from flash: %d blocks in %.3f s",
                     self.counters["recovered_blocks"], time.perf_counter() - t0)

    async def _rebuild_index(self) -> None:
        found = 0
        max_seq = 0
        losers: list[Extent] = []
        ties: list[tuple[Block, Block]] = []
        index = self.index
        # Bulk insert into the flash LRU's probation segment: every rebuilt block is new
        # and unhit, and SegmentedLRU.add per block costs a remove + insert each.
        probation = self.flash_lru._probation
        for dev in self.flash.devices:
            dev_index = dev.index
            async for slab_id, slot_size, cols in self._scan(dev):
                dev.alloc.claim_slots(slab_id, slot_size, cols.slot)
                found += len(cols.slot)
                max_seq = max(max_seq, max(cols.seq))
                exts = list(map(Extent, repeat(dev_index), map(SlotRef, repeat(slab_id),
                                                                cols.slot)))
                blocks = list(map(Block, cols.namespace, cols.key, cols.length,
                                  repeat(slot_size), cols.crc, cols.seq, repeat(None), exts,
                                  repeat(True)))
                ns0 = cols.namespace[0]
                per_ns = index.get(ns0)
                if per_ns is None:
                    per_ns = index[ns0] = {}
                if (cols.namespace.count(ns0) == len(blocks) and len(set(cols.key)) == len(blocks)
                        and per_ns.keys().isdisjoint(cols.key)):
                    # The common case: one namespace, no key seen before.
                    per_ns.update(zip(cols.key, blocks, strict=True))
                    probation.update(dict.fromkeys(blocks))
                    continue
                for b in blocks:
                    per_ns = index.get(b.ns)
                    if per_ns is None:
                        per_ns = index[b.ns] = {}
                    old = per_ns.get(b.key)
                    if old is not None:
                        assert b.flash is not None and old.flash is not None
                        if old.seq > b.seq:
                            losers.append(b.flash)
                            continue
                        if old.seq == b.seq:
                            ties.append((old, b))
                            continue
                        losers.append(old.flash)
                        self.flash_lru.remove(old)
                    per_ns[b.key] = b
                    probation[b] = None
            faults.point("rebuild.after_scan")
        flash_mod.scan_buffers.clear()
        for keep, other in ties:
            if self.index[keep.ns].get(keep.key) is not keep:  # superseded by a newer seq
                assert other.flash is not None
                losers.append(other.flash)
                continue
            # One version on two extents (a copied record): keep the one that verifies.
            log.debug("rebuild: key %s on %s and %s", keep.key.hex()[:16], keep.flash,
                      other.flash)
            if not await self._verify(keep) and await self._verify(other):
                keep, other = other, keep
                self.index[keep.ns][keep.key] = keep
                self.flash_lru.remove(other)
                self.flash_lru.add(keep)
            assert other.flash is not None
            losers.append(other.flash)
        if losers:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("rebuild: shadowed records invalidated: %s", losers)
            await self._invalidate(losers)
        self._seq = itertools.count(max_seq + 1)
        if losers:
            log.info("rebuild: %d of %d records were shadowed by newer ones (invalidated)",
                     len(losers), found)

    async def _scan(self, dev: FlashDevice) -> AsyncIterator[tuple[int, int, TableColumns]]:
        """The used slabs of ``dev`` with their records, in slab order; up to
        ``io_threads`` (at least 2) slab reads in flight while the caller indexes."""
        loop = asyncio.get_running_loop()
        pending: deque[asyncio.Future[tuple[int, int, TableColumns] | None]] = deque()
        slabs = iter(range(dev.num_slabs))
        depth = max(2, self.cfg.service.io_threads)
        while True:
            while len(pending) < depth and (slab := next(slabs, None)) is not None:
                pending.append(loop.run_in_executor(self._pool, dev.scan_slab, slab))
            if not pending:
                return
            res = await pending.popleft()
            if res is not None and res[2].slot:
                yield res

    async def _verify(self, b: Block) -> bool:
        """Does ``b``'s flash record read back and check (header, payload CRC)?"""
        assert b.flash is not None
        dev = self.flash.devices[b.flash.device]
        cipher = self._cipher(b.ns)

        def work() -> bool:
            buf = mmap.mmap(-1, max(b.slot_size, 4096))
            view = memoryview(buf)[: b.slot_size]
            try:
                dev.read_record(b.flash.slot, view, b.ns, b.key, b.length, b.crc,  # type: ignore[union-attr]
                                b.seq, cipher)
                return True
            except (ReadFailure, FlashIOError, ValueError):
                return False
            finally:
                view.release()
                buf.close()

        return await self._io(work)

    # -- sessions and namespaces -----------------------------------------------------
    def connect(self, tenant: str, token: str, transport: str, client_name: str) -> Session:
        tokens = self.cfg.service.tenant_tokens
        if not tenant:
            raise InvalidArgument("tenant must not be empty")
        if tokens and tokens.get(tenant) != token:
            raise PermissionDenied(f"tenant {tenant!r}: missing or wrong tenant token")
        if transport not in self.cfg.service.transports:
            raise InvalidArgument(
                f"transport {transport!r} is not enabled on this service; it offers "
                f"{self.cfg.service.transports} (service.transports)"
            )
        s = Session(next(self._ids), tenant, transport, client_name)
        self.sessions[s.id] = s
        return s

    def session(self, session_id: int) -> Session:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise UnknownSession(
                f"session {session_id} is unknown to this service instance (it restarted or "
                f"the session was closed); reconnect"
            ) from None

    def open_namespace(
        self, s: Session, model_id: str, layout: KVLayout, tags: dict[str, str]
    ) -> tuple[int, Namespace]:
        digest = namespace_digest(s.tenant, model_id, layout, tags)
        ns = self.namespaces.get(digest)
        if ns is None:
            slot_size = round_up(layout.block_nbytes)
            if slot_size > self.cfg.dram.slab_size:
                raise InvalidArgument(
                    f"a block of this layout is {layout.block_nbytes} bytes, larger than one "
                    f"DRAM slab (dram.slab_size={self.cfg.dram.slab_size}); raise "
                    f"dram.slab_size or use fewer tokens_per_block"
                )
            ns = Namespace(digest, s.tenant, model_id, layout, dict(tags), layout.block_nbytes,
                           slot_size, self._cipher(digest))
            self.namespaces[digest] = ns
            self.index.setdefault(digest, {})
        for handle, existing in s.namespaces.items():
            if existing is ns:
                return handle, ns
        handle = len(s.namespaces) + 1
        s.namespaces[handle] = ns
        return handle, ns

    def _cipher(self, digest: bytes) -> XtsCipher | None:
        if digest not in self._ciphers:
            key = self._master_key
            self._ciphers[digest] = (
                XtsCipher(derive_namespace_key(key, digest)) if key is not None else None
            )
        return self._ciphers[digest]

    def namespace(self, s: Session, handle: int) -> Namespace:
        try:
            return s.namespaces[handle]
        except KeyError:
            raise UnknownNamespace(
                f"namespace handle {handle} is not open in session {s.id}; call "
                f"OpenNamespace first"
            ) from None

    def close_session(self, s: Session) -> None:
        for a in list(s.allocations.values()):
            self._drop_allocation(a)
        for lease in list(s.leases.values()):
            self._end_lease(lease, valid=False)
        self.sessions.pop(s.id, None)

    # -- lookup ----------------------------------------------------------------------
    def lookup_blocks(self, ns: Namespace, keys: Sequence[bytes], prefix: bool
                      ) -> list[Block | None]:
        """The blocks of ``keys`` (``None`` = miss); with ``prefix``, only the leading run.

        Side-effect free: does not count hits for eviction or refresh recency (engines
        ask the same question repeatedly while scheduling). The index walk is one C-level
        ``map`` over the keys.
        """
        validate_keys(keys)
        per_ns = self.index.get(ns.digest, {})
        found = list(map(per_ns.get, keys))
        if prefix and None in found:
            found = found[: found.index(None)]
        hits = len(found) if prefix else len(found) - found.count(None)
        self.counters["lookup_keys"] += len(keys)
        self.counters["lookup_hits"] += hits
        return found

    def lookup(self, ns: Namespace, keys: Sequence[bytes], prefix: bool) -> tuple[int, list[str]]:
        """(hits, tier per key: "dram", "flash" or "" for a miss)."""
        found = self.lookup_blocks(ns, keys, prefix)
        tiers = ["" if b is None else TIER_DRAM if b.dram is not None else TIER_FLASH
                 for b in found]
        return (len(found) if prefix else len(found) - found.count(None)), tiers

    # -- put -------------------------------------------------------------------------
    async def allocate(
        self, s: Session, ns: Namespace, keys: Sequence[bytes]
    ) -> tuple[Allocation, list[bool]]:
        validate_keys(keys)
        per_ns = self.index.get(ns.digest, {})
        exists = [k in per_ns for k in keys]
        new_keys = [k for k, e in zip(keys, exists, strict=True) if not e]
        slots = await self._reserve_dram(ns, len(new_keys))
        a = Allocation(next(self._ids), s.id, ns, new_keys, slots,
                       time.monotonic() + self.cfg.service.allocation_ttl_s)
        self.allocations[a.id] = a
        s.allocations[a.id] = a
        faults.point("allocate.after_reserve")
        return a, exists

    def allocation(self, s: Session, allocation_id: int) -> Allocation:
        a = s.allocations.get(allocation_id)
        if a is None:
            raise Expired(
                f"allocation {allocation_id} is unknown or expired (allocations live "
                f"{self.cfg.service.allocation_ttl_s:g} s); allocate again and rewrite"
            )
        return a

    async def commit(
        self, s: Session, allocation_id: int, client_crcs: Sequence[int], abort: bool
    ) -> int:
        a = self.allocation(s, allocation_id)
        if abort:
            self._drop_allocation(a)
            return 0
        if client_crcs and len(client_crcs) != len(a.slots):
            raise InvalidArgument(
                f"commit of allocation {a.id} carries {len(client_crcs)} CRCs for "
                f"{len(a.slots)} slots; send one per slot or none"
            )
        # The client's write access ends before the service reads what it wrote: no byte
        # can change between the CRC below and the index.
        self._grant_ended(a.id)
        # The allocation stays registered while its CRCs are computed so the reaper
        # cannot recycle its slots underneath; then it is retired.
        a.done = True
        views = [self.dram.view(ref, a.ns.block_nbytes) for ref in a.slots]
        crcs = await self._io(lambda: [crc32c(v) for v in views])
        for v in views:
            v.release()
        faults.point("commit.after_crc")
        self._forget_allocation(a)
        per_ns = self.index.setdefault(a.ns.digest, {})
        committed: list[Block] = []
        for i, (key, ref, crc) in enumerate(zip(a.keys, a.slots, crcs, strict=True)):
            if client_crcs and client_crcs[i] != crc:
                self.counters["put_crc_mismatch"] += 1
                log.warning("commit %d: block %d CRC32C from client %08x != %08x; dropped",
                            a.id, i, client_crcs[i], crc)
                self.dram.free(ref)
                continue
            if key in per_ns:  # committed meanwhile by another writer
                self.dram.free(ref)
                continue
            b = Block(a.ns.digest, key, a.ns.block_nbytes, a.ns.slot_size, crc,
                      next(self._seq), dram=ref)
            per_ns[key] = b
            self.dram_lru.add(b)
            committed.append(b)
        self.counters["put_blocks"] += len(committed)
        self.counters["put_bytes"] += len(committed) * a.ns.block_nbytes
        faults.point("commit.after_index")
        if not self.flash.enabled:
            return len(committed)
        if self.cfg.flash.write_policy == "write_through":
            await self._demote(committed)
        else:
            for b in committed:
                self._dirty[b] = None
        return len(committed)

    def _forget_allocation(self, a: Allocation) -> None:
        self._grant_ended(a.id)
        self.allocations.pop(a.id, None)
        sess = self.sessions.get(a.session_id)
        if sess is not None:
            sess.allocations.pop(a.id, None)

    def _drop_allocation(self, a: Allocation) -> None:
        self._forget_allocation(a)
        for ref in a.slots:
            self.dram.free(ref)
        a.slots = []

    # -- get -------------------------------------------------------------------------
    async def acquire(self, s: Session, ns: Namespace, keys: Sequence[bytes]) -> tuple[
        Lease, list[str]
    ]:
        validate_keys(keys)
        per_ns = self.index.get(ns.digest, {})
        # One lease holds at most half the DRAM tier, so the rest can be evicted to stage
        # cold blocks; the shim asks for the remainder in a following Acquire.
        max_run = max(1, self.dram.num_slabs * (self.cfg.dram.slab_size // ns.slot_size) // 2)
        run: list[Block] = []
        for key in keys[:max_run]:
            b = per_ns.get(key)
            if b is None:
                break
            run.append(b)
        sources = [TIER_DRAM if b.dram is not None else TIER_FLASH for b in run]
        for b in run:  # pin before any await, so nothing in the run is evicted meanwhile
            b.pins += 1
        cold = [b for b in run if b.dram is None]
        try:
            # Promote as much of the run as DRAM can take (halving on RESOURCE_EXHAUSTED):
            # the run is cut at the first block that did not fit, and the shim asks for
            # the rest in a following Acquire once it has copied these out.
            take = len(cold)
            while True:
                try:
                    ok = await self._promote(ns, cold[:take])
                    break
                except ResourceExhausted:
                    self.counters["promote_no_space"] += 1
                    if take <= 1:
                        ok = BlockStore._PromoteResult()
                        break
                    take //= 2
            ok.failed.update(id(b) for b in cold[take:])
        except BaseException:
            for b in run:
                self._unpin(b)
            raise
        n = 0
        while n < len(run) and run[n].dram is not None and id(run[n]) not in ok.failed:
            n += 1
        for b in run[n:]:
            self._unpin(b)
        run = run[:n]
        for b in run:
            b.hits += 1
            self.dram_lru.touch(b, b.hits)
            if b.flash is not None:
                self.flash_lru.touch(b, b.hits)
        lease = Lease(next(self._ids), s.id, ns, run,
                      time.monotonic() + self.cfg.service.lease_ttl_s)
        self.leases[lease.id] = lease
        s.leases[lease.id] = lease
        self.counters["get_blocks"] += n
        self.counters["get_bytes"] += n * ns.block_nbytes
        self.counters["hits_dram"] += sum(1 for t in sources[:n] if t == TIER_DRAM)
        self.counters["hits_flash"] += sum(1 for t in sources[:n] if t == TIER_FLASH)
        self.counters["misses"] += len(keys) - n
        return lease, sources[:n]

    def release(self, s: Session, lease_ids: Sequence[int]) -> list[bool]:
        out = []
        for lid in lease_ids:
            lease = s.leases.get(lid)
            if lease is None:
                out.append(False)  # expired (and already unpinned) or never existed
                continue
            out.append(lease.valid and time.monotonic() <= lease.expires)
            self._end_lease(lease, valid=False)
        return out

    def lease(self, s: Session, lease_id: int) -> Lease:
        lease = s.leases.get(lease_id)
        if lease is None or not lease.valid or time.monotonic() > lease.expires:
            raise Expired(
                f"lease {lease_id} is unknown or expired (leases live "
                f"{self.cfg.service.lease_ttl_s:g} s); acquire again"
            )
        return lease

    def _grant_ended(self, grant_id: int) -> None:
        """An allocation or lease ended: transports revoke the client's access to its
        slots (RDMA memory windows) before the slots can be freed or reused."""
        for hook in self.on_grant_end:
            try:
                hook(grant_id)
            except Exception:
                log.exception("revoking access to grant %d failed", grant_id)

    def _end_lease(self, lease: Lease, valid: bool) -> None:
        self._grant_ended(lease.id)
        lease.valid = valid
        self.leases.pop(lease.id, None)
        sess = self.sessions.get(lease.session_id)
        if sess is not None:
            sess.leases.pop(lease.id, None)
        for b in lease.blocks:
            self._unpin(b)
        lease.blocks = []

    def _unpin(self, b: Block) -> None:
        b.pins -= 1
        assert b.pins >= 0, f"block {b.key.hex()[:16]} unpinned more often than pinned"
        if b.pins == 0 and b.deleted and b.io is None:
            self._release_storage(b)

    # -- prefetch, delete, evict -----------------------------------------------------
    async def prefetch(self, ns: Namespace, keys: Sequence[bytes]) -> tuple[int, int]:
        validate_keys(keys)
        per_ns = self.index.get(ns.digest, {})
        cold = [b for k in keys if (b := per_ns.get(k)) is not None and b.dram is None]
        in_dram = sum(1 for k in keys if (b := per_ns.get(k)) is not None and b.dram is not None)
        if cold:
            for b in cold:
                b.pins += 1

            async def run() -> None:
                try:
                    await self._promote(ns, cold)
                except Exception as exc:
                    log.info("prefetch of %d blocks stopped: %s", len(cold), exc)
                finally:
                    for b in cold:
                        self._unpin(b)

            self._tasks.append(asyncio.create_task(run()))
            self._tasks = [t for t in self._tasks if not t.done()]
            self.counters["prefetch_blocks"] += len(cold)
        return len(cold), in_dram

    async def delete(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """Remove ``keys``; returns how many were stored. When this returns, the deleted
        blocks' flash headers are zeroed and synced: a restart cannot bring them back."""
        validate_keys(keys)
        per_ns = self.index.get(ns.digest, {})
        gone = [b for k in keys if (b := per_ns.pop(k, None)) is not None]
        for b in gone:
            b.deleted = True
            b.pins += 1  # ours until the header is dead; the last unpin frees the storage
            self.dram_lru.remove(b)
            self.flash_lru.remove(b)
            self._dirty.pop(b, None)
        try:
            faults.point("delete.after_index")
            await self._wait_io(gone)  # a demotion in flight finishes (and sets b.flash)
            dead = [b.flash for b in gone if b.flash is not None]
            for b in gone:
                b.flash = None
            if dead:
                await self._invalidate(dead, stage="delete")
        finally:
            for b in gone:
                self._unpin(b)
        self.counters["deleted_blocks"] += len(gone)
        return len(gone)

    async def evict(self, ns: Namespace, keys: Sequence[bytes], tier: str) -> int:
        """Drop DRAM copies of ``keys`` after making sure they are durable on flash."""
        validate_keys(keys)
        if tier != TIER_DRAM:
            raise InvalidArgument(f"evict supports tier 'dram' only, got {tier!r}")
        if not self.flash.enabled:
            raise InvalidArgument("evict to flash needs a flash tier; none is configured")
        per_ns = self.index.get(ns.digest, {})
        blocks = [b for k in keys if (b := per_ns.get(k)) is not None and b.dram is not None]
        await self._wait_io(blocks)
        await self._demote([b for b in blocks if b.flash is None])
        # Some may have been taken by a background demotion meanwhile: let it finish.
        await self._wait_io(blocks)
        faults.point("evict.after_demote")
        n = 0
        for b in blocks:
            if b.dram is not None and b.flash is not None and b.durable and b.pins == 0:
                self._drop_dram(b)
                n += 1
        return n

    # -- storage primitives ----------------------------------------------------------
    def _spawn(self, coro: Any) -> None:
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.create_task(coro))

    def _release_storage(self, b: Block) -> None:
        """Free a deleted block's DRAM slot and flash extent. ``delete`` zeroed the flash
        header already and cleared ``b.flash``; a header still named here is zeroed first."""
        if b.dram is not None:
            self.dram.free(b.dram)
            b.dram = None
        if b.flash is not None:
            ext = b.flash
            b.flash = None
            self._spawn(self._invalidate([ext]))

    async def _invalidate(self, extents: list[Extent], stage: str = "", free: bool = True
                          ) -> bool:
        """Zero the headers of ``extents``, sync, then (``free``) return them to the
        allocator. An extent is never freed while its header may still hold a record: on a
        device error its extents wait in ``_needs_zero`` until the device is healthy
        again (the reaper retries). Returns whether every header is now dead."""
        by_dev: dict[int, list[Extent]] = {}
        for ext in extents:
            by_dev.setdefault(ext.device, []).append(ext)

        def zero() -> dict[int, BaseException]:
            failed: dict[int, BaseException] = {}
            for d, exts in by_dev.items():
                dev = self.flash.devices[d]
                try:
                    if not dev.healthy:
                        raise FlashIOError(5, f"flash device {dev.name!r} is marked failed")
                    for ext in exts:
                        dev.invalidate(ext.slot)
                except FlashIOError as exc:
                    failed[d] = exc
            return failed

        def sync(devs: list[int]) -> dict[int, BaseException]:
            failed: dict[int, BaseException] = {}
            for d in devs:
                try:
                    self.flash.devices[d].sync()
                except FlashIOError as exc:
                    failed[d] = exc
            return failed

        if free:
            self._in_flight.update(extents)
        try:
            failed = await self._io(zero)
            if stage:
                faults.point(f"{stage}.after_zero")
            failed.update(await self._io(sync, [d for d in by_dev if d not in failed]))
            if stage:
                faults.point(f"{stage}.after_sync")
        finally:
            if free:
                self._in_flight.subtract(extents)
                self._in_flight = +self._in_flight
        for d, exc in failed.items():
            log.error("invalidating %d flash records on %s failed: %s", len(by_dev[d]),
                      self.flash.devices[d].name, exc)
            self._mark_unhealthy(d, exc)
            if free:
                self._needs_zero.setdefault(d, []).extend(by_dev[d])
        if free:
            for d, exts in by_dev.items():
                if d not in failed:
                    for ext in exts:
                        self.flash.free(ext)
        return not failed

    def _drop_dram(self, b: Block) -> None:
        assert b.dram is not None and b.pins == 0
        self.dram.free(b.dram)
        b.dram = None
        self.dram_lru.remove(b)
        self._dirty.pop(b, None)
        self.counters["evictions_dram"] += 1
        if b.flash is None:
            self._forget(b)

    def _forget(self, b: Block) -> None:
        per_ns = self.index.get(b.ns)
        if per_ns is not None and per_ns.get(b.key) is b:
            del per_ns[b.key]
        self.dram_lru.remove(b)
        self.flash_lru.remove(b)

    async def _wait_io(self, blocks: Iterable[Block]) -> None:
        pending = [b.io for b in blocks if b.io is not None]
        if pending:
            await asyncio.wait(pending)

    async def _reserve_dram(self, ns: Namespace, n: int) -> list[SlotRef]:
        """``n`` DRAM slots for ``ns``, evicting (demoting first if needed) to make room."""
        if n == 0:
            return []
        refs = self.dram.allocate(ns.slot_size, n, ns.tenant)
        if refs is not None:
            return refs
        capacity = self.dram.num_slabs * (self.cfg.dram.slab_size // ns.slot_size)
        if n > capacity:
            raise ResourceExhausted(
                f"a batch of {n} blocks needs more DRAM than the tier holds ({capacity} "
                f"blocks of {ns.slot_size} bytes); send smaller batches or raise dram.size"
            )
        for _round in range(3):
            need_demote: list[Block] = []
            usable = self._flash_usable()
            for b in self.dram_lru.victims(skip=lambda b: b.pins > 0 or b.io is not None):
                if b.flash is not None and b.durable:
                    self._drop_dram(b)
                elif usable:
                    need_demote.append(b)
                    if len(need_demote) >= max(n, self.cfg.flash.demote_batch):
                        break
                    continue
                else:
                    # No flash to demote to (none configured, or every device failed):
                    # the tier degrades to a DRAM-only cache and drops its LRU block.
                    if b in self._dirty:
                        self.counters["dirty_dropped"] += 1
                    self._drop_dram(b)
                refs = self.dram.allocate(ns.slot_size, n, ns.tenant)
                if refs is not None:
                    return refs
            if not need_demote:
                break
            await self._demote(need_demote)
            for b in need_demote:
                if b.dram is not None and b.flash is not None and b.pins == 0 and b.io is None:
                    self._drop_dram(b)
            refs = self.dram.allocate(ns.slot_size, n, ns.tenant)
            if refs is not None:
                return refs
        self.counters["dram_full"] += 1
        raise ResourceExhausted(
            f"DRAM tier full: {n} slots of {ns.slot_size} bytes for tenant {ns.tenant!r} "
            f"cannot be freed (blocks are leased, or flash is full or failing); retry later "
            f"or raise dram.size"
        )

    def _flash_usable(self) -> bool:
        return any(d.healthy for d in self.flash.devices)

    async def _reserve_flash(self, slot_size: int, n: int) -> list[Extent] | None:
        """``n`` extents of ``slot_size``, evicting flash blocks (LRU) to make room.

        A victim's header is zeroed and synced before its extent is freed, so a crash or
        power cut can never bring an evicted block back over an extent reused since, and
        a later delete of the key never misses a copy on flash."""
        for _round in range(3):
            exts = self.flash.allocate(slot_size, n)
            if exts is not None:
                return exts
            room = self._flash_room(slot_size)
            per_slab: Counter[tuple[int, int]] = Counter()
            evicted: list[Extent] = []
            # Never evict from a failed device: that frees no usable space, it only drops
            # blocks that come back when the device does.
            for b in self.flash_lru.victims(skip=lambda b: b.pins > 0 or b.io is not None or (
                    b.flash is not None and not self.flash.devices[b.flash.device].healthy)):
                if room >= n:
                    break
                assert b.flash is not None
                ext = b.flash
                b.flash = None
                b.durable = False
                self.flash_lru.remove(b)
                self.counters["evictions_flash"] += 1
                if b.dram is None:
                    self._forget(b)
                else:
                    self._dirty[b] = None
                evicted.append(ext)
                dev = self.flash.devices[ext.device]
                slab = dev.alloc.slabs[ext.slot.slab]
                if slab.klass == slot_size:
                    room += 1
                else:
                    per_slab[(ext.device, ext.slot.slab)] += 1
                    if per_slab[(ext.device, ext.slot.slab)] == slab.used:
                        room += slots_per_slab(dev.slab_size, slot_size)
            if not evicted:
                return None
            await self._invalidate(evicted, stage="flash_evict")
        return self.flash.allocate(slot_size, n)

    def _flash_room(self, slot_size: int) -> int:
        room = 0
        for dev in self.flash.devices:
            if dev.healthy:
                per = slots_per_slab(dev.slab_size, slot_size)
                room += dev.alloc.free_slots(slot_size) + dev.alloc.free_slabs * per
        return room

    async def _demote(self, blocks: list[Block]) -> None:
        """Write DRAM-only blocks to flash and make them durable.

        Write ordering (docs/reliability.md): payloads → fdatasync → headers → fdatasync.
        A header therefore never reaches stable storage before its payload, so after a
        crash or power cut every valid header on flash names a complete payload; a block
        is durable (and its extent recorded in the index) only after the second sync.
        """
        blocks = [b for b in blocks
                  if b.dram is not None and b.flash is None and not b.deleted and b.io is None]
        if not blocks or not self.flash.enabled:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        for b in blocks:  # claimed before any await: no concurrent demotion takes them
            b.pins += 1
            b.io = fut
        plan: list[tuple[Block, Extent]] = []
        jobs: list[tuple[FlashDevice, SlotRef, RecordHeader, memoryview, Any]] = []
        results: list[BaseException | None] = []
        ok = False
        try:
            by_size: dict[int, list[Block]] = {}
            for b in blocks:
                by_size.setdefault(b.slot_size, []).append(b)
            for size, group in by_size.items():
                exts = await self._reserve_flash(size, len(group))
                if exts is None:
                    self.counters["flash_full"] += 1
                    now = time.monotonic()
                    if now >= self._flash_full_logged + FLASH_FULL_LOG_INTERVAL_S:
                        self._flash_full_logged = now
                        log.warning("flash tier full: %d blocks stay in DRAM only (counted in "
                                    "flash_full; logged at most every %g s)", len(group),
                                    FLASH_FULL_LOG_INTERVAL_S)
                    continue
                plan.extend(zip(group, exts, strict=True))
                self._in_flight.update(exts)
            for b, ext in plan:
                assert b.dram is not None
                header = RecordHeader(b.ns, b.key, b.length, b.crc, b.seq,
                                      self._cipher(b.ns) is not None, time.time_ns())
                jobs.append((self.flash.devices[ext.device], ext.slot, header,
                             self.dram.slot_view(b.dram), self._cipher(b.ns)))
            if jobs:
                faults.point("demote.before_write")
                results = await self._write_records(jobs)
            ok = True
        finally:
            for job in jobs:
                job[3].release()
            fut.set_result(None)
            self._in_flight.subtract(ext for _b, ext in plan)
            self._in_flight = +self._in_flight
            if not ok:  # cancelled or failed before the records were written
                for _b, ext in plan:
                    self._needs_zero.setdefault(ext.device, []).append(ext)
                for b in blocks:
                    b.io = None
                    self._unpin(b)
        written = 0
        for (b, ext), err in zip(plan, results or [None] * len(plan), strict=True):
            if err is not None:
                self.counters["flash_write_errors"] += 1
                # The header may or may not have landed: zero it before reuse.
                self._needs_zero.setdefault(ext.device, []).append(ext)
                self._mark_unhealthy(ext.device, err)
            else:
                # Durable. A block deleted meanwhile keeps its extent until ``delete``
                # (waiting on ``b.io``) zeroes the header.
                b.flash = ext
                if not b.deleted:
                    b.durable = True
                    self._dirty.pop(b, None)
                    self.flash_lru.add(b, b.hits)
                    written += 1
                    self.counters["demoted_bytes"] += b.length
        for b in blocks:
            b.io = None
            self._unpin(b)
        self.counters["demoted_blocks"] += written
        self._check_slow({ext.device for _b, ext in plan})

    async def _write_records(self, jobs: list[Any]) -> list[BaseException | None]:
        """The four I/O phases of a demotion; one result per job (None: durable)."""

        def payloads(part: list[Any]) -> list[BaseException | None]:
            out: list[BaseException | None] = []
            for dev, slot, _header, view, cipher in part:
                try:
                    dev.write_payload(slot, view, cipher)
                    out.append(None)
                except (FlashIOError, ValueError) as exc:
                    out.append(exc)
            return out

        def headers(part: list[Any]) -> list[BaseException | None]:
            out: list[BaseException | None] = []
            for (dev, slot, header, _view, _cipher), err in part:
                if err is not None:
                    out.append(err)
                    continue
                try:
                    dev.write_header(slot, header)
                    out.append(None)
                except (FlashIOError, ValueError) as exc:
                    out.append(exc)
            return out

        def sync(devs: list[FlashDevice]) -> dict[FlashDevice, BaseException]:
            failed: dict[FlashDevice, BaseException] = {}
            for dev in devs:
                try:
                    dev.sync()
                except FlashIOError as exc:
                    failed[dev] = exc
            return failed

        async def synced(results: list[BaseException | None]) -> list[BaseException | None]:
            # A sync failure fails every write on that device.
            devs = list({j[0] for j, r in zip(jobs, results, strict=True) if r is None})
            failed = await self._io(sync, devs)
            return [failed.get(j[0], r) if r is None else r
                    for j, r in zip(jobs, results, strict=True)]

        results = await self._io_parallel(payloads, jobs)
        faults.point("demote.after_payload")
        results = await synced(results)
        faults.point("demote.after_payload_sync")
        results = await self._io_parallel(headers, list(zip(jobs, results, strict=True)))
        faults.point("demote.after_header")
        results = await synced(results)
        faults.point("demote.after_sync")
        return results

    def _check_slow(self, devices: Iterable[int]) -> None:
        for d in devices:
            dev = self.flash.devices[d]
            if dev.slow_ios > self._slow_seen.get(d, 0):
                self._slow_seen[d] = dev.slow_ios
                self._mark_unhealthy(d, FlashIOError(
                    0, f"I/O slower than {flash_mod.SLOW_IO_S:g} s"), reason="slow")

    def _mark_unhealthy(self, device: int, err: BaseException, reason: str = "failed"
                        ) -> None:
        dev = self.flash.devices[device]
        if dev.healthy:
            log.error("flash device %s %s (%s); serving from DRAM without it", dev.name,
                      reason, err)
            dev.healthy = False
            dev.health_reason = reason
            self.counters["flash_device_failures"] += 1

    class _PromoteResult:
        def __init__(self) -> None:
            self.failed: set[int] = set()

    async def _promote(self, ns: Namespace, blocks: list[Block]) -> BlockStore._PromoteResult:
        """Bring flash-only blocks into DRAM, verifying each; failures end up in ``failed``.

        Callers pin ``blocks`` beforehand. A block whose record fails a check is removed
        from the index and its extent quarantined: it is a miss from now on. When the
        failing device's superblock is no longer its own (swapped), the device is marked
        failed instead and nothing on it is touched.
        """
        result = BlockStore._PromoteResult()
        await self._wait_io(blocks)
        blocks = [b for b in blocks if b.dram is None and b.flash is not None and not b.deleted]
        if not blocks:
            return result
        refs = await self._reserve_dram(ns, len(blocks))
        # Deleted or promoted by someone else while DRAM was being made: skip those.
        keep = [b.dram is None and b.flash is not None and not b.deleted and b.io is None
                for b in blocks]
        for ref, k in zip(refs, keep, strict=True):
            if not k:
                self.dram.free(ref)
        refs = [r for r, k in zip(refs, keep, strict=True) if k]
        blocks = [b for b, k in zip(blocks, keep, strict=True) if k]
        if not blocks:
            return result
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        jobs = []
        for b, ref in zip(blocks, refs, strict=True):
            assert b.flash is not None
            b.io = fut
            jobs.append((self.flash.devices[b.flash.device], b.flash.slot, self.dram.slot_view(ref),
                         b, self._cipher(b.ns)))
        block_nbytes = ns.block_nbytes

        def headers(part: list[Any]) -> list[RecordHeader | FlashIOError | None]:
            """The part's record headers, read per device in runs of its header tables
            (FlashDevice.read_headers): a few I/Os instead of one per block."""
            got: list[RecordHeader | FlashIOError | None] = [None] * len(part)
            by_dev: dict[FlashDevice, list[int]] = {}
            for i, job in enumerate(part):
                if job[0].healthy:
                    by_dev.setdefault(job[0], []).append(i)
            for dev, idx in by_dev.items():
                for i, h in zip(idx, dev.read_headers([part[i][1] for i in idx]), strict=True):
                    got[i] = h
            return got

        def work(part: list[Any]) -> list[BaseException | None]:
            out: list[BaseException | None] = [None] * len(part)
            identity: dict[FlashDevice, FlashIOError | None] = {}

            def failed(dev: FlashDevice, exc: ReadFailure) -> BaseException:
                # Is it the record, or is the whole device not ours any more?
                if dev not in identity:
                    try:
                        dev.check_identity()
                        identity[dev] = None
                    except FlashIOError as id_exc:
                        identity[dev] = id_exc
                return identity[dev] or exc

            # Check every header first; then read the payloads of the blocks that passed,
            # per device in device order, adjacent ones by one I/O (read_payloads).
            ready: list[int] = []
            for i, ((dev, _slot, _view, b, cipher), hdr) in enumerate(
                    zip(part, headers(part), strict=True)):
                try:
                    if not dev.healthy:
                        raise FlashIOError(5, f"flash device {dev.name!r} is marked failed")
                    if isinstance(hdr, FlashIOError):
                        raise hdr
                    if b.length != block_nbytes:
                        raise ReadFailure("record length does not match the namespace's "
                                          "block size", ours=True)
                    dev.check_header(hdr, b.ns, b.key, b.length, b.crc, b.seq, cipher)
                    ready.append(i)
                except ReadFailure as exc:
                    out[i] = failed(dev, exc)
                except (FlashIOError, ValueError) as exc:
                    out[i] = exc
            groups: dict[tuple[FlashDevice, XtsCipher | None], list[int]] = {}
            for i in ready:
                groups.setdefault((part[i][0], part[i][4]), []).append(i)
            for (dev, cipher), group in groups.items():
                got = dev.read_payloads([(part[i][1], part[i][2], part[i][3].length,
                                          part[i][3].crc) for i in group], cipher)
                for i, err in zip(group, got, strict=True):
                    out[i] = failed(dev, err) if isinstance(err, ReadFailure) else err
            return out

        try:
            results = await self._io_parallel(work, jobs)
            faults.point("promote.after_read")
        finally:
            for job in jobs:
                job[2].release()
            fut.set_result(None)
        dead: list[Extent] = []
        for (dev, _slot, _v, b, _c), ref, err in zip(jobs, refs, results, strict=True):
            b.io = None
            if err is None and not b.deleted:
                b.dram = ref
                self.dram_lru.add(b, b.hits)
                self.counters["promoted_blocks"] += 1
                continue
            self.dram.free(ref)
            result.failed.add(id(b))
            if isinstance(err, ReadFailure):
                self.counters["integrity_failures"] += 1
                self.counters["quarantined_extents"] += 1
                log.warning("block %s on %s failed its check (%s): quarantined, served as miss",
                            b.key.hex()[:16], dev.name, err.reason)
                assert b.flash is not None
                self.flash.quarantine(b.flash)
                self.flash.free(b.flash)
                if err.ours:
                    dead.append(b.flash)  # its own record, bad payload: zero the header
                b.flash = None
                self._forget(b)
            elif err is not None:
                self.counters["flash_read_errors"] += 1
                reason = ("truncated" if isinstance(err, ShortRead) else
                          "swapped or unreadable" if "superblock" in str(err) else "failed")
                self._mark_unhealthy(dev.index, err, reason)
        if dead:
            self._spawn(self._invalidate(dead, free=False))
        self._check_slow({j[0].index for j in jobs})
        return result

    # -- background ------------------------------------------------------------------
    async def _demoter(self) -> None:
        # Polls every 20 ms instead of waiting on an Event under wait_for: cancelling a
        # task blocked in wait_for(Event.wait()) can hang on CPython 3.11 at shutdown.
        # While no device is healthy it does not try at all (the reaper's probe brings
        # devices back); while it makes no progress (flash full of pinned blocks) it
        # backs off to DEMOTE_BACKOFF_MAX_S between tries.
        pause = DEMOTE_POLL_S
        while not self._closed:
            await asyncio.sleep(pause)
            if not any(d.healthy for d in self.flash.devices):
                continue
            while self._dirty and self.flash.enabled and not self._closed:
                batch = list(itertools.islice(self._dirty, self.cfg.flash.demote_batch))
                before = len(self._dirty)
                try:
                    await self._demote(batch)
                except Exception:
                    log.exception("background demotion failed")
                    break
                if len(self._dirty) >= before:  # no progress (flash full or failing)
                    pause = min(DEMOTE_BACKOFF_MAX_S, pause * 2 ** 4)
                    break
                pause = DEMOTE_POLL_S

    async def _usable_again(self, dev: FlashDevice) -> bool:
        """Probe a failed device where it is; if that fails and the device has a locator,
        ask where it is now and, when it moved (a new block node), reopen it there (its
        superblock UUID must match) and probe again."""
        try:
            await self._io(dev.probe)
            await self._io(dev.scrub_slab_headers)
            return True
        except FlashIOError:
            locate = self.locators.get(dev.name)
            if locate is None:
                return False
        loop = asyncio.get_running_loop()
        try:  # the default executor: a slow attach must not hold an I/O thread
            path = await asyncio.wait_for(loop.run_in_executor(None, locate),
                                          LOCATE_TIMEOUT_S)
        except Exception as exc:
            log.debug("flash device %s: not found yet (%s)", dev.name, exc)
            return False
        if not path or path == dev.path:
            return False
        try:
            await self._io(dev.reopen, path)
            await self._io(dev.probe)
            await self._io(dev.scrub_slab_headers)
        except FlashIOError as exc:
            log.warning("flash device %s: found at %s but not usable: %s", dev.name, path, exc)
            return False
        self.counters["flash_device_reopened"] += 1
        return True

    async def _reaper(self) -> None:
        """Expire allocations and leases; re-probe failed flash devices."""
        probe_at = 0.0
        while True:
            await asyncio.sleep(min(0.2, PROBE_INTERVAL_S))
            now = time.monotonic()
            for a in [a for a in self.allocations.values() if a.expires < now and not a.done]:
                self.counters["expired_allocations"] += 1
                self._drop_allocation(a)
            for lease in [lease for lease in self.leases.values() if lease.expires < now]:
                self.counters["expired_leases"] += 1
                self._end_lease(lease, valid=False)
            if now >= probe_at:
                probe_at = now + PROBE_INTERVAL_S
                for dev in self.flash.devices:
                    if not dev.healthy:
                        if not await self._usable_again(dev):
                            continue
                        dev.healthy = True
                        dev.health_reason = ""
                        self._slow_seen[dev.index] = dev.slow_ios
                        self.counters["flash_device_recoveries"] += 1
                        log.info("flash device %s is healthy again", dev.name)
            for d in list(self._needs_zero):
                # Extents a failed write or invalidation left behind: zero their headers,
                # then free them, once their device works.
                if self.flash.devices[d].healthy:
                    await self._invalidate(self._needs_zero.pop(d))

    # -- consistency -----------------------------------------------------------------
    def audit(self) -> list[str]:
        """Cross-check the index against the flash allocators (tests): every extent the
        index names is allocated, to a slab of the block's slot size, and named once;
        every allocated slot is accounted for (an indexed block, a quarantined slot, one
        parked until its header is zeroed, or one a demotion or invalidation has in
        flight). Call it on the event loop between awaits. Returns the problems found
        (empty: sound)."""
        problems: list[str] = []
        owners: dict[Extent, Block] = {}
        for per_ns in self.index.values():
            for b in per_ns.values():
                if b.flash is None:
                    continue
                other = owners.get(b.flash)
                if other is not None:
                    problems.append(f"extent {b.flash} is named by {other.key.hex()[:16]} and "
                                    f"{b.key.hex()[:16]}: allocated twice")
                owners[b.flash] = b
                dev = self.flash.devices[b.flash.device]
                slab = dev.alloc.slabs[b.flash.slot.slab]
                if slab.klass != b.slot_size:
                    problems.append(f"extent {b.flash} of a {b.slot_size}-byte block lies in a "
                                    f"slab of class {slab.klass}")
                elif b.flash.slot.index in slab.free:
                    problems.append(f"extent {b.flash} is in use but free in the allocator")
        for dev in self.flash.devices:
            used = dev.alloc.used_slots()
            named = sum(1 for e in owners if e.device == dev.index)
            parked = len(self._needs_zero.get(dev.index, ()))
            quarantined = len(dev.alloc.quarantined)
            moving = sum(n for e, n in self._in_flight.items() if e.device == dev.index)
            accounted = named + parked + quarantined + moving
            if used != accounted:
                problems.append(f"device {dev.name}: {used} slots allocated, but {named} "
                                f"indexed + {parked} parked + {quarantined} quarantined + "
                                f"{moving} in flight (leak of {used - accounted})")
        return problems

    # -- stats -----------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {k: float(v) for k, v in self.counters.items()}
        out.update(
            blocks=float(sum(len(v) for v in self.index.values())),
            blocks_dram=float(len(self.dram_lru)),
            blocks_flash=float(len(self.flash_lru)),
            dram_used_bytes=float(self.dram.used_bytes()),
            dram_capacity_bytes=float(self.dram.capacity_bytes()),
            flash_used_bytes=float(self.flash.used_bytes()),
            flash_capacity_bytes=float(self.flash.capacity_bytes()),
            leases=float(len(self.leases)),
            allocations=float(len(self.allocations)),
            sessions=float(len(self.sessions)),
            dirty_blocks=float(len(self._dirty)),
            flash_quarantined_slots=float(sum(len(d.alloc.quarantined)
                                              for d in self.flash.devices)),
            flash_devices_healthy=float(sum(d.healthy for d in self.flash.devices)),
        )
        return out
