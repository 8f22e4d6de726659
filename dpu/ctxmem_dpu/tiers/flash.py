"""The flash tier: one or more block devices or files, O_DIRECT, slab-allocated extents.

This module holds the tier (:class:`FlashTier`, the :class:`~ctxmem_dpu.tiers.base.Tier`
over all devices) and the :class:`Extent` it hands out. A device is split by concept:
its file and I/O primitives in :mod:`.flash_io`, its format, slabs and health in
:mod:`.flash_device`, its record reads and writes in :mod:`.flash_records`; the on-flash
format and its reader in :mod:`ctxmem_common.flash_format`. The names the store and tests
import from here are re-exported.
"""

from __future__ import annotations

from itertools import repeat
from typing import NamedTuple

from ctxmem_common.flash_format import slots_per_slab
from ctxmem_dpu.alloc import SlotRef
from ctxmem_dpu.pod.entries import SharedLocation
from ctxmem_dpu.tiers.base import Tier
from ctxmem_dpu.tiers.flash_device import FlashSlabAllocator, FormattedDevice
from ctxmem_dpu.tiers.flash_io import DeviceFile, FlashIOError, ShortRead, scan_buffers
from ctxmem_dpu.tiers.flash_records import (
    HEADER_GAP,
    HEADER_RUN,
    PAYLOAD_RUN,
    FlashDevice,
    ReadFailure,
)

__all__ = [
    "HEADER_GAP",
    "HEADER_RUN",
    "PAYLOAD_RUN",
    "DeviceFile",
    "Extent",
    "FlashDevice",
    "FlashIOError",
    "FlashSlabAllocator",
    "FlashTier",
    "FormattedDevice",
    "ReadFailure",
    "ShortRead",
    "scan_buffers",
]


class Extent(NamedTuple):
    """Where a block lives on flash. A NamedTuple (not a frozen dataclass) because a warm
    restart creates one per stored block and tuple construction is several times cheaper."""

    device: int
    slot: SlotRef


class FlashTier(Tier[Extent]):
    """All flash devices; extents are spread over devices with the most free slabs.

    Extents of one slot size share slabs whatever their owner: only the service reads
    flash (records carry their namespace and are encrypted per namespace), so ``owner``
    is accepted and not used."""

    def __init__(self, devices: list[FlashDevice]) -> None:
        self.devices = devices

    @property
    def enabled(self) -> bool:
        return bool(self.devices)

    def allocate(self, slot_size: int, n: int, owner: str | None = None
                 ) -> list[Extent] | None:
        """``n`` extents of ``slot_size`` on healthy devices, all or nothing."""
        out: list[Extent] = []
        remaining = n
        for dev in sorted(
            (d for d in self.devices if d.healthy),
            key=lambda d: (-(d.alloc.free_slots(slot_size) + d.alloc.free_slabs), d.index),
        ):
            per = slots_per_slab(dev.slab_size, slot_size)
            room = dev.alloc.free_slots(slot_size) + dev.alloc.free_slabs * per
            take = min(room, remaining)
            if take:
                got = dev.alloc.allocate(slot_size, slot_size, take)
                assert got is not None
                # Made in C (as SlabAllocator.allocate makes its SlotRefs): no Python
                # call per extent.
                out += map(tuple.__new__, repeat(Extent), zip(repeat(dev.index), got))
                remaining -= take
            if not remaining:
                return out
        for ext in out:  # all or nothing
            self.free(ext)
        return None

    def shared_location(self, ext: Extent | None, length: int) -> SharedLocation | None:
        """``ext`` as any node of a pod reads it (device UUID hex, payload offset,
        ``length``), or ``None`` when it is not on a shared device."""
        if ext is None:
            return None
        dev = self.devices[ext.device]
        if dev.fence is None:
            return None
        return SharedLocation(dev.superblock.device_uuid.hex(), dev.payload_offset(ext.slot),
                              length)

    def free(self, slot: Extent) -> None:
        self.devices[slot.device].alloc.free(slot.slot)

    def quarantine(self, ext: Extent) -> None:
        """Take an extent out of use for good (it failed an integrity check)."""
        self.devices[ext.device].alloc.quarantine(ext.slot)

    def capacity_bytes(self) -> int:
        return sum(d.num_slabs * d.slab_size for d in self.devices)

    def used_bytes(self) -> int:
        return sum(s.used * s.slot_size for d in self.devices for s in d.alloc.slabs)

    def close(self) -> None:
        for d in self.devices:
            d.close()
