"""Room on flash: the extents a demotion writes into, found by leasing a free slab (on a
pod's shared device) before evicting flash blocks.

The lower half of making room. The upper half, DRAM, is :mod:`~ctxmem_dpu.store.room`: a
DRAM victim not yet on flash is demoted (:mod:`~ctxmem_dpu.store.demotion`), and the
demotion takes its extents from here. Calls run one way: room → demotion → flash room.

Flash eviction walks the flash LRU per tenant (``Quotas.flash_victims``); pinned blocks,
blocks with I/O in flight and blocks on a failed device are never victims. A victim is
dropped from flash (the whole block, or only its flash copy when it is also in DRAM: the
block is dirty again), and its header is zeroed and synced before its extent is freed.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from ctxmem_common.flash_format import slots_per_slab
from ctxmem_dpu.blocks import Block
from ctxmem_dpu.store.context import StoreContext
from ctxmem_dpu.store.index import BlockIndex
from ctxmem_dpu.store.invalidation import Invalidator
from ctxmem_dpu.store.quotas import Quotas
from ctxmem_dpu.tiers.flash import Extent

if TYPE_CHECKING:  # the pod's slab leases (and redis) load only where a device is shared
    from ctxmem_dpu.pod.slab_leases import SlabLeaseKeeper


class FlashRoom:
    """Finds room on flash: free extents, then slabs leased, then flash victims."""

    def __init__(self, ctx: StoreContext, index: BlockIndex, invalidator: Invalidator,
                 quotas: Quotas) -> None:
        self._ctx = ctx
        self._index = index
        self._invalidator = invalidator
        self._quotas = quotas
        # Shared flash only (:meth:`attach_keeper`): leases more free slabs.
        self._keeper: SlabLeaseKeeper | None = None

    def attach_keeper(self, keeper: SlabLeaseKeeper) -> None:
        """Shared flash (a pod): from now on a reservation that finds no free extent first
        leases free slabs through ``keeper`` (``SlabLeaseKeeper.top_up(more=1)``, one at a
        time while it leases any), and evicts only when none can be leased.

        Called once, by ``BlockStore.start``: the keeper exists only once the devices are
        open and their slabs leased again (``store.devices.open_devices``), after this
        object was built. Before that (and without a shared device) flash room is found by
        eviction alone."""
        assert self._keeper is None, "FlashRoom.attach_keeper: a keeper is attached already"
        self._keeper = keeper

    def tenant_of(self, b: Block) -> str:
        """The tenant a reservation for ``b`` is made for (``Quotas.tenant_of``)."""
        return self._quotas.tenant_of(b)

    async def reserve(self, slot_size: int, n: int, tenant: str | None = None
                      ) -> list[Extent] | None:
        """``n`` extents of ``slot_size`` for blocks of ``tenant`` (None: several),
        leasing slabs (shared flash) or evicting flash blocks (LRU, fairly:
        ``Quotas.flash_victims``) to make room; ``None`` when the tier cannot make that
        much room.

        A victim's header is zeroed and synced before its extent is freed, so a crash or
        power cut can never bring an evicted block back over an extent reused since, and
        a later delete of the key never misses a copy on flash."""
        flash, index = self._ctx.flash, self._index
        keeper = self._keeper
        if keeper is not None:
            # Shared flash: lease free slabs before evicting anything.
            while (exts := flash.allocate(slot_size, n)) is None \
                    and await keeper.top_up(more=1):
                pass
            if exts is not None:
                return exts
        for _round in range(3):
            exts = flash.allocate(slot_size, n)
            if exts is not None:
                return exts
            room = self.free(slot_size)
            per_slab: Counter[tuple[int, int]] = Counter()
            evicted: list[Extent] = []
            # Never evict from a failed device: that frees no usable space, it only drops
            # blocks that come back when the device does.
            for b in self._quotas.flash_victims(tenant, skip=lambda b: (
                    b.pins > 0 or b.io is not None or b.flash is None
                    or not flash.devices[b.flash.device].healthy)):
                if room >= n:
                    break
                self._quotas.flash_evicted(b)
                ext = index.dropped_flash(b)
                self._ctx.counters["evictions_flash"] += 1
                evicted.append(ext)
                dev = flash.devices[ext.device]
                slab = dev.alloc.slabs[ext.slot.slab]
                if slab.klass == slot_size:
                    room += 1
                else:
                    per_slab[(ext.device, ext.slot.slab)] += 1
                    if per_slab[(ext.device, ext.slot.slab)] == slab.used:
                        room += slots_per_slab(dev.slab_size, slot_size)
            if not evicted:
                return None
            await self._invalidator.invalidate(evicted, stage="flash_evict")
        return flash.allocate(slot_size, n)

    def free(self, slot_size: int) -> int:
        """Free extents of ``slot_size`` on healthy devices, free slabs included."""
        room = 0
        for dev in self._ctx.flash.devices:
            if dev.healthy:
                per = slots_per_slab(dev.slab_size, slot_size)
                room += dev.alloc.free_slots(slot_size) + dev.alloc.free_slabs * per
        return room
