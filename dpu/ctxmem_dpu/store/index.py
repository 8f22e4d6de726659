"""The index: which blocks are stored, in which tier, and in what eviction order.

``blocks`` maps a namespace digest to that namespace's key → :class:`Block` map. A block is
in it only once complete (committed, or found whole on flash at rebuild). Each tier keeps a
segmented LRU of the blocks it holds (``ctxmem_dpu.policy``); ``dirty`` holds committed
blocks that are in DRAM only and wait for the demoter.

Every change of a block's state goes through a method of :class:`BlockIndex` (issue 27
item 2): it entered the index (:meth:`~BlockIndex.committed`, :meth:`~BlockIndex.made_visible`,
:meth:`~BlockIndex.found_on_flash`, :meth:`~BlockIndex.replaced_on_flash`,
:meth:`~BlockIndex.fetched`), got a DRAM copy (:meth:`~BlockIndex.promoted`), lost it
(:meth:`~BlockIndex.dropped_dram`), became durable (:meth:`~BlockIndex.made_durable`), lost
its flash copy (:meth:`~BlockIndex.dropped_flash`, :meth:`~BlockIndex.not_durable`), was
deleted (:meth:`~BlockIndex.deleted`, :meth:`~BlockIndex.changed`), pinned or unpinned
(:meth:`~BlockIndex.pin`, :func:`unpin`), read (:meth:`~BlockIndex.touched`). Each keeps
the index maps, both LRUs and the dirty set in step; :meth:`~BlockIndex.audit` names any
state where they are not.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import groupby, repeat
from operator import attrgetter, itemgetter

import numpy as np

from ctxmem_common.config import Config
from ctxmem_common.protoconv import TIER_DRAM, TIER_FLASH
from ctxmem_dpu.alloc import SlotRef
from ctxmem_dpu.blocks import Block
from ctxmem_dpu.policy import SegmentedLRU
from ctxmem_dpu.tiers.flash import Extent

#: Keys probed per step of a prefix Lookup (BlockIndex.lookup): small enough that little
#: is probed past the first miss, large enough that the step costs nothing per key.
PREFIX_PROBE_KEYS = 1024
_NO_COPIES: dict[bytes, Block] = {}
_NS = attrgetter("ns")
_KEY = attrgetter("key")
_HITS = attrgetter("hits")


class BlockIndex:
    """Key → block per namespace, the per-tier eviction order, the dirty set, sequence
    numbers. Mutated on the event loop only."""

    def __init__(self, cfg: Config) -> None:
        self.blocks: dict[bytes, dict[bytes, Block]] = {}
        self.dram_lru: SegmentedLRU[Block] = SegmentedLRU(
            cfg.eviction.protect_after_hits, cfg.eviction.protected_fraction
        )
        self.flash_lru: SegmentedLRU[Block] = SegmentedLRU(
            cfg.eviction.protect_after_hits, cfg.eviction.protected_fraction
        )
        # Committed, DRAM only, waiting for demotion (a dict: insertion-ordered set).
        self.dirty: dict[Block, None] = {}
        # Every record gets a sequence number; at rebuild the highest one per key wins.
        self._seq = itertools.count(1)
        #: Called with (block, present) when committed blocks enter the index or blocks
        #: leave it (the pod tier's publisher; never blocks, never raises).
        self.listeners: list[Callable[[Block, bool], None]] = []
        #: Per namespace, the blocks in it that are copies fetched from another node of a
        #: pod (``Block.origin`` set): a Lookup checks these against the cluster index.
        self.copies: dict[bytes, dict[bytes, Block]] = {}

    def announce(self, blocks: Iterable[Block], present: bool) -> None:
        """Tell :attr:`listeners` that ``blocks`` entered (or left) the index."""
        for fn in self.listeners:
            for b in blocks:
                fn(b, present)

    def next_seq(self) -> int:
        """The sequence number of the next committed block."""
        return next(self._seq)

    def resume_after(self, max_seq: int) -> None:
        """Continue numbering after the highest sequence number found on flash."""
        self._seq = itertools.count(max_seq + 1)

    def namespace(self, digest: bytes) -> dict[bytes, Block]:
        """The key → block map of a namespace, created empty if needed."""
        return self.blocks.setdefault(digest, {})

    def get(self, digest: bytes) -> dict[bytes, Block]:
        """The key → block map of a namespace (an empty one, not stored, if none)."""
        return self.blocks.get(digest, {})

    def count(self) -> int:
        """Blocks in the index, all namespaces."""
        return sum(len(v) for v in self.blocks.values())

    def lookup(self, digest: bytes, keys: Sequence[bytes] | np.ndarray, prefix: bool
               ) -> list[Block | None]:
        """The blocks of ``keys`` (``None`` = miss); with ``prefix``, only the leading run.

        C-level ``map``s over the keys: engines ask for thousands at a time. With
        ``prefix`` the keys are probed :data:`PREFIX_PROBE_KEYS` at a time and the probe
        stops at the chunk holding the first miss: hashing and probing a key is most of
        a Lookup's service time, and the keys after the first miss do not change the
        answer (an engine's prompt is a stored prefix and then new blocks). ``keys`` may
        be a numpy array of packed keys (``ctxmem_common.keys.packed_key_array``): then
        only the chunks probed become ``bytes`` objects."""
        per_ns = self.get(digest)
        if not prefix:
            return list(map(per_ns.get, _as_list(keys)))
        found: list[Block | None] = []
        for start in range(0, len(keys), PREFIX_PROBE_KEYS):
            chunk = _as_list(keys[start:start + PREFIX_PROBE_KEYS])
            try:  # all hits (the common chunk): itemgetter, ~15% cheaper than map(get)
                found += (itemgetter(*chunk)(per_ns),) if len(chunk) == 1 else \
                    itemgetter(*chunk)(per_ns)
            except KeyError:  # the chunk holding the first miss (hashes now cached)
                part = list(map(per_ns.get, chunk))
                return found + part[: part.index(None)]
        return found

    def forget(self, b: Block) -> None:
        """Take ``b`` out of the index and both eviction orders (it is a miss from now)."""
        per_ns = self.blocks.get(b.ns)
        if per_ns is not None and per_ns.get(b.key) is b:
            del per_ns[b.key]
            self.announce((b,), False)
        if b.origin is not None:
            self.drop_copy(b)
        self.dram_lru.remove(b)
        self.flash_lru.remove(b)

    # -- state changes: every one of a block's goes through one of these -------------
    def committed(self, blocks: Sequence[Block], dirty: bool) -> None:
        """``blocks`` (new, never read, DRAM only) were committed: into their namespaces'
        maps, at probation's most recent end of the DRAM LRU in order and, with ``dirty``
        (a flash tier to write back to), into the dirty set. In bulk: one map update per
        run of one namespace, one LRU and one dirty-set update."""
        for digest, run in groupby(blocks, _NS):
            run_ = list(run)
            self.namespace(digest).update(zip(map(_KEY, run_), run_, strict=True))
        self.dram_lru.add_unhit(blocks)
        if dirty:
            self.dirty.update(dict.fromkeys(blocks))

    def found_on_flash(self, digest: bytes, keys: Sequence[bytes], blocks: Sequence[Block]
                       ) -> None:
        """The index rebuild found ``blocks`` (durable, flash only, keys ``keys``, none
        indexed yet) in namespace ``digest``: into its map and the flash LRU in order, in
        one update each."""
        self.namespace(digest).update(zip(keys, blocks, strict=True))
        self.flash_lru.add_unhit(blocks)

    def replaced_on_flash(self, old: Block | None, b: Block) -> None:
        """The index rebuild files ``b`` (durable, flash only, never read) under its key in
        place of ``old`` (``None``: none), in the flash LRU too."""
        if old is not None:
            self.flash_lru.remove(old)
        self.namespace(b.ns)[b.key] = b
        self.flash_lru.add(b)

    def made_visible(self, b: Block) -> None:
        """``b``, written through to flash (durable, in the flash LRU already), becomes
        visible: into its namespace's map and the DRAM LRU."""
        self.namespace(b.ns)[b.key] = b
        self.dram_lru.add(b)

    def fetched(self, b: Block, dirty: bool) -> None:
        """``b``, a block pulled from a peer into DRAM, enters the index: a copy
        (``b.origin`` set; never dirty) or this node's own block (dirty with ``dirty``)."""
        self.dram_lru.add(b)
        if b.origin is not None:
            self.add_copy(b)
        else:
            self.namespace(b.ns)[b.key] = b
            if dirty:
                self.dirty[b] = None

    def promoted(self, b: Block, ref: SlotRef) -> None:
        """``b`` (on flash) got a DRAM copy in ``ref``: into the DRAM LRU by its hits."""
        b.dram = ref
        self.dram_lru.add(b, b.hits)

    def dropped_dram(self, b: Block) -> bool:
        """``b``'s DRAM copy is gone (its slot freed by the caller): out of the DRAM LRU
        and the dirty set; with no flash copy either it leaves the index (returns True)."""
        b.dram = None
        self.dram_lru.remove(b)
        self.dirty.pop(b, None)
        if b.flash is None:
            self.forget(b)
            return True
        return False

    def dropped_dram_many(self, blocks: Sequence[Block]) -> None:
        """:meth:`dropped_dram` of each of ``blocks``; those with no flash copy leave the
        index after all have left the DRAM LRU."""
        remove, dirty_pop = self.dram_lru.remove, self.dirty.pop
        gone: list[Block] = []
        for b in blocks:
            b.dram = None
            remove(b)
            dirty_pop(b, None)
            if b.flash is None:
                gone.append(b)
        for b in gone:
            self.forget(b)

    def made_durable(self, blocks: Sequence[Block]) -> None:
        """``blocks`` (not deleted, ``flash`` set, none in the flash LRU yet) are durable
        on flash: out of the dirty set, into the flash LRU in order (by their hits)."""
        for b in blocks:
            b.durable = True
        deque(map(self.dirty.pop, blocks, repeat(None)), maxlen=0)
        lru = self.flash_lru
        if max(map(_HITS, blocks), default=0) < lru.protect_after_hits:
            lru.add_unhit(blocks)
        else:
            for b in blocks:
                lru.add(b, b.hits)

    def dropped_flash(self, b: Block) -> Extent:
        """``b``'s flash copy is evicted (returns its extent, for the caller to zero and
        free): out of the flash LRU; with a DRAM copy it is dirty again, without one it
        leaves the index."""
        ext = b.flash
        assert ext is not None, f"block {b.key.hex()[:16]} has no flash copy to drop"
        b.flash = None
        b.durable = False
        self.flash_lru.remove(b)
        if b.dram is None:
            self.forget(b)
        else:
            self.dirty[b] = None
        return ext

    def not_durable(self, b: Block) -> None:
        """``b``, written through but never made visible (its write failed, or another
        writer's copy won), goes: out of the flash LRU, marked deleted (the caller frees
        its storage, now or at the last unpin)."""
        self.flash_lru.remove(b)
        b.durable = False
        b.deleted = True

    def deleted(self, digest: bytes, keys: Sequence[bytes]) -> list[Block]:
        """Delete ``keys`` of namespace ``digest``: the blocks found leave the index, both
        LRUs and the dirty set, marked deleted and pinned once (the caller's: the last
        unpin frees their storage once the flash headers are dead); returns them."""
        per_ns = self.get(digest)
        gone = [b for k in keys if (b := per_ns.pop(k, None)) is not None]
        self.announce(gone, False)
        for b in gone:
            b.deleted = True
            if b.origin is not None:
                self.drop_copy(b)
            b.pins += 1
            self.dram_lru.remove(b)
            self.flash_lru.remove(b)
            self.dirty.pop(b, None)
        return gone

    def copy_dropped(self, b: Block) -> None:
        """``b``, a fetched copy, leaves the index (no longer named by the cluster index):
        marked deleted and pinned once (the caller unpins: that frees its slot, now or at
        the last unpin)."""
        per_ns = self.get(b.ns)
        if per_ns.get(b.key) is b:
            del per_ns[b.key]
        self.drop_copy(b)
        self.dram_lru.remove(b)
        self.dirty.pop(b, None)
        b.deleted = True
        b.pins += 1

    def changed(self, b: Block) -> None:
        """``b``'s DRAM bytes changed after commit: marked deleted, out of the index, the
        LRUs and the dirty set (a miss from now on)."""
        b.deleted = True
        self.forget(b)
        self.dirty.pop(b, None)

    def flash_lost(self, b: Block) -> None:
        """``b``'s flash copy failed its check (quarantined and freed by the caller): it
        leaves the index."""
        b.flash = None
        self.forget(b)

    @staticmethod
    def pin(b: Block) -> None:
        """Keep ``b``'s slots from being evicted or reused until :func:`unpin`."""
        b.pins += 1

    @staticmethod
    def pin_many(blocks: Iterable[Block]) -> None:
        """:meth:`pin` each of ``blocks``."""
        for b in blocks:
            b.pins += 1

    def touched(self, run: Sequence[Block]) -> None:
        """``run`` was leased (read): each one's hits counted, its read-ahead mark
        cleared, and both LRUs touched in one batch each."""
        hits: list[int] = []
        on_flash: list[Block] = []
        flash_hits: list[int] = []
        for b in run:
            b.hits += 1
            b.read_ahead = False
            hits.append(b.hits)
            if b.flash is not None:
                on_flash.append(b)
                flash_hits.append(b.hits)
        self.dram_lru.touch_many(run, hits)  # one batched touch per lease
        if on_flash:
            self.flash_lru.touch_many(on_flash, flash_hits)

    # -- invariants ------------------------------------------------------------------
    def audit(self, flash_enabled: bool = False) -> list[str]:
        """The index's invariants, checked from scratch; returns each violation (empty:
        consistent). Meaningful when no commit, demotion or promotion is half-way (the
        store's :meth:`~ctxmem_dpu.store.BlockStore.audit` adds the flash allocators).

        - every indexed block is filed under its own namespace and key, is not deleted,
          has ``pins`` ≥ 0 and a copy somewhere (DRAM or flash);
        - the DRAM LRU holds exactly the indexed blocks with a DRAM copy, the flash LRU
          exactly those with a durable flash copy; a flash copy is durable;
        - the dirty set holds only indexed blocks of this node in DRAM only, and, with
          ``flash_enabled``, every one of them;
        - the fetched copies are exactly the indexed blocks with ``origin``, in DRAM only;
        - ``count()`` and the LRUs' lengths equal the counts recomputed from the blocks.
        """
        problems: list[str] = []
        indexed: set[Block] = set()
        in_dram = on_flash = 0
        dram_lru, flash_lru, dirty = self.dram_lru, self.flash_lru, self.dirty

        def name(b: Block) -> str:
            return f"block {b.key.hex()[:16]} of namespace {b.ns.hex()[:16]}"

        for digest, per_ns in self.blocks.items():
            for key, b in per_ns.items():
                indexed.add(b)
                if b.ns != digest or b.key != key:
                    problems.append(f"{name(b)} is filed under namespace "
                                    f"{digest.hex()[:16]}, key {key.hex()[:16]}")
                if b.deleted:
                    problems.append(f"{name(b)} is deleted but still indexed")
                if b.pins < 0:
                    problems.append(f"{name(b)} has {b.pins} pins")
                if b.dram is None and b.flash is None:
                    problems.append(f"{name(b)} is indexed with no DRAM or flash copy")
                if b.flash is not None and not b.durable and b.io is None:
                    problems.append(f"{name(b)} has a flash copy that is not durable")
                if (b.dram is not None) != (b in dram_lru):
                    problems.append(f"{name(b)}: DRAM copy {b.dram is not None} but in "
                                    f"the DRAM LRU {b in dram_lru}")
                durable = b.flash is not None and b.durable
                if durable != (b in flash_lru):
                    problems.append(f"{name(b)}: durable flash copy {durable} but in the "
                                    f"flash LRU {b in flash_lru}")
                in_dram += b.dram is not None
                on_flash += durable
                own_dram_only = b.dram is not None and b.flash is None and b.origin is None
                if flash_enabled and own_dram_only and b not in dirty:
                    problems.append(f"{name(b)} is in DRAM only but not in the dirty set")
                if b.origin is not None:
                    if self.copies.get(digest, _NO_COPIES).get(key) is not b:
                        problems.append(f"{name(b)} is a fetched copy not listed as one")
                    if b.flash is not None:
                        problems.append(f"{name(b)} is a fetched copy with a flash copy")
        for b in dirty:
            if b not in indexed:
                problems.append(f"{name(b)} is dirty but not indexed")
            elif b.dram is None or b.flash is not None or b.origin is not None:
                problems.append(f"{name(b)} is dirty but not a DRAM-only block of this node")
        for lru, what in ((dram_lru, "DRAM"), (flash_lru, "flash")):
            strays = [b for b in lru.order() if b not in indexed]
            if strays:
                problems.append(f"{len(strays)} blocks in the {what} LRU are not indexed, "
                                f"first {name(strays[0])}")
        for digest, per_copy in self.copies.items():
            for key, b in per_copy.items():
                if b.origin is None or self.get(digest).get(key) is not b:
                    problems.append(f"{name(b)} is listed as a fetched copy but is not "
                                    f"one in the index")
        if self.count() != len(indexed):
            problems.append(f"count() says {self.count()} blocks, {len(indexed)} indexed")
        if len(dram_lru) != in_dram:
            problems.append(f"DRAM LRU holds {len(dram_lru)} blocks, {in_dram} have a "
                            f"DRAM copy")
        if len(flash_lru) != on_flash:
            problems.append(f"flash LRU holds {len(flash_lru)} blocks, {on_flash} have a "
                            f"durable flash copy")
        return problems

    # -- copies fetched from other nodes of a pod ------------------------------------
    def add_copy(self, b: Block) -> None:
        """Index ``b``, a copy fetched from another node (``b.origin`` set)."""
        self.namespace(b.ns)[b.key] = b
        self.copies.setdefault(b.ns, {})[b.key] = b

    def drop_copy(self, b: Block) -> None:
        """``b`` (a fetched copy) left the index: forget it as a copy too."""
        per_ns = self.copies.get(b.ns)
        if per_ns is not None and per_ns.get(b.key) is b:
            del per_ns[b.key]
            if not per_ns:
                del self.copies[b.ns]

    def copies_of(self, digest: bytes) -> dict[bytes, Block]:
        """Key → fetched copy in namespace ``digest`` (empty, not stored, if none)."""
        return self.copies.get(digest, _NO_COPIES)


def unpin(b: Block) -> bool:
    """Drop one pin of ``b``; True when that was the last pin of a deleted block with no
    I/O in flight (the caller frees its storage then)."""
    b.pins -= 1
    assert b.pins >= 0, f"block {b.key.hex()[:16]} unpinned more often than pinned"
    return b.pins == 0 and b.deleted and b.io is None


def _as_list(keys: Sequence[bytes] | np.ndarray) -> Sequence[bytes]:
    """``keys`` as ``bytes`` objects: a packed-key array's ``tolist`` (one C call)."""
    if isinstance(keys, np.ndarray):
        out: list[bytes] = keys.tolist()
        return out
    return keys


def tier_of(b: Block) -> str:
    """Where a get of ``b`` is served from now: DRAM when it has a copy there."""
    return TIER_DRAM if b.dram is not None else TIER_FLASH


async def wait_io(blocks: Iterable[Block]) -> None:
    """Wait until no demotion or promotion of ``blocks`` is in flight."""
    pending = [b.io for b in blocks if b.io is not None]
    if pending:
        await asyncio.wait(pending)
