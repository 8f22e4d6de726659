"""Making room: where a request that needs space gets it. DRAM here; flash in
:mod:`~ctxmem_dpu.store.flash_room`.

:class:`Room` is the one collaborator the paths that need DRAM are given when they are
built (the put path, promotion, blocks fetched from peers, the get path's run bound, the
Evict call); none of them evicts or demotes by itself. Calls run one way:
``Room`` → :class:`~ctxmem_dpu.store.demotion.Demotion` (a victim not yet on flash is
written there first) → :class:`~ctxmem_dpu.store.flash_room.FlashRoom` (the demotion's
extents: slabs leased on a pod's shared device, then flash victims). Nothing below calls
back up: the demotion never evicts from DRAM, the flash room never demotes. (Two
objects, not one: DRAM room is made by demoting, and a demotion needs flash room, so one
object owning both would be called back by the demotion it calls.)

Each tier evicts in its segmented-LRU order (``ctxmem_dpu.policy``); pinned blocks and
blocks with I/O in flight are never victims. DRAM eviction drops the DRAM copy of blocks
already durable on flash; a block not yet on flash is demoted first (batched), or, with no
usable flash, dropped. When nothing can be freed the request fails with
RESOURCE_EXHAUSTED; the service never crashes for it.

Victims are chosen per tenant (``ctxmem_dpu.store.quotas``): a request evicts its own
tenant's blocks first when that tenant is at or over its guaranteed share, then blocks of
tenants above theirs; a tenant at or under its guarantee never loses blocks to another
tenant's puts, and a tenant at its DRAM ceiling only reuses its own slabs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from operator import attrgetter

from ctxmem_common.errors import ResourceExhausted, Shed
from ctxmem_dpu import faults
from ctxmem_dpu.alloc import SlotRef
from ctxmem_dpu.blocks import Block, Namespace, slab_owner
from ctxmem_dpu.store.context import StoreContext
from ctxmem_dpu.store.demotion import Demotion
from ctxmem_dpu.store.health import DeviceHealth
from ctxmem_dpu.store.index import BlockIndex, wait_io
from ctxmem_dpu.store.quotas import Quotas

_SLOT_SIZE = attrgetter("slot_size")
_PINS = attrgetter("pins")
_NS = attrgetter("ns")


class Room:
    """Finds room in DRAM: free slots, then DRAM victims (dropped, or demoted first)."""

    def __init__(self, ctx: StoreContext, index: BlockIndex, health: DeviceHealth,
                 quotas: Quotas, demotion: Demotion) -> None:
        self._ctx = ctx
        self._index = index
        self._health = health
        self._quotas = quotas
        # Writes victims not yet on flash there (its extents from the flash room).
        self._demotion = demotion

    def dram_capacity(self, slot_size: int) -> int:
        """How many blocks of ``slot_size`` the whole DRAM tier holds."""
        return self._ctx.dram.num_slabs * (self._ctx.cfg.dram.slab_size // slot_size)

    async def reserve_dram(self, ns: Namespace, n: int) -> list[SlotRef]:
        """``n`` DRAM slots for ``ns`` (in slabs of ``ns`` alone), evicting to make room:
        the victims already durable on flash (or fetched copies) are dropped; those not
        yet on flash are demoted first, ``flash.demote_batch`` of them at least, then
        dropped; with no usable flash they are dropped (counted in ``dirty_dropped``)."""
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
            await self._demotion.demote(need_demote)
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

    async def evict(self, per_ns: dict[bytes, Block], keys: Sequence[bytes]) -> int:
        """The Evict call: make the DRAM blocks of ``keys`` durable on flash, then drop
        their DRAM copies; returns how many were dropped (leased blocks keep theirs)."""
        blocks = [b for k in keys if (b := per_ns.get(k)) is not None and b.dram is not None]
        await wait_io(blocks)
        await self._demotion.demote([b for b in blocks if b.flash is None])
        # Some may have been taken by a background demotion meanwhile: let it finish.
        await wait_io(blocks)
        faults.point("evict.after_demote")
        drop = [b for b in blocks
                if b.dram is not None and b.flash is not None and b.durable and b.pins == 0]
        self.drop_dram_many(drop)
        return len(drop)
