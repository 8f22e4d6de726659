"""Slab allocator for fixed-size KV blocks, used by both the DRAM and the flash tier.

KV blocks of one namespace all have the same size, so the space is cut into equal
*slabs* (64 MiB of DRAM, 256 MiB of flash by default) and each slab, once handed to a
*class* (a slot size, plus the tenant for DRAM), is cut into equal slots. Freeing a slot
never leaves a hole that another size cannot use: when a slab's last slot is freed the
whole slab returns to the pool and can serve any class. This is memcached's answer to
fragmentation; it costs at most one partly used slab per class.

Within a class, slots come from the lowest-numbered slab that has room, so the others
drain and become free sooner. All operations are O(1) amortised except choosing a slab
(O(partial slabs of the class), which is small).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import groupby, repeat
from operator import itemgetter
from typing import NamedTuple


class SlotRef(NamedTuple):
    """One slot of a slab. A NamedTuple (not a frozen dataclass) for the same reason as
    :class:`~ctxmem_dpu.tiers.flash.Extent`: every block of a batch makes and hashes
    several (allocation, frees, the in-flight and quarantine sets), and a tuple is made
    about 5x and hashed about 10x faster (64 KiB blocks, issue 17 item 3)."""

    slab: int
    index: int  # type: ignore[assignment]  # shadows tuple.index: a field here


_SLAB_OF = itemgetter(0)
_INDEX_OF = itemgetter(1)


@dataclass(slots=True)
class Slab:
    id: int
    klass: Hashable | None = None
    slot_size: int = 0
    capacity: int = 0
    free: list[int] = field(default_factory=list)
    used: int = 0


class SlabAllocator:
    """Hands out slots of a class's size; all-or-nothing per request.

    ``slots_per_slab(slot_size)`` says how many slots fit in one slab (the flash tier
    reserves room for a slab header and a record-header table). ``on_assign`` /
    ``on_release`` let a tier prepare or recycle a slab's backing (a memfd, a header).
    """

    def __init__(
        self,
        num_slabs: int,
        slots_per_slab: Callable[[int], int],
        on_assign: Callable[[Slab], None] | None = None,
        on_release: Callable[[Slab], None] | None = None,
    ) -> None:
        self.slabs = [Slab(i) for i in range(num_slabs)]
        # Free slabs are taken lowest id first so placement is deterministic (tests).
        self._free_slabs = list(range(num_slabs - 1, -1, -1))
        self._partial: dict[Hashable, set[int]] = {}
        self._slots_per_slab = slots_per_slab
        self._on_assign = on_assign
        self._on_release = on_release
        self.quarantined: set[SlotRef] = set()

    @property
    def free_slabs(self) -> int:
        return len(self._free_slabs)

    def free_slots(self, klass: Hashable) -> int:
        return sum(len(self.slabs[s].free) for s in self._partial.get(klass, ()))

    def can_allocate(self, klass: Hashable, slot_size: int, n: int) -> bool:
        per = self._slots_per_slab(slot_size)
        if per < 1:
            return False
        have = self.free_slots(klass)
        return have + len(self._free_slabs) * per >= n

    def allocate(self, klass: Hashable, slot_size: int, n: int) -> list[SlotRef] | None:
        """``n`` slots of ``klass``, or ``None`` (nothing taken) when they do not fit."""
        if n == 0:
            return []
        if not self.can_allocate(klass, slot_size, n):
            return None
        out: list[SlotRef] = []
        partial = self._partial.setdefault(klass, set())
        while len(out) < n:
            if partial:
                slab = self.slabs[min(partial)]
            else:
                slab = self._assign(klass, slot_size)
                partial.add(slab.id)
            take = min(n - len(out), len(slab.free))
            # The last ``take`` free slots, last first (what ``take`` pops would give),
            # made into SlotRefs in C: no Python call per slot.
            cut = len(slab.free) - take
            got = slab.free[cut:]
            del slab.free[cut:]
            got.reverse()
            out += map(tuple.__new__, repeat(SlotRef), zip(repeat(slab.id), got))
            slab.used += take
            if not slab.free:
                partial.discard(slab.id)
        return out

    def _assign(self, klass: Hashable, slot_size: int) -> Slab:
        slab = self.slabs[self._free_slabs.pop()]
        slab.klass = klass
        slab.slot_size = slot_size
        slab.capacity = self._slots_per_slab(slot_size)
        # Pop from the end: slot 0 is handed out first.
        slab.free = list(range(slab.capacity - 1, -1, -1))
        slab.used = 0
        if self._on_assign is not None:
            self._on_assign(slab)
        return slab

    def free(self, ref: SlotRef) -> None:
        slab = self.slabs[ref.slab]
        assert slab.klass is not None and 0 <= ref.index < slab.capacity, (
            f"free of slot {ref} in unassigned slab {slab.id}: double free in the caller"
        )
        if ref in self.quarantined:
            # Stays counted as used: it is never handed out again and its slab is never
            # recycled, so the bad extent cannot be reused.
            return
        slab.free.append(ref.index)
        slab.used -= 1
        assert slab.used >= 0, f"slab {slab.id} freed more slots than it handed out"
        self._partial.setdefault(slab.klass, set()).add(slab.id)
        if slab.used == 0:
            self._release(slab)

    def free_many(self, refs: Sequence[SlotRef]) -> None:
        """:meth:`free` of each of ``refs``, in order, one step per run of refs in one slab
        (the lists, counts and slab releases end as one :meth:`free` per ref leaves them):
        dropping the DRAM copies of a 64 KiB demotion frees hundreds of slots at once
        (issue 17 item 3)."""
        if self.quarantined:
            refs = [r for r in refs if r not in self.quarantined]
        for slab_id, run in groupby(refs, _SLAB_OF):
            idx = list(map(_INDEX_OF, run))
            slab = self.slabs[slab_id]
            assert slab.klass is not None and min(idx) >= 0 and max(idx) < slab.capacity, (
                f"free of slots {idx[:4]}... in slab {slab.id} (unassigned, or past its "
                f"{slab.capacity} slots): double free in the caller"
            )
            slab.free += idx
            slab.used -= len(idx)
            assert slab.used >= 0, f"slab {slab.id} freed more slots than it handed out"
            self._partial.setdefault(slab.klass, set()).add(slab.id)
            if slab.used == 0:
                self._release(slab)

    def quarantine(self, ref: SlotRef) -> None:
        """Take a slot out of use for good (it failed an integrity check)."""
        self.quarantined.add(ref)

    def claim(self, klass: Hashable, slot_size: int, ref: SlotRef) -> None:
        """Mark a specific slot used (rebuilding the allocator from flash at start)."""
        slab = self.slabs[ref.slab]
        if slab.klass is None:
            self._free_slabs.remove(slab.id)
            slab.klass = klass
            slab.slot_size = slot_size
            slab.capacity = self._slots_per_slab(slot_size)
            slab.free = list(range(slab.capacity - 1, -1, -1))
            slab.used = 0
            self._partial.setdefault(klass, set()).add(slab.id)
        assert slab.klass == klass, f"slab {slab.id} claimed for {klass} but holds {slab.klass}"
        slab.free.remove(ref.index)
        slab.used += 1
        if not slab.free:
            self._partial[klass].discard(slab.id)

    def _release(self, slab: Slab) -> None:
        assert slab.klass is not None
        self._partial.get(slab.klass, set()).discard(slab.id)
        if self._on_release is not None:
            self._on_release(slab)
        slab.klass = None
        slab.slot_size = slab.capacity = slab.used = 0
        slab.free = []
        self._free_slabs.append(slab.id)
        self._free_slabs.sort(reverse=True)

    def used_slots(self) -> int:
        return sum(s.used for s in self.slabs)
