"""Demotion: writing DRAM-only blocks to flash, durably, in batches; the demoter task.

Write ordering (docs/reliability.md): payloads → fdatasync → headers → fdatasync. A header
therefore never reaches stable storage before its payload, so after a crash or power cut
every valid header on flash names a complete payload; a block is durable (and its extent
recorded in the index) only after the second sync.

A block is persisted only while its DRAM bytes still match the CRC32C computed at commit:
each payload's CRC32C is recomputed from the DRAM slot right after the slot was written
(encrypted from it, while it is still in cache), and a block that changed since commit (a
shared-memory client writing slots it no longer holds) is dropped, a miss, counted in
``dram_crc_mismatch``, and its header never written. A change racing the write itself and
undone before the check is caught on read, where every record's CRC32C is verified.

:meth:`Demotion.demote` returns, per block it could not make durable, why: the
:class:`~ctxmem_dpu.tiers.flash.FlashIOError` of the failed write (``ENOSPC`` when the tier
had no room, ``ENODEV`` when no device was usable), or :class:`DramChanged`. Write-through
commits turn those into errors (``store.writethrough``).
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

from ctxmem_common.codecs import crc32c_many
from ctxmem_common.flash_format import RecordHeader
from ctxmem_dpu import faults
from ctxmem_dpu.alloc import SlotRef
from ctxmem_dpu.blocks import Block
from ctxmem_dpu.store.ciphers import Keyring
from ctxmem_dpu.store.context import StoreContext
from ctxmem_dpu.store.health import DeviceHealth
from ctxmem_dpu.store.index import BlockIndex, wait_io
from ctxmem_dpu.store.invalidation import Invalidator
from ctxmem_dpu.store.placement import Placement
from ctxmem_dpu.tiers.flash import Extent, FlashDevice, FlashIOError
from ctxmem_dpu.tiers.flash_fence import SlabFenced

log = logging.getLogger("ctxmem_dpu.store")

# The demoter's poll period, and the longest it waits between tries that made no progress.
DEMOTE_POLL_S = 0.02
DEMOTE_BACKOFF_MAX_S = 1.0
# "flash tier full" is logged at most this often (each occurrence is counted in flash_full).
FLASH_FULL_LOG_INTERVAL_S = 30.0


class DramChanged(Exception):
    """A block's DRAM bytes no longer match the CRC32C computed at its commit: it was not
    persisted and is dropped (a miss)."""


class Demotion:
    """DRAM → flash."""

    def __init__(self, ctx: StoreContext, index: BlockIndex, placement: Placement,
                 invalidator: Invalidator, health: DeviceHealth, keyring: Keyring) -> None:
        self._ctx = ctx
        self._index = index
        self._placement = placement
        self._invalidator = invalidator
        self._health = health
        self._keyring = keyring
        self._flash_full_logged = -FLASH_FULL_LOG_INTERVAL_S

    async def run(self) -> None:
        """The write-back demoter: demote dirty blocks in batches until the store closes.

        Polls every 20 ms instead of waiting on an Event under wait_for: cancelling a
        task blocked in wait_for(Event.wait()) can hang on CPython 3.11 at shutdown.
        While no device is healthy it does not try at all (the reaper's probe brings
        devices back); while it makes no progress (flash full of pinned blocks) it
        backs off to DEMOTE_BACKOFF_MAX_S between tries."""
        ctx, dirty = self._ctx, self._index.dirty
        pause = DEMOTE_POLL_S
        while not ctx.closed:
            await asyncio.sleep(pause)
            if not self._health.usable():
                continue
            while dirty and ctx.flash.enabled and not ctx.closed:
                batch = list(itertools.islice(dirty, ctx.cfg.flash.demote_batch))
                before = len(dirty)
                try:
                    await self.demote(batch)
                except Exception:
                    log.exception("background demotion failed")
                    break
                if len(dirty) >= before:  # no progress (flash full or failing)
                    pause = min(DEMOTE_BACKOFF_MAX_S, pause * 2 ** 4)
                    break
                pause = DEMOTE_POLL_S

    async def demote(self, blocks: list[Block]) -> dict[Block, BaseException]:
        """Write DRAM-only blocks to flash and make them durable (see the module doc);
        returns the blocks that are not durable now, each with why (blocks that need no
        demotion, or that another demotion has in flight, are not named).

        Each record is encrypted with its namespace's key unless its device encrypts in
        hardware (:class:`~ctxmem_dpu.store.ciphers.Keyring`); the header's flags say which
        layer encrypted (ctxmem's, or the device's)."""
        ctx, index = self._ctx, self._index
        blocks = [b for b in blocks
                  if b.dram is not None and b.flash is None and not b.deleted and b.io is None]
        failures: dict[Block, BaseException] = {}
        if not blocks or not ctx.flash.enabled:
            return failures
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        for b in blocks:  # claimed before any await: no concurrent demotion takes them
            b.pins += 1
            b.io = fut
        plan: list[tuple[Block, Extent]] = []
        # (device, flash slot, header, the DRAM slot's view, cipher, (the DRAM slab's
        # mapping, the slot's offset in it)): the offsets are computed here, on the loop,
        # which owns the DRAM tier's bookkeeping; the I/O threads only move bytes.
        jobs: list[tuple[FlashDevice, SlotRef, RecordHeader, memoryview, Any,
                         tuple[memoryview, int]]] = []
        results: list[BaseException | None] = []
        ok = False
        try:
            # Grouped by tenant too: flash eviction is fair per tenant (store.quotas).
            by_size: dict[tuple[int, str], list[Block]] = {}
            for b in blocks:
                by_size.setdefault((b.slot_size, self._placement.tenant_of(b)), []).append(b)
            for (size, tenant), group in by_size.items():
                exts = await self._placement.reserve_flash(size, len(group), tenant)
                if exts is None:
                    no_room = self._no_room(size, len(group))
                    failures.update(dict.fromkeys(group, no_room))
                    continue
                plan.extend(zip(group, exts, strict=True))
                self._invalidator.begin(exts)
            dram = ctx.dram
            for b, ext in plan:
                assert b.dram is not None
                dev = ctx.flash.devices[ext.device]
                cipher = self._keyring.for_device(b.ns, dev.name)
                header = RecordHeader(b.ns, b.key, b.length, b.crc, b.seq, cipher is not None,
                                      time.time_ns(),
                                      cipher.check_value if cipher is not None else 0,
                                      self._keyring.device_encrypts(dev.name))
                # ctx.dram.slot_view, keeping the slot's place in its slab's mapping.
                region = dram.regions[b.dram.slab].view
                size = dram.alloc.slabs[b.dram.slab].slot_size
                at = b.dram.index * size
                jobs.append((dev, ext.slot, header, region[at : at + size], cipher,
                             (region, at)))
            if jobs:
                faults.point("demote.before_write")
                results = await self._write_records(jobs)
            ok = True
        finally:
            for job in jobs:
                job[3].release()
            fut.set_result(None)
            self._invalidator.end([ext for _b, ext in plan])
            if not ok:  # cancelled or failed before the records were written
                for _b, ext in plan:
                    self._invalidator.park(ext)
                for b in blocks:
                    b.io = None
                    self._invalidator.unpin(b)
        written = 0
        shared: list[Block] = []
        for (b, ext), err in zip(plan, results or [None] * len(plan), strict=True):
            if isinstance(err, SlabFenced):
                # Shared flash: the slab's lease lapsed or was taken over; no header was
                # written there. The block stays dirty (another slab takes it).
                failures[b] = err
                ctx.counters["flash_fenced_writes"] += 1
                ctx.flash.free(ext)
            elif isinstance(err, DramChanged):
                failures[b] = err
                # Its header was never written: the extent holds no record.
                ctx.flash.free(ext)
                self._drop_changed(b, err)
            elif err is not None:
                ctx.counters["flash_write_errors"] += 1
                # The header may or may not have landed: zero it before reuse.
                self._invalidator.park(ext)
                full = self._health.write_failed(ext.device, err)
                failures[b] = err if not full or getattr(err, "errno", None) == errno.ENOSPC \
                    else FlashIOError(errno.ENOSPC, f"the filesystem holding flash device "
                                      f"{ctx.flash.devices[ext.device].name!r} is full: {err}")
            else:
                # Durable. A block deleted meanwhile keeps its extent until ``delete``
                # (waiting on ``b.io``) zeroes the header.
                b.flash = ext
                if not b.deleted:
                    b.durable = True
                    index.dirty.pop(b, None)
                    index.flash_lru.add(b, b.hits)
                    written += 1
                    ctx.counters["demoted_bytes"] += b.length
                    if ctx.flash.devices[ext.device].fence is not None:
                        shared.append(b)
        # On a shared device any node of the pod can now read the block directly: its
        # index entry is published again with the location (the pod's publisher).
        index.announce(shared, True)
        for b in blocks:
            b.io = None
            self._invalidator.unpin(b)
        ctx.counters["demoted_blocks"] += written
        self._health.wrote({ext.device for (_b, ext), err in zip(
            plan, results or [], strict=False) if err is None})
        self._health.check_slow({ext.device for _b, ext in plan})
        return failures

    def _drop_changed(self, b: Block, err: DramChanged) -> None:
        """``b``'s DRAM bytes changed after commit: it is a miss from now on; its slot is
        freed by the last unpin."""
        self._ctx.counters["dram_crc_mismatch"] += 1
        log.warning("%s; dropped (a miss), not persisted", err)
        b.deleted = True
        self._index.forget(b)
        self._index.dirty.pop(b, None)

    def _no_room(self, size: int, n: int) -> FlashIOError:
        """Why ``n`` extents of ``size`` could not be found: no device usable (ENODEV) or
        the tier is full (ENOSPC, counted in ``flash_full``)."""
        devices = self._ctx.flash.devices
        if not self._health.usable():
            states = ", ".join(f"{d.name} {d.health_reason or 'failed'}" for d in devices)
            return FlashIOError(errno.ENODEV, f"no flash device is usable ({states}) for "
                                f"{n} blocks")
        self._flash_full(n)
        names = ", ".join(d.name for d in devices if d.healthy)
        return FlashIOError(errno.ENOSPC, f"flash tier full: no room for {n} blocks of "
                            f"{size} bytes on {names}, none can be evicted")

    async def evict(self, per_ns: dict[bytes, Block], keys: Sequence[bytes]) -> int:
        """Make the DRAM blocks of ``keys`` durable on flash, then drop their DRAM copies;
        returns how many were dropped (leased blocks keep theirs)."""
        blocks = [b for k in keys if (b := per_ns.get(k)) is not None and b.dram is not None]
        await wait_io(blocks)
        await self.demote([b for b in blocks if b.flash is None])
        # Some may have been taken by a background demotion meanwhile: let it finish.
        await wait_io(blocks)
        faults.point("evict.after_demote")
        n = 0
        for b in blocks:
            if b.dram is not None and b.flash is not None and b.durable and b.pins == 0:
                self._placement.drop_dram(b)
                n += 1
        return n

    def _flash_full(self, n: int) -> None:
        self._ctx.counters["flash_full"] += 1
        now = time.monotonic()
        if now >= self._flash_full_logged + FLASH_FULL_LOG_INTERVAL_S:
            self._flash_full_logged = now
            log.warning("flash tier full: %d blocks stay in DRAM only (counted in "
                        "flash_full; logged at most every %g s)", n, FLASH_FULL_LOG_INTERVAL_S)

    async def _write_records(self, jobs: list[Any]) -> list[BaseException | None]:
        """The four I/O phases of a demotion; one result per job (None: durable)."""
        io = self._ctx.io

        def fences(jobs: list[Any]) -> list[BaseException | None]:
            # Shared devices: is each slab's lease still this node's (clock and the slab
            # header's epoch on the device)? Once per slab per batch.
            slabs: dict[FlashDevice, set[int]] = {}
            for dev, slot, _h, _v, _c, _at in jobs:
                if dev.fence is not None:
                    slabs.setdefault(dev, set()).add(slot.slab)
            fenced = {(dev, slab): exc for dev, ss in slabs.items()
                      for slab, exc in dev.check_fences(ss).items()}
            return [fenced.get((j[0], j[1].slab)) for j in jobs]

        def payloads(part: list[Any]) -> list[BaseException | None]:
            # Per device and cipher, adjacent extents by one write (write_payloads).
            out: list[BaseException | None] = [err for _job, err in part]
            groups: dict[tuple[FlashDevice, Any], list[int]] = {}
            for i, ((dev, _slot, _header, _view, cipher, _at), err) in enumerate(part):
                if err is None:
                    groups.setdefault((dev, cipher), []).append(i)
            for (dev, cipher), group in groups.items():
                got = dev.write_payloads([(part[i][0][1], part[i][0][3]) for i in group],
                                         cipher)
                for i, err in zip(group, got, strict=True):
                    out[i] = err
            # After the writes, while the slots are in cache: what was written is what was
            # committed, or the block is dropped (see the module doc). One native call per
            # DRAM slab (the GIL released once, not once per block).
            checks: dict[int, tuple[memoryview, list[int], list[int], list[int]]] = {}
            for i, ((_dev, _slot, header, _view, _cipher, (region, at)), _err) in \
                    enumerate(part):
                if out[i] is None:
                    c = checks.get(id(region))
                    if c is None:
                        c = checks[id(region)] = (region, [], [], [])
                    c[1].append(i)
                    c[2].append(at)
                    c[3].append(header.length)
            for region, idx, offsets, lengths in checks.values():
                for i, got_crc in zip(idx, crc32c_many(region, offsets, lengths), strict=True):
                    header = part[i][0][2]
                    if got_crc != header.crc:
                        out[i] = DramChanged(
                            f"block {header.key.hex()[:16]} of namespace "
                            f"{header.namespace.hex()[:16]}: DRAM bytes changed after commit "
                            f"(CRC32C {got_crc:08x}, committed {header.crc:08x}; a "
                            f"shared-memory client wrote a slot it no longer holds)")
            return out

        def headers(part: list[Any]) -> list[BaseException | None]:
            # Per device, the headers of adjacent extents by one write (write_headers).
            out: list[BaseException | None] = [err for _job, err in part]
            groups: dict[FlashDevice, list[int]] = {}
            for i, ((dev, _slot, _header, _view, _cipher, _at), err) in enumerate(part):
                if err is None:
                    groups.setdefault(dev, []).append(i)
            for dev, group in groups.items():
                got = dev.write_headers([(part[i][0][1], part[i][0][2]) for i in group])
                for i, err in zip(group, got, strict=True):
                    out[i] = err
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
            failed = await io.run(sync, devs)
            return [failed.get(j[0], r) if r is None else r
                    for j, r in zip(jobs, results, strict=True)]

        fenced = await io.run(fences, jobs)
        results = await io.parallel(payloads, list(zip(jobs, fenced, strict=True)))
        faults.point("demote.after_payload")
        results = await synced(results)
        faults.point("demote.after_payload_sync")
        results = await io.parallel(headers, list(zip(jobs, results, strict=True)))
        faults.point("demote.after_header")
        results = await synced(results)
        faults.point("demote.after_sync")
        return results
