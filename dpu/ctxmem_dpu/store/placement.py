"""Placement: reserving DRAM slots and flash extents, evicting to make room.

Each tier evicts in its segmented-LRU order (``ctxmem_dpu.policy``); pinned blocks and
blocks with I/O in flight are never victims. DRAM eviction drops the DRAM copy of blocks
already durable on flash; a block not yet on flash is demoted first (batched), or, with no
usable flash, dropped. Flash eviction drops the block, or only its flash copy when it is
also in DRAM (the block is dirty again). When nothing can be freed the request fails with
RESOURCE_EXHAUSTED; the service never crashes for it.

Victims are chosen per tenant (``ctxmem_dpu.store.quotas``): a request evicts its own
tenant's blocks first when that tenant is at or over its guaranteed share, then blocks of
tenants above theirs; a tenant at or under its guarantee never loses blocks to another
tenant's puts, and a tenant at its DRAM ceiling only reuses its own slabs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from operator import attrgetter

from ctxmem_common.errors import ResourceExhausted, Shed
from ctxmem_common.flash_format import slots_per_slab
from ctxmem_dpu.alloc import SlotRef
from ctxmem_dpu.blocks import Block, Namespace, slab_owner
from ctxmem_dpu.store.context import StoreContext
from ctxmem_dpu.store.health import DeviceHealth
from ctxmem_dpu.store.index import BlockIndex
from ctxmem_dpu.store.invalidation import Invalidator
from ctxmem_dpu.store.quotas import Quotas
from ctxmem_dpu.tiers.flash import Extent

_SLOT_SIZE = attrgetter("slot_size")

Demote = Callable[[list[Block]], Awaitable[object]]
_PINS = attrgetter("pins")
_NS = attrgetter("ns")


class Placement:
    """Finds room in DRAM and on flash."""

    def __init__(self, ctx: StoreContext, index: BlockIndex, health: DeviceHealth,
                 invalidator: Invalidator, quotas: Quotas) -> None:
        self._ctx = ctx
        self._index = index
        self._health = health
        self._invalidator = invalidator
        self._quotas = quotas
        # Shared flash: leases at least one more free slab (ctxmem_dpu.pod.slab_leases,
        # SlabLeaseKeeper.top_up); returns how many it leased. None: no shared device.
        self.more_flash: Callable[[], Awaitable[int]] | None = None

    def tenant_of(self, b: Block) -> str:
        """The tenant owning ``b`` (see ``Quotas.tenant_of``)."""
        return self._quotas.tenant_of(b)

    def dram_capacity(self, slot_size: int) -> int:
        """How many blocks of ``slot_size`` the whole DRAM tier holds."""
        return self._ctx.dram.num_slabs * (self._ctx.cfg.dram.slab_size // slot_size)

    async def reserve_dram(self, ns: Namespace, n: int, demote: Demote) -> list[SlotRef]:
        """``n`` DRAM slots for ``ns`` (in slabs of ``ns`` alone), evicting (``demote``
        first if needed) to make room."""
        if n == 0:
            return []
        cfg, quotas = self._ctx.cfg, self._quotas
        capacity = self.dram_capacity(ns.slot_size)
        if n > capacity:
            raise ResourceExhausted(
                f"a batch of {n} blocks needs more DRAM than the tier holds ({capacity} "
                f"blocks of {ns.slot_size} bytes); send smaller batches or raise dram.size"
            )
        ceiling = quotas.dram_ceiling(ns.tenant)
        if n > ceiling * (cfg.dram.slab_size // ns.slot_size):
            raise quotas.refuse(
                ns.tenant, "dram_max",
                f"a batch of {n} blocks needs more than the tenant's DRAM ceiling of "
                f"{ceiling} slabs; send smaller batches or raise quotas.*.dram_max")
        refs = self._allocate(ns, n)
        if refs is not None:
            return refs
        for _round in range(3):
            need_demote: list[Block] = []
            usable = self._health.usable()
            for b in quotas.dram_victims(
                    ns.tenant, skip=lambda b: b.pins > 0 or b.io is not None or b.dram is None):
                if (b.flash is not None and b.durable) or b.origin is not None:
                    self.drop_dram(b)  # a fetched copy is not demoted: it is dropped
                elif usable:
                    need_demote.append(b)
                    if len(need_demote) >= max(n, cfg.flash.demote_batch):
                        break
                    continue
                else:
                    # No flash to demote to (none configured, or every device failed):
                    # the tier degrades to a DRAM-only cache and drops its LRU block.
                    if b in self._index.dirty:
                        self._ctx.counters["dirty_dropped"] += 1
                    self.drop_dram(b)
                refs = self._allocate(ns, n)
                if refs is not None:
                    return refs
            if not need_demote:
                break
            self._shed_if_backed_up(ns, n)
            await demote(need_demote)
            self.drop_dram_many([b for b in need_demote if b.dram is not None
                                 and b.flash is not None and b.pins == 0 and b.io is None])
            refs = self._allocate(ns, n)
            if refs is not None:
                return refs
        if ceiling < self._ctx.dram.num_slabs and not quotas.fits_ceiling(ns, n):
            raise quotas.refuse(
                ns.tenant, "dram_max",
                f"{n} slots of {ns.slot_size} bytes would take more than its DRAM ceiling "
                f"of {ceiling} slabs and none of its own blocks can be evicted (leased or "
                f"not yet durable); release leases, retry later or raise quotas.*.dram_max")
        self._ctx.counters["dram_full"] += 1
        quotas.count(ns.tenant, "refusals")
        raise ResourceExhausted(
            f"DRAM tier full: {n} slots of {ns.slot_size} bytes for tenant {ns.tenant!r} "
            f"cannot be freed (blocks are leased, other tenants are within their "
            f"guaranteed shares, or flash is full or failing); retry later or raise "
            f"dram.size"
        )

    def _shed_if_backed_up(self, ns: Namespace, n: int) -> None:
        """Raise :class:`Shed` when this put would wait for write-back that is already
        behind by more than ``flash.shed_backlog_bytes`` (issue 29 item 2: a store is
        never on a request's critical path, so it is dropped rather than queued)."""
        bound = self._ctx.cfg.flash.shed_backlog_bytes
        if not bound:
            return
        backlog = sum(map(_SLOT_SIZE, self._index.dirty))
        if backlog <= bound:
            return
        self._ctx.counters["puts_shed"] += 1
        self._ctx.counters["puts_shed_blocks"] += n
        self._quotas.count(ns.tenant, "shed")
        raise Shed(
            f"put of {n} blocks shed: {backlog} bytes of committed blocks wait for "
            f"write-back to flash (flash.shed_backlog_bytes {bound}) and this put would "
            f"wait behind them; nothing was stored. The engine recomputes these blocks "
            f"if needed; raise flash.shed_backlog_bytes (or 0: wait) to queue instead")

    def _allocate(self, ns: Namespace, n: int) -> list[SlotRef] | None:
        """``n`` slots for ``ns`` if free ones fit within its tenant's DRAM ceiling."""
        if not self._quotas.fits_ceiling(ns, n):
            return None
        return self._ctx.dram.allocate(ns.slot_size, n, slab_owner(ns))

    def drop_dram(self, b: Block) -> None:
        """Evict ``b``'s DRAM copy (unpinned); a block with no flash copy is gone."""
        assert b.dram is not None and b.pins == 0
        self._ctx.dram.free(b.dram)
        tenant = self._quotas.tenant_of(b)
        self._index.dropped_dram(b)
        self._ctx.counters["evictions_dram"] += 1
        self._quotas.count(tenant, "evictions_dram")

    def drop_dram_many(self, blocks: list[Block]) -> None:
        """:meth:`drop_dram` of each of ``blocks`` (each with a DRAM copy, unpinned), as
        one batch: the slots freed per run in one slab, the counters added once per
        namespace, not once per block (an evict of 512 blocks of 64 KiB spent ≈ 0.5 ms
        in one :meth:`drop_dram` each; issue 17 item 3)."""
        if not blocks:
            return
        assert max(map(_PINS, blocks)) == 0, "drop_dram_many: a block is pinned"
        index, quotas = self._index, self._quotas
        self._ctx.dram.free_many([b.dram for b in blocks])  # type: ignore[misc]
        self._ctx.counters["evictions_dram"] += len(blocks)
        first = dict(zip(map(_NS, blocks), blocks, strict=True))
        for digest, n in Counter(map(_NS, blocks)).items():
            quotas.count(quotas.tenant_of(first[digest]), "evictions_dram", n)
        index.dropped_dram_many(blocks)

    async def reserve_flash(self, slot_size: int, n: int, tenant: str | None = None
                            ) -> list[Extent] | None:
        """``n`` extents of ``slot_size`` for blocks of ``tenant`` (None: several),
        evicting flash blocks (LRU, fairly: ``Quotas.flash_victims``) to make room;
        ``None`` when the tier cannot make that much room.

        A victim's header is zeroed and synced before its extent is freed, so a crash or
        power cut can never bring an evicted block back over an extent reused since, and
        a later delete of the key never misses a copy on flash."""
        flash, index = self._ctx.flash, self._index
        if self.more_flash is not None:
            # Shared flash: lease free slabs before evicting anything.
            while (exts := flash.allocate(slot_size, n)) is None and await self.more_flash():
                pass
            if exts is not None:
                return exts
        for _round in range(3):
            exts = flash.allocate(slot_size, n)
            if exts is not None:
                return exts
            room = self.flash_room(slot_size)
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

    def flash_room(self, slot_size: int) -> int:
        """Free extents of ``slot_size`` on healthy devices, free slabs included."""
        room = 0
        for dev in self._ctx.flash.devices:
            if dev.healthy:
                per = slots_per_slab(dev.slab_size, slot_size)
                room += dev.alloc.free_slots(slot_size) + dev.alloc.free_slabs * per
        return room
