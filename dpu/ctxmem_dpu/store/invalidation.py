"""Killing flash records, parked extents, pins, and freeing a deleted block's storage.

An extent is freed only once nothing can read it: its record header is zeroed and synced
first, so neither a restart nor a later reader can bring back a record over an extent
reused since. When that fails (a failing device) the extent is *parked* and never reused
until the reaper has zeroed its header, once the device is healthy again.
"""

from __future__ import annotations

import logging
from collections import Counter

from ctxmem_dpu import faults
from ctxmem_dpu.blocks import Block
from ctxmem_dpu.logthrottle import throttled
from ctxmem_dpu.store.context import StoreContext
from ctxmem_dpu.store.health import DeviceHealth
from ctxmem_dpu.store.index import unpin
from ctxmem_dpu.store.ioqueue import IoClass, IoWork
from ctxmem_dpu.tiers.flash import Extent, FlashIOError
from ctxmem_dpu.tiers.flash_fence import SlabFenced

log = logging.getLogger("ctxmem_dpu.store")
_STORE = IoWork(IoClass.STORE)  # zeroing dead records' headers: never before a get


class Invalidator:
    """Zeroes record headers and frees extents; keeps the parked and in-flight extents the
    audit accounts for."""

    def __init__(self, ctx: StoreContext, health: DeviceHealth) -> None:
        self._ctx = ctx
        self._health = health
        # Extents whose header may still hold a record (a write or an invalidation failed
        # on a failing device): never reused until the header is zeroed, which the reaper
        # does once the device is healthy again.
        self.parked: dict[int, list[Extent]] = {}
        # Extents allocated but named by no block for the moment: a demotion's, between
        # reservation and completion; an invalidation's, between zeroing and freeing.
        self.in_flight: Counter[Extent] = Counter()

    def park(self, ext: Extent) -> None:
        """Keep ``ext`` out of use until its header is zeroed (see :meth:`retry_parked`)."""
        self.parked.setdefault(ext.device, []).append(ext)

    def begin(self, extents: list[Extent]) -> None:
        """``extents`` are allocated but named by no block until :meth:`end`."""
        self.in_flight.update(extents)

    def end(self, extents: list[Extent]) -> None:
        # Not Counter.subtract + unary plus: those loop in Python over the batch and then
        # copy the whole counter, per demotion and per invalidation.
        in_flight = self.in_flight
        for ext in extents:
            left = in_flight[ext] - 1
            if left > 0:
                in_flight[ext] = left
            else:
                del in_flight[ext]

    async def retry_parked(self, log_errors: bool = False) -> None:
        """Zero the headers of parked extents, then free them, on devices that work."""
        for d in list(self.parked):
            if self._ctx.flash.devices[d].healthy:
                try:
                    await self.invalidate(self.parked.pop(d))
                except Exception:
                    if not log_errors:
                        raise
                    log.exception("invalidating parked extents at shutdown failed")

    async def invalidate(self, extents: list[Extent], stage: str = "", free: bool = True
                         ) -> bool:
        """Zero the headers of ``extents``, sync, then (``free``) return them to the
        allocator. An extent is never freed while its header may still hold a record: on a
        device error its extents are parked until the device is healthy again (the reaper
        retries). ``stage`` names the fault points around the zeroing (crash tests).
        Returns whether every header is now dead."""
        flash = self._ctx.flash
        by_dev: dict[int, list[Extent]] = {}
        for ext in extents:
            by_dev.setdefault(ext.device, []).append(ext)

        def zero() -> dict[int, BaseException]:
            failed: dict[int, BaseException] = {}
            for d, exts in by_dev.items():
                dev = flash.devices[d]
                try:
                    if not dev.healthy:
                        raise FlashIOError(5, f"flash device {dev.name!r} is marked failed")
                    dev.invalidate_many([ext.slot for ext in exts])
                except FlashIOError as exc:
                    failed[d] = exc
            return failed

        def sync(devs: list[int]) -> dict[int, BaseException]:
            failed: dict[int, BaseException] = {}
            for d in devs:
                try:
                    flash.devices[d].sync()
                except FlashIOError as exc:
                    failed[d] = exc
            return failed

        if free:
            self.begin(extents)
        try:
            # Not on a get's path, whoever asked (a delete, a failed check): a store.
            failed = await self._ctx.io.run_as(_STORE, zero)
            if stage:
                faults.point(f"{stage}.after_zero")
            failed.update(await self._ctx.io.run_as(_STORE, sync,
                                                    [d for d in by_dev if d not in failed]))
            if stage:
                faults.point(f"{stage}.after_sync")
        finally:
            if free:
                self.end(extents)
        for d, exc in failed.items():
            if isinstance(exc, SlabFenced):
                # Shared flash: this node's lease on a slab lapsed (the index was out of
                # reach) or the slab is not leased to it. Not a failed device: marking it
                # failed took every write off the device until a probe, writes that free
                # slabs could take (issue 26). Parked: the reaper zeroes them once the
                # lease is renewed; a slab lost meanwhile is skipped (its new owner's).
                throttled(log, logging.WARNING, f"invalidate.fenced.{d}",
                          "invalidating %d flash records on %s waits for its slab lease: "
                          "%s", len(by_dev[d]), flash.devices[d].name, exc)
            else:
                log.error("invalidating %d flash records on %s failed: %s", len(by_dev[d]),
                          flash.devices[d].name, exc)
                self._health.write_failed(d, exc)  # a full filesystem is not a failed device
            if free:
                self.parked.setdefault(d, []).extend(by_dev[d])
        if free:
            for d, exts in by_dev.items():
                if d not in failed:
                    for ext in exts:
                        flash.free(ext)
        return not failed

    # -- pins ---------------------------------------------------------------------------
    def unpin(self, b: Block) -> None:
        """Drop one pin (lease, in-flight I/O, a transfer); the last unpin of a deleted
        block frees its storage."""
        if unpin(b):
            self.release_storage(b)

    def release_storage(self, b: Block) -> None:
        """Free a deleted block's DRAM slot and flash extent. ``delete`` zeroed the flash
        header already and cleared ``b.flash``; a header still named here is zeroed first."""
        if b.dram is not None:
            self._ctx.dram.free(b.dram)
            b.dram = None
        if b.flash is not None:
            ext = b.flash
            b.flash = None
            self._ctx.io.spawn(self.invalidate([ext]))
