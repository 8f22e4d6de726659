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
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
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
from ctxmem_dpu.alloc import SlotRef
from ctxmem_dpu.blocks import Allocation, Block, Lease, Namespace, Session
from ctxmem_dpu.policy import SegmentedLRU
from ctxmem_dpu.tiers.dram import DramTier, round_up
from ctxmem_dpu.tiers.flash import Extent, FlashDevice, FlashIOError, FlashTier, ReadFailure
from ctxmem_dpu.tiers.flash_format import RecordHeader

log = logging.getLogger(__name__)
T = TypeVar("T")

TIER_DRAM = "dram"
TIER_FLASH = "flash"

# Every counter the store keeps; all are reported (as 0 until they move) by Stats and
# /metrics, so dashboards and tests see the same names from the start.
COUNTERS = (
    "lookup_keys", "lookup_hits", "put_blocks", "put_bytes", "put_crc_mismatch",
    "get_blocks", "get_bytes", "hits_dram", "hits_flash", "misses", "prefetch_blocks",
    "promoted_blocks", "promote_no_space", "demoted_blocks", "demoted_bytes",
    "evictions_dram", "evictions_flash", "deleted_blocks", "integrity_failures",
    "flash_read_errors", "flash_write_errors", "flash_device_failures", "flash_full",
    "dram_full", "expired_allocations", "expired_leases", "recovered_blocks",
    "recovery_seconds_x1e6",
)


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
        self._ids = itertools.count(1)
        self._seq = itertools.count(1)
        self._ciphers: dict[bytes, XtsCipher | None] = {}
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, cfg.service.io_threads), thread_name_prefix="ctxmem-io"
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
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
        """Rebuild the index from the self-describing records on every flash device."""
        t0 = time.perf_counter()
        found = 0
        max_seq = 0
        for dev in self.flash.devices:
            records = await self._io(lambda d=dev: list(d.scan()))
            for slot, slot_size, rec in records:
                found += 1
                max_seq = max(max_seq, rec.seq)
                ext = Extent(dev.index, slot)
                dev.alloc.claim(slot_size, slot_size, slot)
                per_ns = self.index.setdefault(rec.namespace, {})
                old = per_ns.get(rec.key)
                if old is not None:
                    # Two records for one key (a crash between rewriting and invalidating):
                    # the newer sequence number wins; the other extent is recycled.
                    loser, winner_rec = (old, rec) if old.seq < rec.seq else (None, None)
                    if loser is None:
                        await self._io(dev.invalidate, slot)
                        dev.alloc.free(slot)
                        continue
                    self.flash_lru.remove(loser)
                    assert loser.flash is not None
                    lose_dev = self.flash.devices[loser.flash.device]
                    await self._io(lose_dev.invalidate, loser.flash.slot)
                    self.flash.free(loser.flash)
                    del per_ns[rec.key]
                    rec = winner_rec
                assert rec is not None
                b = Block(rec.namespace, rec.key, rec.length, slot_size, rec.crc, rec.seq,
                          flash=ext, durable=True)
                per_ns[rec.key] = b
                self.flash_lru.add(b)
        self._seq = itertools.count(max_seq + 1)
        self.counters["recovered_blocks"] = sum(len(v) for v in self.index.values())
        self.counters["recovery_seconds_x1e6"] = int((time.perf_counter() - t0) * 1e6)
        if found:
            log.info("rebuilt index from flash: %d blocks in %.3f s",
                     self.counters["recovered_blocks"], time.perf_counter() - t0)

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
        # The allocation stays registered while its CRCs are computed so the reaper
        # cannot recycle its slots underneath; then it is retired.
        a.done = True
        views = [self.dram.view(ref, a.ns.block_nbytes) for ref in a.slots]
        crcs = await self._io(lambda: [crc32c(v) for v in views])
        for v in views:
            v.release()
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
        if not self.flash.enabled:
            return len(committed)
        if self.cfg.flash.write_policy == "write_through":
            await self._demote(committed)
        else:
            for b in committed:
                self._dirty[b] = None
        return len(committed)

    def _forget_allocation(self, a: Allocation) -> None:
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

    def _end_lease(self, lease: Lease, valid: bool) -> None:
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
        validate_keys(keys)
        per_ns = self.index.get(ns.digest, {})
        gone = [b for k in keys if (b := per_ns.pop(k, None)) is not None]
        to_invalidate = []
        for b in gone:
            b.deleted = True
            self.dram_lru.remove(b)
            self.flash_lru.remove(b)
            self._dirty.pop(b, None)
            if b.pins == 0 and b.io is None:
                if b.flash is not None:
                    to_invalidate.append(b.flash)
                    b.flash = None
                self._release_storage(b)
        if to_invalidate:
            await self._invalidate(to_invalidate)
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
        n = 0
        for b in blocks:
            if b.dram is not None and b.flash is not None and b.durable and b.pins == 0:
                self._drop_dram(b)
                n += 1
        return n

    # -- storage primitives ----------------------------------------------------------
    def _release_storage(self, b: Block) -> None:
        """Free a deleted block's DRAM slot and flash extent (header already invalid)."""
        if b.dram is not None:
            self.dram.free(b.dram)
            b.dram = None
        if b.flash is not None:
            ext = b.flash
            b.flash = None
            self._tasks.append(asyncio.create_task(self._invalidate([ext])))

    async def _invalidate(self, extents: list[Extent]) -> None:
        def work() -> None:
            touched = set()
            for ext in extents:
                dev = self.flash.devices[ext.device]
                dev.invalidate(ext.slot)
                touched.add(dev)
            for dev in touched:
                dev.sync()

        try:
            await self._io(work)
        except FlashIOError as exc:
            log.error("invalidating %d flash records failed: %s", len(extents), exc)
            for ext in extents:
                self.flash.quarantine(ext)  # cannot prove they are dead: never reuse
        for ext in extents:
            self.flash.free(ext)

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
        refs = self.dram.allocate(ns.tenant, ns.slot_size, n)
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
            for b in self.dram_lru.victims(skip=lambda b: b.pins > 0 or b.io is not None):
                if b.flash is not None and b.durable:
                    self._drop_dram(b)
                elif self.flash.enabled:
                    need_demote.append(b)
                    if len(need_demote) >= max(n, self.cfg.flash.demote_batch):
                        break
                    continue
                else:
                    self._drop_dram(b)
                refs = self.dram.allocate(ns.tenant, ns.slot_size, n)
                if refs is not None:
                    return refs
            if not need_demote:
                break
            await self._demote(need_demote)
            for b in need_demote:
                if b.dram is not None and b.flash is not None and b.pins == 0 and b.io is None:
                    self._drop_dram(b)
            refs = self.dram.allocate(ns.tenant, ns.slot_size, n)
            if refs is not None:
                return refs
        self.counters["dram_full"] += 1
        raise ResourceExhausted(
            f"DRAM tier full: {n} slots of {ns.slot_size} bytes for tenant {ns.tenant!r} "
            f"cannot be freed (blocks are leased, or flash is full or failing); retry later "
            f"or raise dram.size"
        )

    def _reserve_flash(self, slot_size: int, n: int) -> list[Extent] | None:
        exts = self.flash.allocate(slot_size, n)
        if exts is not None:
            return exts
        # Never evict from a failed device: that frees no usable space, it only drops
        # blocks that come back when the device does.
        for b in self.flash_lru.victims(skip=lambda b: b.pins > 0 or b.io is not None or (
                b.flash is not None and not self.flash.devices[b.flash.device].healthy)):
            assert b.flash is not None
            ext = b.flash
            b.flash = None
            b.durable = False
            self.flash_lru.remove(b)
            self.counters["evictions_flash"] += 1
            # No header invalidation: a restart may bring the block back, which is
            # correct data under its key; a newer record for the key wins by sequence.
            self.flash.free(ext)
            if b.dram is None:
                self._forget(b)
            else:
                self._dirty[b] = None
            exts = self.flash.allocate(slot_size, n)
            if exts is not None:
                return exts
        return None

    async def _demote(self, blocks: list[Block]) -> None:
        """Write DRAM-only blocks to flash and make them durable."""
        blocks = [b for b in blocks
                  if b.dram is not None and b.flash is None and not b.deleted and b.io is None]
        if not blocks or not self.flash.enabled:
            return
        by_size: dict[int, list[Block]] = {}
        for b in blocks:
            by_size.setdefault(b.slot_size, []).append(b)
        plan: list[tuple[Block, Extent]] = []
        for size, group in by_size.items():
            exts = self._reserve_flash(size, len(group))
            if exts is None:
                self.counters["flash_full"] += 1
                log.warning("flash tier full: %d blocks stay in DRAM only", len(group))
                continue
            plan.extend(zip(group, exts, strict=True))
        if not plan:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        jobs = []
        for b, ext in plan:
            b.pins += 1
            b.io = fut
            assert b.dram is not None
            header = RecordHeader(b.ns, b.key, b.length, b.crc, b.seq,
                                  self._cipher(b.ns) is not None, time.time_ns())
            jobs.append((self.flash.devices[ext.device], ext.slot, header,
                         self.dram.slot_view(b.dram), self._cipher(b.ns)))

        def write(part: list[Any]) -> list[BaseException | None]:
            out: list[BaseException | None] = []
            for dev, slot, header, view, cipher in part:
                try:
                    dev.write_record(slot, header, view, cipher)
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

        try:
            results = await self._io_parallel(write, jobs)
            # Durable only after the flush: a sync failure fails every write on that device.
            failed = await self._io(sync, list({j[0] for j, r in zip(jobs, results,
                                                                      strict=True) if r is None}))
            results = [failed.get(j[0], r) if r is None else r
                       for j, r in zip(jobs, results, strict=True)]
        finally:
            for _dev, _slot, _h, view, _c in jobs:
                view.release()
            fut.set_result(None)
        written = 0
        for (b, ext), err in zip(plan, results, strict=True):
            b.io = None
            if err is not None:
                self.counters["flash_write_errors"] += 1
                self.flash.free(ext)
                self._mark_unhealthy(ext.device, err)
            elif b.deleted:
                self._tasks.append(asyncio.create_task(self._invalidate([ext])))
            else:
                b.flash = ext
                b.durable = True
                self._dirty.pop(b, None)
                self.flash_lru.add(b, b.hits)
                written += 1
            self._unpin(b)
        self.counters["demoted_blocks"] += written
        self.counters["demoted_bytes"] += sum(b.length for b, _ in plan[:written])

    def _mark_unhealthy(self, device: int, err: BaseException) -> None:
        dev = self.flash.devices[device]
        if dev.healthy:
            log.error("flash device %s failed (%s); serving from DRAM without it", dev.name, err)
            dev.healthy = False
            self.counters["flash_device_failures"] += 1

    class _PromoteResult:
        def __init__(self) -> None:
            self.failed: set[int] = set()

    async def _promote(self, ns: Namespace, blocks: list[Block]) -> BlockStore._PromoteResult:
        """Bring flash-only blocks into DRAM, verifying each; failures end up in ``failed``.

        Callers pin ``blocks`` beforehand. A block whose record fails a check is removed
        from the index and its extent quarantined: it is a miss from now on.
        """
        result = BlockStore._PromoteResult()
        await self._wait_io(blocks)
        blocks = [b for b in blocks if b.dram is None and b.flash is not None and not b.deleted]
        if not blocks:
            return result
        refs = await self._reserve_dram(ns, len(blocks))
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        jobs = []
        for b, ref in zip(blocks, refs, strict=True):
            assert b.flash is not None
            b.io = fut
            jobs.append((self.flash.devices[b.flash.device], b.flash.slot, self.dram.slot_view(ref),
                         b, self._cipher(b.ns)))

        def work(part: list[Any]) -> list[BaseException | None]:
            out: list[BaseException | None] = []
            for dev, slot, view, b, cipher in part:
                try:
                    if not dev.healthy:
                        raise FlashIOError(5, f"flash device {dev.name!r} is marked failed")
                    dev.read_record(slot, view, b.ns, b.key, b.length, b.crc, b.seq, cipher)
                    out.append(None)
                except (ReadFailure, FlashIOError, ValueError) as exc:
                    out.append(exc)
            return out

        try:
            results = await self._io_parallel(work, jobs)
        finally:
            for job in jobs:
                job[2].release()
            fut.set_result(None)
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
                log.warning("block %s on %s failed its check (%s): quarantined, served as miss",
                            b.key.hex()[:16], dev.name, err.reason)
                assert b.flash is not None
                self.flash.quarantine(b.flash)
                self.flash.free(b.flash)
                b.flash = None
                self._forget(b)
            elif err is not None:
                self.counters["flash_read_errors"] += 1
                self._mark_unhealthy(dev.index, err)
        return result

    # -- background ------------------------------------------------------------------
    async def _demoter(self) -> None:
        # Polls every 20 ms instead of waiting on an Event under wait_for: cancelling a
        # task blocked in wait_for(Event.wait()) can hang on CPython 3.11 at shutdown.
        while not self._closed:
            await asyncio.sleep(0.02)
            while self._dirty and self.flash.enabled and not self._closed:
                batch = list(itertools.islice(self._dirty, self.cfg.flash.demote_batch))
                before = len(self._dirty)
                try:
                    await self._demote(batch)
                except Exception:
                    log.exception("background demotion failed")
                    break
                if len(self._dirty) >= before:  # no progress (flash full or failing)
                    break

    async def _reaper(self) -> None:
        """Expire allocations and leases; re-probe failed flash devices."""
        probe_at = 0.0
        while True:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            for a in [a for a in self.allocations.values() if a.expires < now and not a.done]:
                self.counters["expired_allocations"] += 1
                self._drop_allocation(a)
            for lease in [lease for lease in self.leases.values() if lease.expires < now]:
                self.counters["expired_leases"] += 1
                self._end_lease(lease, valid=False)
            if now >= probe_at:
                probe_at = now + 2.0
                for dev in self.flash.devices:
                    if not dev.healthy:
                        try:
                            await self._io(dev.probe)
                            dev.healthy = True
                            log.info("flash device %s is healthy again", dev.name)
                        except FlashIOError:
                            pass

    # -- stats -----------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {k: float(v) for k, v in self.counters.items()}
        out.update(
            blocks=float(sum(len(v) for v in self.index.values())),
            blocks_dram=float(len(self.dram_lru)),
            blocks_flash=float(len(self.flash_lru)),
            dram_used_bytes=float(self.dram.used_bytes()),
            dram_capacity_bytes=float(self.dram.capacity_bytes),
            flash_used_bytes=float(self.flash.used_bytes()),
            flash_capacity_bytes=float(self.flash.capacity_bytes()),
            leases=float(len(self.leases)),
            allocations=float(len(self.allocations)),
            sessions=float(len(self.sessions)),
            dirty_blocks=float(len(self._dirty)),
            flash_devices_healthy=float(sum(d.healthy for d in self.flash.devices)),
        )
        return out
