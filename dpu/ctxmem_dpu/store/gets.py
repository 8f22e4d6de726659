"""The get path: leasing the longest stored leading run of a request's keys.

``acquire`` walks the keys while they are stored (at most half the DRAM tier per lease, so
cold blocks can be staged; past two pieces of flash blocks the rest is the next Acquire's),
pins them, promotes the flash-only ones (:mod:`~ctxmem_dpu.store.promotion`: read,
decrypt, verify; a block that fails ends the run there) with the next piece read ahead,
cuts the run to what the tenant's quota lets a lease hold, and leases the rest with each
block's source tier. A run that comes back short is continued by the shim with another
Acquire from where it stopped.

``acquire_group``: a block group's members leased as one unit, each to the same length (a
key one member lacks, or whose block fails in one member, ends the run in every member).

Invariant: every block of a lease is pinned before any await, so nothing in the run is
evicted while it is promoted; every block taken off the run is unpinned.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ctxmem_common.keys import validate_keys
from ctxmem_common.protoconv import TIER_DRAM, TIER_FLASH, TIER_REMOTE, TIER_REMOTE_DRAM
from ctxmem_dpu.blocks import Block, Lease, Namespace, Session
from ctxmem_dpu.store.context import StoreContext
from ctxmem_dpu.store.groups import GroupSiblings
from ctxmem_dpu.store.index import BlockIndex
from ctxmem_dpu.store.invalidation import Invalidator
from ctxmem_dpu.store.promotion import Promotion
from ctxmem_dpu.store.quotas import Quotas
from ctxmem_dpu.store.room import Room
from ctxmem_dpu.store.sessions import SessionRegistry


class GetPath:
    """Acquire, over the store's index, room, promotion, quotas and sessions."""

    def __init__(self, ctx: StoreContext, index: BlockIndex, registry: SessionRegistry,
                 quotas: Quotas, room: Room, promotion: Promotion,
                 invalidator: Invalidator, groups: GroupSiblings) -> None:
        self._ctx = ctx
        self._counters = ctx.counters
        self._index = index
        self._registry = registry
        self._quotas = quotas
        self._room = room
        self._promotion = promotion
        self._groups = groups
        self._unpin = invalidator.unpin

    async def acquire_group(self, s: Session, members: Sequence[Namespace],
                            keys: Sequence[bytes],
                            recheck: Callable[[Namespace], None] | None = None
                            ) -> tuple[list[Lease], list[str]]:
        """Lease a block group's leading run: the leading ``keys`` that every member
        namespace holds and whose every member block verifies (promoted and checked as
        :meth:`acquire` does). One lease per member, in ``members``' order, each of the
        same length; each block's source tier is the farthest of its members'. A key that
        one member lacks, or whose block in one member fails its check, ends the run
        there in every member: a whole miss, never part of a group. Members are leased
        one after another, each pinned before the next is looked at, and every lease is
        then cut to the shortest run. ``recheck``: run for each member right before its
        index is looked at (no await between; a pod's sweep of fetched copies no check
        saw, adopted while an earlier member's blocks were promoted:
        ``RemoteFetch.pull_group``)."""
        validate_keys(keys)
        self._groups.declare([ns.digest for ns in members])
        n = len(keys)
        for ns in members:  # the run every member's index holds: no member leases past it
            per_ns = self._index.get(ns.digest)
            n = next((i for i, k in enumerate(keys[:n]) if k not in per_ns), n)
        leases: list[Lease] = []
        sources: list[list[str]] = []
        try:
            for ns in members:
                if recheck is not None:
                    recheck(ns)
                lease, src = await self.acquire(s, ns, keys[:n], keys_checked=True)
                leases.append(lease)
                sources.append(src)
                n = min(n, len(lease.blocks))
        except BaseException:
            self._registry.release(s, [lease.id for lease in leases])
            raise
        cut = 0
        for lease in leases:  # the members' blocks past the shortest run are not served
            cut += len(lease.blocks) - n
            for b in lease.blocks[n:]:
                self._unpin(b)
            del lease.blocks[n:]
        self._counters["group_partial_misses"] += cut
        rank = {TIER_DRAM: 0, TIER_REMOTE_DRAM: 1, TIER_FLASH: 2, TIER_REMOTE: 3}
        tiers = [max(col, key=rank.__getitem__) for col in zip(*(x[:n] for x in sources),
                                                                   strict=True)]
        return leases, tiers if n else []

    async def acquire(self, s: Session, ns: Namespace, keys: Sequence[bytes],
                      keys_checked: bool = False) -> tuple[Lease, list[str]]:
        """Lease the longest stored leading run of ``keys``, promoting flash blocks into
        DRAM; returns the lease and each leased block's source tier. The run is cut where
        a block fails its check or DRAM could stage no more (the shim continues with
        another Acquire from there). ``keys_checked``: the caller already refused bad and
        duplicate keys (the shm fast path's ``packed_key_array``), so the batch is not
        checked a second time (≈ 10% of a 64 KiB Acquire's service time)."""
        if not keys_checked:
            validate_keys(keys)
        self._quotas.check_grants(s, "leases")
        per_ns = self._index.get(ns.digest)
        # One lease holds at most half the DRAM tier, so the rest can be evicted to stage
        # cold blocks; the shim asks for the remainder in a following Acquire.
        max_run = max(1, self._room.dram_capacity(ns.slot_size) // 2)
        run: list[Block] = []
        # Past two pieces of flash blocks (this one and the one read ahead) the rest is
        # the next Acquire's: not looked at now, so a get in pieces scans each key once.
        cold_left = 2 * self._promotion.piece_blocks(ns) or len(keys)
        for key in keys[:max_run]:
            b = per_ns.get(key)
            if b is None:
                break
            run.append(b)
            if b.dram is None:
                cold_left -= 1
                if cold_left < 0:
                    break
        # Many flash blocks: this piece now, the next one read ahead, queued on the I/O
        # threads behind this piece's reads (or at once when they are in flight already).
        cut, ahead = self._promotion.cold_piece(ns, run)
        deferred = cut < len(run)  # the keys past the cut are the next Acquire's, not misses
        run = run[:cut]
        read_ahead = self._read_ahead(ns, ahead)
        # One pass: each block's source tier (``tier_of``, or flash when read ahead), its
        # pin (before any await, so nothing in the run is evicted meanwhile), the cold ones.
        sources: list[str] = []
        cold: list[Block] = []
        for b in run:
            b.pins += 1  # BlockIndex.pin, inlined: the hot loop of an Acquire
            if b.dram is None:
                cold.append(b)
                sources.append(TIER_FLASH)
            else:
                sources.append(TIER_FLASH if b.read_ahead else TIER_DRAM)
        if all(b.io is not None for b in cold):
            read_ahead()
        try:
            ok = await self._promotion.promote_fitting(ns, cold, read_ahead)
            read_ahead()
        except BaseException:
            for b in run:
                self._unpin(b)
            raise
        if not cold and not ok.failed:  # all DRAM hits, pinned: every one is served
            n = len(run)
        else:
            n = 0
            while n < len(run) and run[n].dram is not None and run[n] not in ok.failed:
                n += 1
        try:  # a tenant's leases never hold slots in more slabs than its quota allows
            n = self._quotas.fit_lease(ns.tenant, run[:n]) if n else 0
        except BaseException:
            for b in run:
                self._unpin(b)
            raise
        for b in run[n:]:
            self._unpin(b)
        run = run[:n]
        if self._index.copies_of(ns.digest):  # a pod's copies: their first read says how
            sources = self._copy_sources(run, sources[:n])  # came (remote, remote→dram)
        self._index.touched(run)
        lease = Lease(self._registry.new_id(), s.id, ns, run,
                      time.monotonic() + self._ctx.cfg.service.lease_ttl_s)
        self._registry.add_lease(s, lease)
        self._counters["get_blocks"] += n
        self._counters["get_bytes"] += n * ns.block_nbytes
        served = sources[:n]
        in_dram, on_flash_n = served.count(TIER_DRAM), served.count(TIER_FLASH)
        self._counters["hits_dram"] += in_dram
        self._counters["hits_flash"] += on_flash_n
        if in_dram + on_flash_n != n:  # pod copies' first reads
            self._counters["hits_remote"] += served.count(TIER_REMOTE)
            self._counters["hits_remote_dram"] += served.count(TIER_REMOTE_DRAM)
        if not (deferred and n == len(run)):
            self._counters["misses"] += len(keys) - n
        return lease, sources[:n]

    @staticmethod
    def _copy_sources(run: list[Block], sources: list[str]) -> list[str]:
        """``sources`` with each fetched copy's first read reported as it came
        (``Block.fetched``: ``remote``, ``remote→dram``), that mark cleared. Only for a
        namespace holding copies, so other gets pay one dict probe."""
        out = [b.fetched or src for b, src in zip(run, sources, strict=True)]
        for b in run:
            b.fetched = ""
        return out

    def _read_ahead(self, ns: Namespace, blocks: list[Block]) -> Callable[[], None]:
        """A function that starts promoting ``blocks`` (a get's next piece) in the
        background the first time it is called, and does nothing after."""
        keys = [b.key for b in blocks]

        def start() -> None:
            if keys:
                for b in blocks:
                    b.read_ahead = True
                self._promotion.prefetch(ns, keys, self._unpin, "read_ahead_blocks")
                keys.clear()

        return start
