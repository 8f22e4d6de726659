"""The put path: reserving DRAM slots for an allocation, then committing them.

``allocate`` reserves one DRAM slot per key not yet stored (evicting if needed, within the
tenant's quota) under an allocation with a TTL; the client writes the slots; ``commit``
ends the client's write access, computes each slot's CRC32C (checking the client's when
sent; the batch split over threads, :mod:`~ctxmem_dpu.store.slotcrc`) and makes the
blocks visible: at once under write-back (queued for the demoter), only once durable on
flash under write-through (:mod:`~ctxmem_dpu.store.writethrough`).

Invariant: a block is in the index only once complete; the allocation stays registered
while its CRCs are computed, so the reaper cannot recycle its slots underneath.

Block groups (``commit_group``): the allocations of a group's member namespaces for the
same keys are committed together, all or nothing per key. Every member's CRCs are checked
before any block is visible; a key whose block fails in any member is stored in none;
under write-back every member's blocks enter the index in one step of the event loop,
key by key in the demoter's queue and the LRU (a key's members side by side);
under write-through every member is made durable first (member after member: the fault
point ``commit.group_between_members`` sits between two), then the keys whose every
member is durable enter the index together, and the other members' records of a key that
failed are dropped with their flash headers. A crash in between leaves at most some
members of a key on flash: a group load needs every member, so that key is a miss.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from ctxmem_common.errors import InvalidArgument
from ctxmem_common.keys import validate_keys
from ctxmem_dpu import faults
from ctxmem_dpu.blocks import Allocation, Block, Namespace, Session
from ctxmem_dpu.store.context import StoreContext
from ctxmem_dpu.store.index import BlockIndex
from ctxmem_dpu.store.ioqueue import IoClass, work_as
from ctxmem_dpu.store.quotas import Quotas
from ctxmem_dpu.store.room import Room
from ctxmem_dpu.store.sessions import SessionRegistry
from ctxmem_dpu.store.slotcrc import SlotCrcs, crc_threads
from ctxmem_dpu.store.writethrough import WriteThrough

log = logging.getLogger("ctxmem_dpu.store")


class PutPath:
    """Allocate and commit, over the store's index, room, quotas and sessions."""

    def __init__(self, ctx: StoreContext, index: BlockIndex, registry: SessionRegistry,
                 quotas: Quotas, room: Room, write_through: WriteThrough) -> None:
        self._ctx = ctx
        self._index = index
        self._registry = registry
        self._quotas = quotas
        self._room = room
        self._write_through = write_through
        self._crcs = SlotCrcs(crc_threads(ctx.cfg.service.commit_crc_threads))

    def close(self) -> None:
        """Stop the Commit check's threads (at service shutdown, after the last Commit)."""
        self._crcs.shutdown()

    async def allocate(
        self, s: Session, ns: Namespace, keys: Sequence[bytes]
    ) -> tuple[Allocation, list[bool]]:
        """Reserve one DRAM slot per key not yet stored, under an allocation with a TTL;
        returns it and, per key, whether it is already stored (no slot for those)."""
        validate_keys(keys)
        per_ns = self._index.get(ns.digest)
        exists = [k in per_ns for k in keys]
        new_keys = [k for k, e in zip(keys, exists, strict=True) if not e]
        self._quotas.check_grants(s, "allocations")
        slots = await self._room.reserve_dram(ns, len(new_keys))
        try:
            self._quotas.check_held(ns.tenant, {ref.slab for ref in slots})
        except BaseException:
            for ref in slots:
                self._ctx.dram.free(ref)
            raise
        a = Allocation(self._registry.new_id(), s.id, ns, new_keys, slots,
                       time.monotonic() + self._ctx.cfg.service.allocation_ttl_s)
        self._registry.add_allocation(s, a)
        faults.point("allocate.after_reserve")
        return a, exists

    async def commit(
        self, s: Session, allocation_id: bytes, client_crcs: Sequence[int], abort: bool
    ) -> int:
        """Make an allocation's blocks visible (``abort``: return its slots instead);
        returns how many were committed (see :meth:`BlockStore.commit`)."""
        a = self._registry.allocation(s, allocation_id)
        if a.done:
            # A data-plane WRITE still holds it (its bytes are still arriving), or another
            # Commit is checksumming it. Committing now could checksum a slot that then
            # changes, or free slots a concurrent Commit has just indexed; aborting could
            # free slots a WRITE is still filling. Either way a block could end up with
            # bytes that are not its own: refuse, the client retries once its WRITEs are
            # answered.
            raise InvalidArgument(
                f"{'abort' if abort else 'commit'} of allocation {a.id.hex()}: a data-plane "
                f"WRITE into it is still in flight, or it is being committed; wait for "
                f"every WRITE's answer, then commit once")
        if abort:
            self._registry.drop_allocation(a)
            return 0
        if client_crcs and len(client_crcs) != len(a.slots):
            raise InvalidArgument(
                f"commit of allocation {a.id.hex()} carries {len(client_crcs)} CRCs for "
                f"{len(a.slots)} slots; send one per slot or none"
            )
        # The client's write access ends before the service reads what it wrote: no byte
        # can change between the CRC below and the index.
        self._registry.grant_ended(a.id)
        # The allocation stays registered while its CRCs are computed so the reaper
        # cannot recycle its slots underneath; then it is retired.
        a.done = True
        # From here the commit runs to its end even if the request is cancelled (its
        # client gone, a deadline passed): cut short, the allocation would stay ``done``
        # and registered, and a write-through commit's extents durable but never indexed
        # (leaked). The client, not answered, may find its blocks stored.
        return await self._ctx.io.uncancellable(self._commit_now(a, client_crcs))

    async def commit_filled(self, a: Allocation, fill: Callable[[], Awaitable[list[int]]],
                            declared: Sequence[int]) -> int:
        """Commit ``a``, whose slots the service fills itself (a staged put,
        :mod:`~ctxmem_dpu.store.staging`): ``fill`` copies into them and returns each
        slot's CRC32C of the bytes it stored (one pass, so no second check);
        ``declared``: the client's CRCs (empty: none declared). Blocks committed."""
        self._registry.grant_ended(a.id)  # the client never had write access: nothing to end
        a.done = True
        return await self._ctx.io.uncancellable(self._commit_now(a, declared, fill))

    async def commit_group(self, s: Session, allocation_ids: Sequence[bytes],
                           client_crcs: Sequence[Sequence[int]]) -> int:
        """Commit the allocations of a block group's members together, all or nothing
        per key (module doc); returns how many blocks were committed, all members'."""
        if len(set(allocation_ids)) != len(allocation_ids):
            raise InvalidArgument("group commit names an allocation twice; name each "
                                  "member's allocation once")
        allocs = [self._registry.allocation(s, i) for i in allocation_ids]
        for a, crcs in zip(allocs, client_crcs, strict=True):
            if a.done:
                raise InvalidArgument(
                    f"group commit of allocation {a.id.hex()}: a data-plane WRITE into it "
                    f"is still in flight, or it is being committed; wait for every "
                    f"WRITE's answer, then commit once")
            if len(crcs) != len(a.slots):
                raise InvalidArgument(
                    f"group commit of allocation {a.id.hex()} carries {len(crcs)} CRC32Cs "
                    f"for {len(a.slots)} slots; send the CRC32C of every block written, "
                    f"member after member, in slot order")
        if len({a.ns.digest for a in allocs}) != len(allocs):
            raise InvalidArgument("group commit: two allocations of one namespace; a group "
                                  "has one allocation per member namespace")
        for a in allocs:
            self._registry.grant_ended(a.id)
            a.done = True
        return await self._ctx.io.uncancellable(self._commit_group_now(allocs, client_crcs))

    async def _commit_group_now(self, allocs: list[Allocation],
                                client_crcs: Sequence[Sequence[int]]) -> int:
        work_as(IoClass.STORE, allocs[0].ns.tenant)
        dram = self._ctx.dram
        counters = self._ctx.counters
        computed = [await self._crcs.of_slots(dram, a.slots, a.ns.block_nbytes)
                    for a in allocs]
        faults.point("commit.after_crc")
        for a in allocs:
            self._registry.forget_allocation(a)
        # A key whose block differs from its client's CRC in any member is stored in none.
        bad: set[bytes] = set()
        for a, mine, theirs in zip(allocs, computed, client_crcs, strict=True):
            if list(theirs) != mine:
                for key, got, sent in zip(a.keys, mine, theirs, strict=True):
                    if got != sent:
                        counters["put_crc_mismatch"] += 1
                        log.warning("group commit %s: block of key %s CRC32C from client "
                                    "%08x != %08x; the key is stored in no member",
                                    a.id.hex(), key.hex()[:16], sent, got)
                        bad.add(key)
        next_seq = self._index.next_seq
        members: list[list[Block]] = []
        for a, crcs in zip(allocs, computed, strict=True):
            per_ns = self._index.namespace(a.ns.digest)
            fresh: list[Block] = []
            for key, ref, crc in zip(a.keys, a.slots, crcs, strict=True):
                if key in bad or key in per_ns:  # failed elsewhere, or committed meanwhile
                    dram.free(ref)
                    continue
                fresh.append(Block(a.ns.digest, key, a.ns.block_nbytes, a.ns.slot_size, crc,
                                   next_seq(), dram=ref))
            members.append(fresh)
        if self._ctx.flash.enabled and self._ctx.cfg.flash.write_policy == "write_through":
            committed = await self._write_through.commit_group(allocs, members)
        else:
            # Key by key (each key's members side by side): the demoter takes the oldest
            # dirty blocks first, so a batch boundary splits at most one key's members,
            # and the LRU ages a key's members together.
            by_key: dict[bytes, list[Block]] = {}
            for fresh in members:
                for b in fresh:
                    by_key.setdefault(b.key, []).append(b)
            committed = [b for blocks in by_key.values() for b in blocks]
            self._index.committed(committed, self._ctx.flash.enabled)
        faults.point("commit.after_index")
        self._index.announce(committed, True)
        counters["put_blocks"] += len(committed)
        counters["put_bytes"] += sum(b.length for b in committed)
        counters["group_commits"] += 1
        return len(committed)

    async def _commit_now(self, a: Allocation, client_crcs: Sequence[int],
                          fill: Callable[[], Awaitable[list[int]]] | None = None) -> int:
        work_as(IoClass.STORE, a.ns.tenant)  # write-through I/O goes behind gets
        dram = self._ctx.dram
        counters = self._ctx.counters
        if fill is None:
            crcs = await self._crcs.of_slots(dram, a.slots, a.ns.block_nbytes)
        else:
            try:
                crcs = await fill()
            except BaseException:
                self._registry.drop_allocation(a)
                raise
        faults.point("commit.after_crc")
        self._registry.forget_allocation(a)
        per_ns = self._index.namespace(a.ns.digest)
        # One comparison in C for the common case (every CRC matches); per block only
        # when one differs.
        check = bool(client_crcs) and list(client_crcs) != crcs
        digest, nbytes, slot_size = a.ns.digest, a.ns.block_nbytes, a.ns.slot_size
        next_seq = self._index.next_seq
        fresh: list[Block] = []
        for i, (key, ref, crc) in enumerate(zip(a.keys, a.slots, crcs, strict=True)):
            if check and client_crcs[i] != crc:
                counters["put_crc_mismatch"] += 1
                log.warning("commit %s: block %d CRC32C from client %08x != %08x; dropped",
                            a.id.hex(), i, client_crcs[i], crc)
                dram.free(ref)
                continue
            if key in per_ns:  # committed meanwhile by another writer
                dram.free(ref)
                continue
            fresh.append(Block(digest, key, nbytes, slot_size, crc, next_seq(), dram=ref))
        if self._ctx.flash.enabled and self._ctx.cfg.flash.write_policy == "write_through":
            # Visible only once durable; a failed flash write fails the commit.
            committed = await self._write_through.commit(a, fresh)
        else:
            committed = fresh
            # New blocks, never used: at probation's most recent end in order, as one
            # ``add`` each would put them (``add_unhit``), inserted in bulk.
            self._index.committed(fresh, self._ctx.flash.enabled)
        faults.point("commit.after_index")
        self._index.announce(committed, True)
        counters["put_blocks"] += len(committed)
        counters["put_bytes"] += len(committed) * a.ns.block_nbytes
        return len(committed)
