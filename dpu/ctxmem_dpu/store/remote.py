"""The store's side of the pod tier: blocks fetched from another node enter local DRAM
as copies (:meth:`RemoteBlocks.adopt`) and leave it when the cluster index no longer names
the entry they came from (:meth:`RemoteBlocks.drop_copies`), and blocks this node serves
to peers are pinned in DRAM while they are sent (:meth:`RemoteBlocks.pin_for_peer`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from crc32c import crc32c

from ctxmem_common.protoconv import TIER_REMOTE, TIER_REMOTE_DRAM
from ctxmem_dpu.alloc import SlotRef
from ctxmem_dpu.blocks import Block, Namespace
from ctxmem_dpu.store.context import StoreContext
from ctxmem_dpu.store.index import BlockIndex
from ctxmem_dpu.store.invalidation import Invalidator
from ctxmem_dpu.store.promotion import Promotion
from ctxmem_dpu.store.room import Room
from ctxmem_dpu.store.sessions import SessionRegistry


class RemoteBlocks:
    """Adoption of fetched blocks and pinning for peers, over the store's objects."""

    def __init__(self, ctx: StoreContext, index: BlockIndex, room: Room,
                 promotion: Promotion, invalidator: Invalidator,
                 registry: SessionRegistry) -> None:
        self._ctx = ctx
        self._index = index
        self._room = room
        self._promotion = promotion
        self._invalidator = invalidator
        self._registry = registry

    async def adopt(self, ns: Namespace, items: Sequence[tuple[bytes, bytes, int]],
                    origins: Sequence[bytes] | None = None) -> int:
        """Store fetched blocks (key, bytes, CRC32C) in DRAM as committed blocks of
        ``ns``; a key stored meanwhile keeps its block. Each block's CRC32C is checked
        once more over the bytes as they lie in the slot (C), so only the verified bytes
        become visible. ``origins``: per item, the packed index entry it was fetched
        under; such a block is a *copy* (``Block.origin``): DRAM only (never demoted to
        flash, so a restart cannot bring it back as this node's own), never published or
        served to peers, and served here only while the cluster index still names that
        entry (:meth:`drop_copies`; docs/pod.md, "Deletes and re-puts across nodes").
        Returns how many entered the index."""
        per_ns = self._index.get(ns.digest)
        marks: Sequence[bytes | None] = origins if origins is not None \
            else [None] * len(items)
        fresh = [(k, d, c, o) for (k, d, c), o in zip(items, marks, strict=True)
                 if k not in per_ns and len(d) == ns.block_nbytes]
        if not fresh:
            return 0
        refs = await self._room.reserve_dram(ns, len(fresh))
        dram = self._ctx.dram
        views = [dram.view(ref, ns.block_nbytes) for ref in refs]

        def copy_and_check() -> list[bool]:
            ok = []
            for v, (_k, data, crc, _o) in zip(views, fresh, strict=True):
                v[:] = data
                ok.append(crc32c(v) == crc)
            return ok

        try:
            good = await self._ctx.io.run(copy_and_check)
        except BaseException:
            for ref in refs:
                dram.free(ref)
            raise
        finally:
            for v in views:
                v.release()
        return self._index_fetched(ns, refs, [(k, c, o) for k, _d, c, o in fresh], good,
                                   TIER_REMOTE)

    async def landing(self, ns: Namespace, n: int) -> list[SlotRef]:
        """``n`` DRAM slots of ``ns`` for fetched blocks to land in (the fetch source
        receives each block straight into its slot, :meth:`adopt_landed` indexes them):
        reserved like a put's, owned by the caller until adopted or freed."""
        return await self._room.reserve_dram(ns, n)

    def adopt_landed(self, ns: Namespace, refs: Sequence[SlotRef],
                     items: Sequence[tuple[bytes, int, bytes | None]],
                     landed: Sequence[bool], fetched: str = TIER_REMOTE) -> int:
        """Index the blocks that landed, verified, in the slots of :meth:`landing` (per
        slot: key, CRC32C, origin as in :meth:`adopt`; ``landed``: whether its block is
        there and was checked in place: length, CRC32C and authenticator). No copy and no
        second read. Slots whose block did not land, or whose key was stored meanwhile
        as this node's own block, are freed; a copy another pull adopted meanwhile is
        replaced by a get's (``fetched`` ``remote``: this one was checked against the
        index later) and kept over a Prefetch's (``remote→dram``). ``fetched``: the
        source a copy's first Acquire reports (``Block.fetched``). Returns how many
        entered the index."""
        return self._index_fetched(ns, refs, items, landed, fetched)

    def free_landing(self, refs: Sequence[SlotRef]) -> None:
        """Slots of :meth:`landing` that will not be adopted (the fetch failed)."""
        self._ctx.dram.free_many(refs)

    def _index_fetched(self, ns: Namespace, refs: Sequence[SlotRef],
                       items: Sequence[tuple[bytes, int, bytes | None]],
                       good: Sequence[bool], fetched: str) -> int:
        dram = self._ctx.dram
        per_ns = self._index.namespace(ns.digest)
        n = 0
        for ref, (key, crc, origin), ok in zip(refs, items, good, strict=True):
            if not ok:
                dram.free(ref)
                continue
            cur = per_ns.get(key)
            if cur is not None:
                # This node's own block (put meanwhile) wins. A copy another pull adopted
                # while this one fetched gives way to a get's (its index check is the
                # later one; a get serves only copies its own check saw: pod/fetch.py),
                # never to a Prefetch's: a copy a get just adopted and is about to lease
                # is not replaced behind its back.
                if origin is None or cur.origin is None or fetched == TIER_REMOTE_DRAM:
                    dram.free(ref)
                    continue
                self.drop_copies([cur])
            b = Block(ns.digest, key, ns.block_nbytes, ns.slot_size, crc,
                      self._index.next_seq(), dram=ref, origin=origin,
                      fetched=fetched if origin is not None else "")
            # A copy (origin) stays in DRAM only: not dirty, never demoted.
            self._index.fetched(b, self._ctx.flash.enabled)
            n += 1
        return n

    def drop_copies(self, blocks: Sequence[Block]) -> None:
        """Take fetched copies out of the index at once (the cluster index no longer
        names the entry they were fetched under: deleted or replaced by their writer, or
        unknown now). A leased one keeps its slot until its last unpin."""
        index, invalidator = self._index, self._invalidator
        n = 0
        for b in blocks:
            if b.deleted:  # dropped already (two checks at once found it stale)
                continue
            index.copy_dropped(b)
            invalidator.unpin(b)  # frees the DRAM slot now, or at the last unpin
            n += 1
        self._ctx.counters["pod_copies_dropped"] += n

    async def pin_for_peer(self, ns_digest: bytes, keys: Sequence[bytes]
                           ) -> list[Block | None]:
        """The blocks of ``keys`` in DRAM, pinned (the caller unpins each); flash-only
        ones are promoted first when the namespace is open here, else they are misses."""
        per_ns = self._index.get(ns_digest)
        found = [per_ns.get(k) for k in keys]
        self._index.pin_many(b for b in found if b is not None)
        cold = [b for b in found if b is not None and b.dram is None]
        ns = self._registry.namespaces.get(ns_digest)
        failed: set[Block] = set(cold)
        if cold and ns is not None:
            try:
                failed = (await self._promotion.promote_fitting(ns, cold)).failed
            except BaseException:
                for b in found:
                    if b is not None:
                        self._invalidator.unpin(b)
                raise
        out: list[Block | None] = []
        for b in found:
            # A fetched copy is never served on: peers fetch from the writer, whose entry
            # the index holds (a copy's own check is against that entry, done here only).
            if b is not None and (b.dram is None or b in failed or b.deleted
                                  or b.origin is not None):
                self._invalidator.unpin(b)
                b = None
            out.append(b)
        return out

    def holdings(self) -> Iterator[tuple[bytes, Block]]:
        """(namespace digest, block) of every block in the index this node holds as its
        own (fetched copies are not: the index names their writer)."""
        for ns, per_ns in list(self._index.blocks.items()):
            for b in list(per_ns.values()):
                if b.origin is None:
                    yield ns, b
