"""Flash device health: marking a device failed, slow I/O, probing and relocating it.

A failed device is served around (DRAM keeps what it has; nothing is evicted from or
written to the device) until the reaper's probe finds it usable again — where it was, or,
through its storage backend's locator, where it is now (an NVMe namespace that came back
as another block node).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
from collections.abc import Callable, Iterable

from ctxmem_dpu.store.context import StoreContext
from ctxmem_dpu.tiers.flash import FlashDevice, FlashIOError

log = logging.getLogger("ctxmem_dpu.store")

# Bound on one call of a device's locator (a storage backend's locate(), a sysfs walk).
LOCATE_TIMEOUT_S = 5.0


class DeviceHealth:
    """Marks devices failed or slow, and brings them back once they work again."""

    def __init__(self, ctx: StoreContext) -> None:
        self._ctx = ctx
        self._slow_seen: dict[int, int] = {}
        # Device name -> where the device is now (its storage backend's locate(): e.g. the
        # NVMe namespace's current block node, from sysfs; None while it is not there). A
        # failed device whose probe fails is looked up and reopened there when it moved.
        self.locators: dict[str, Callable[[], str | None]] = {}
        # Devices whose last write failed for want of space (a file-backed device's
        # filesystem is full): in service, but the health status says degraded.
        self.full: set[int] = set()

    def usable(self) -> bool:
        """Is any flash device healthy (is there anywhere to demote to)?"""
        return any(d.healthy for d in self._ctx.flash.devices)

    def mark_unhealthy(self, device: int, err: BaseException, reason: str = "failed") -> None:
        """Stop using ``device`` (index) until a probe finds it usable; counted once."""
        dev = self._ctx.flash.devices[device]
        if dev.healthy:
            log.error("flash device %s %s (%s); serving from DRAM without it", dev.name,
                      reason, err)
            dev.healthy = False
            dev.health_reason = reason
            self._ctx.counters["flash_device_failures"] += 1

    def write_failed(self, device: int, err: BaseException) -> bool:
        """A write to ``device`` failed. On a file-backed device whose filesystem is full
        (ENOSPC, or a short write with no free blocks left) that is not a failed device:
        counted in ``flash_full`` and the device stays in service (later writes fit once
        space is freed). Any other error marks the device failed (:meth:`mark_unhealthy`).
        Returns whether the device is full (rather than failed)."""
        dev = self._ctx.flash.devices[device]
        if _filesystem_full(dev, err):
            self._ctx.counters["flash_full"] += 1
            self.full.add(device)
            log.warning("flash device %s: its filesystem is full (%s); the device stays "
                        "in service", dev.name, err)
            return True
        self.mark_unhealthy(device, err)
        return False

    def wrote(self, devices: Iterable[int]) -> None:
        """Writes to ``devices`` succeeded: none of them is full any more."""
        self.full.difference_update(devices)

    def check_slow(self, devices: Iterable[int]) -> None:
        """Mark a device failed when it completed an I/O slower than its ``slow_io_s``
        (``flash.slow_io_s``) since
        the last check: a device that answers in seconds stalls every get behind it."""
        for d in devices:
            dev = self._ctx.flash.devices[d]
            if dev.slow_ios > self._slow_seen.get(d, 0):
                self._slow_seen[d] = dev.slow_ios
                self.mark_unhealthy(d, FlashIOError(
                    0, f"I/O slower than {dev.slow_io_s:g} s"), reason="slow")

    async def refresh_owners(self) -> None:
        """Extend this service's lease in every device's owner record (see
        :mod:`ctxmem_dpu.tiers.flash_owner`). A device another service has taken over
        (this one's lease ran out, e.g. while it was stopped) is marked failed: writing
        it now would destroy the other's records. Other errors leave the device to the
        I/O paths and the probe."""
        for dev in self._ctx.flash.devices:
            try:
                await self._ctx.io.run(dev.refresh_owner)
            except FlashIOError as exc:
                if exc.errno == errno.EBUSY:
                    self.mark_unhealthy(dev.index, exc, reason="taken over")
                else:
                    log.warning("flash device %s: %s", dev.name, exc)

    async def revive(self) -> None:
        """Probe every failed device; mark those that work healthy again."""
        for dev in self._ctx.flash.devices:
            if dev.healthy or dev.health_reason == "taken over":
                continue
            if not await self._usable_again(dev):
                continue
            dev.healthy = True
            dev.health_reason = ""
            self._slow_seen[dev.index] = dev.slow_ios
            self._ctx.counters["flash_device_recoveries"] += 1
            log.info("flash device %s is healthy again", dev.name)

    async def _usable_again(self, dev: FlashDevice) -> bool:
        """Probe a failed device where it is; if that fails and the device has a locator,
        ask where it is now and, when it moved (a new block node), reopen it there (its
        superblock UUID must match) and probe again."""
        io = self._ctx.io
        try:
            await io.run(dev.probe)
            await io.run(dev.scrub_slab_headers)
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
            await io.run(dev.reopen, path)
            await io.run(dev.probe)
            await io.run(dev.scrub_slab_headers)
        except FlashIOError as exc:
            log.warning("flash device %s: found at %s but not usable: %s", dev.name, path, exc)
            return False
        self._ctx.counters["flash_device_reopened"] += 1
        return True


def _filesystem_full(dev: FlashDevice, err: BaseException) -> bool:
    """Whether ``err`` from a write to ``dev`` means the filesystem holding the device's
    file is full: the device is a regular file and the error is ENOSPC, or the filesystem
    has no free block left (a full filesystem can also answer with a short write)."""
    try:
        if not stat.S_ISREG(os.fstat(dev.fd).st_mode):
            return False
        return (getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
                or os.fstatvfs(dev.fd).f_bavail == 0)
    except OSError:
        return False
