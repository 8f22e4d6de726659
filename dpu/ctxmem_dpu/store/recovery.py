"""Recovery and consistency: rebuilding the index from flash, verifying a record, the audit.

Flash records are self-describing (namespace, key, length, CRC32C, sequence number in each
header), so the index is never persisted: at start it is rebuilt by reading every used
slab's header table. The rebuild reads headers only, so it does not check authenticators
(that would read every payload): a record it indexes is verified, like every record, when
it is read (promotion; :meth:`Recovery.verify`). Records of format version 1 (no
authenticator) are not indexed: counted in ``flash_legacy_records``, logged once, their
slots free for reuse.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import mmap
import time
from collections import deque
from collections.abc import AsyncIterator
from itertools import repeat

from ctxmem_common.flash_format import TableColumns
from ctxmem_dpu import faults
from ctxmem_dpu.alloc import SlotRef
from ctxmem_dpu.blocks import Block
from ctxmem_dpu.keyring import Keyring
from ctxmem_dpu.store.context import StoreContext
from ctxmem_dpu.store.index import BlockIndex
from ctxmem_dpu.store.invalidation import Invalidator
from ctxmem_dpu.tiers import flash_io
from ctxmem_dpu.tiers.flash import Extent, FlashDevice, FlashIOError, ReadFailure

log = logging.getLogger("ctxmem_dpu.store")


class Recovery:
    """Index rebuild at start, and record verification."""

    def __init__(self, ctx: StoreContext, index: BlockIndex, invalidator: Invalidator,
                 keyring: Keyring) -> None:
        self._ctx = ctx
        self._index = index
        self._invalidator = invalidator
        self._keyring = keyring

    async def rebuild(self) -> None:
        """Rebuild the index from the self-describing records on every flash device.

        Reads each used slab's header table (one read per slab, up to ``io_threads`` slabs
        in flight) while the loop indexes the previous one. Every valid header names a
        payload that was synced before it (see ``Demotion.demote``), so every record found
        is a complete, durable block. Two records for one key (a crash between rewriting
        and invalidating, or a copied record): the higher sequence number wins; on a tie,
        the one whose payload verifies. Losers' headers are zeroed and their extents freed.
        """
        counters = self._ctx.counters
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
            if self._index.count() >= 100_000:
                gc.freeze()
        counters["recovered_blocks"] = self._index.count()
        counters["recovery_seconds_x1e6"] = int((time.perf_counter() - t0) * 1e6)
        if counters["recovered_blocks"]:
            log.info("rebuilt index from flash: %d blocks in %.3f s",
                     counters["recovered_blocks"], time.perf_counter() - t0)

    async def _rebuild_index(self) -> None:
        found = 0
        max_seq = 0
        losers: list[Extent] = []
        ties: list[tuple[Block, Block]] = []
        index = self._index.blocks
        legacy = 0
        for dev in self._ctx.flash.devices:
            dev_index = dev.index
            async for slab_id, slot_size, cols, n_old in self._scan(dev):
                legacy += n_old
                if not cols.slot:
                    continue
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
                    self._index.found_on_flash(ns0, cols.key, blocks)
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
                    self._index.replaced_on_flash(old, b)
            faults.point("rebuild.after_scan")
        flash_io.scan_buffers.clear()
        if legacy:
            self._ctx.counters["flash_legacy_records"] += legacy
            log.warning("rebuild: %d flash records of format version 1 (written before "
                        "records carried authenticators) are not served: anyone who can "
                        "write the flash could have made them; their blocks are misses and "
                        "their slots are reused", legacy)
        for keep, other in ties:
            if index[keep.ns].get(keep.key) is not keep:  # superseded by a newer seq
                assert other.flash is not None
                losers.append(other.flash)
                continue
            # One version on two extents (a copied record): keep the one that verifies.
            log.debug("rebuild: key %s on %s and %s", keep.key.hex()[:16], keep.flash,
                      other.flash)
            if not await self.verify(keep) and await self.verify(other):
                keep, other = other, keep
                self._index.replaced_on_flash(other, keep)
            assert other.flash is not None
            losers.append(other.flash)
        if losers:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("rebuild: shadowed records invalidated: %s", losers)
            await self._invalidator.invalidate(losers)
        self._index.resume_after(max_seq)
        if losers:
            log.info("rebuild: %d of %d records were shadowed by newer ones (invalidated)",
                     len(losers), found)

    async def _scan(self, dev: FlashDevice
                    ) -> AsyncIterator[tuple[int, int, TableColumns, int]]:
        """The used slabs of ``dev`` with their records (and how many records of format
        version 1 each holds), in slab order; up to ``io_threads`` (at least 2) slab reads
        in flight while the caller indexes."""
        pending: deque[asyncio.Future[tuple[int, int, TableColumns, int] | None]] = deque()
        slabs = iter(dev.owned_slabs())  # a shared device: only the slabs leased here
        depth = max(2, self._ctx.cfg.service.io_threads)
        while True:
            while len(pending) < depth and (slab := next(slabs, None)) is not None:
                pending.append(self._ctx.io.submit(dev.scan_slab, slab))
            if not pending:
                return
            res = await pending.popleft()
            if res is not None and (res[2].slot or res[3]):
                yield res

    async def verify(self, b: Block) -> bool:
        """Does ``b``'s flash record read back and check (header, payload CRC,
        authenticator)?"""
        assert b.flash is not None
        dev = self._ctx.flash.devices[b.flash.device]
        cipher = self._keyring.for_device(b.ns, dev.name)
        auth = self._keyring.authenticator(b.ns)
        ext = b.flash

        def work() -> bool:
            buf = mmap.mmap(-1, max(b.slot_size, 4096))
            view = memoryview(buf)[: b.slot_size]
            try:
                dev.read_record(ext.slot, view, b.ns, b.key, b.length, b.crc, b.seq, cipher,
                                auth)
                return True
            except (ReadFailure, FlashIOError, ValueError):
                return False
            finally:
                view.release()
                buf.close()

        return await self._ctx.io.run(work)


def audit(ctx: StoreContext, index: BlockIndex, invalidator: Invalidator) -> list[str]:
    """The index's own invariants (:meth:`BlockIndex.audit`), then the index against the
    flash allocators; see ``BlockStore.audit``."""
    problems = index.audit(ctx.flash.enabled)
    owners: dict[Extent, Block] = {}
    for per_ns in index.blocks.values():
        for b in per_ns.values():
            if b.flash is None:
                continue
            other = owners.get(b.flash)
            if other is not None:
                problems.append(f"extent {b.flash} is named by {other.key.hex()[:16]} and "
                                f"{b.key.hex()[:16]}: allocated twice")
            owners[b.flash] = b
            dev = ctx.flash.devices[b.flash.device]
            slab = dev.alloc.slabs[b.flash.slot.slab]
            if slab.klass != b.slot_size:
                problems.append(f"extent {b.flash} of a {b.slot_size}-byte block lies in a "
                                f"slab of class {slab.klass}")
            elif b.flash.slot.index in slab.free:
                problems.append(f"extent {b.flash} is in use but free in the allocator")
    for dev in ctx.flash.devices:
        used = dev.alloc.used_slots()
        named = sum(1 for e in owners if e.device == dev.index)
        parked = len(invalidator.parked.get(dev.index, ()))
        quarantined = len(dev.alloc.quarantined)
        moving = sum(n for e, n in invalidator.in_flight.items() if e.device == dev.index)
        accounted = named + parked + quarantined + moving
        if used != accounted:
            problems.append(f"device {dev.name}: {used} slots allocated, but {named} "
                            f"indexed + {parked} parked + {quarantined} quarantined + "
                            f"{moving} in flight (leak of {used - accounted})")
    return problems
