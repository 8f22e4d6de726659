"""The DRAM tier: slabs of anonymous shared memory (one memfd each).

Why one memfd per slab rather than one big region: the shared-memory transport gives a
client the *fd* of a slab so it can copy straight into and out of its slots. A slab is
only ever assigned to one *owner* at a time (the allocator's class includes it): the
store's owner is a namespace, ``(tenant, namespace digest)``, so handing out a slab's fd
never exposes another tenant's bytes, nor another namespace's of the same tenant (the
``cache_salt`` separation). When a slab goes to another owner a fresh memfd (with a higher
``generation``) backs it; a client still mapping the old one keeps private, detached pages
and never sees the new owner's data.

Every memfd is sealed (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) before any fd of it
leaves the service: a client holding the fd cannot resize it (ftruncate gets EPERM), so
the service's own mapping can never lose its pages under it (SIGBUS would kill the
service). A client that maps past the end faults only itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from array import array
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from ctxmem_dpu.alloc import Slab, SlabAllocator, SlotRef
from ctxmem_dpu.tiers.base import Tier

PAGE = 4096

# The seals every slab carries before its fd is handed out: no shrink, no grow, no
# removing them.
SLAB_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
assert array("I").itemsize == 4 and array("Q").itemsize == 8


#: From this many refs :meth:`DramTier.slot_ndarrays` spreads the per-slab values with
#: numpy; below it, through lists (32 refs: lease_slots + encoding 16 -> 10 µs, as before).
SLOT_NDARRAYS_MIN = 64


def int_array(values: Sequence[int], wide: bool) -> np.ndarray:
    """``values`` as a native uint32 (or with ``wide`` uint64) numpy array. Through
    ``array.array``: about 3x faster than ``np.array`` from a list of ints (1,024: 4.5 vs
    13 µs), which is most of what turning a lease's slots into arrays costs."""
    return np.frombuffer(array("Q" if wide else "I", values), np.uint64 if wide else np.uint32)

# Who a slab belongs to: a tenant name (tests, tools) or (tenant, namespace digest).
Owner = str | tuple[str, bytes] | None


def owner_tenant(owner: object) -> str | None:
    """The tenant of a slab owner (a tenant name, or a (tenant, digest) namespace)."""
    if isinstance(owner, tuple):
        return str(owner[0])
    return owner if isinstance(owner, str) else None


def round_up(n: int, align: int = PAGE) -> int:
    return (n + align - 1) // align * align


class DramRegion:
    """One slab's memory: a memfd and the service's own mapping of it."""

    def __init__(self, slab_id: int, size: int, generation: int) -> None:
        self.slab_id = slab_id
        self.size = size
        self.generation = generation
        self.fd = os.memfd_create(f"ctxmem-slab-{slab_id}-g{generation}",
                                  os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SLAB_SEALS)
            # MAP_POPULATE: fault the whole slab in once, here, instead of one page fault
            # per 4 KiB on the first put into each slot (measured: it halved put time).
            self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self.mm)

    def close(self) -> None:
        self.view.release()
        # A transfer may still hold a view; the mapping is then freed when that view goes.
        with contextlib.suppress(BufferError):
            self.mm.close()
        os.close(self.fd)


class DramTier(Tier[SlotRef]):
    """The DRAM tier: ``size // slab_size`` slabs, each assigned to one class (owner,
    slot size) at a time and backed by its own :class:`DramRegion` while assigned.
    ``prefault``: create and fault in every slab's memory up front."""

    def __init__(self, size: int, slab_size: int, prefault: bool = False) -> None:
        self.slab_size = slab_size
        self.num_slabs = size // slab_size
        self.regions: dict[int, DramRegion] = {}
        self._idle: dict[int, tuple[object, DramRegion]] = {}  # released slab -> (owner, memory)
        self._generations = [0] * self.num_slabs
        self.alloc = SlabAllocator(
            self.num_slabs,
            slots_per_slab=lambda slot: slab_size // slot if slot else 0,
            on_assign=self._assign,
            on_release=self._release,
        )
        # RDMA (issue 3): called with (slab_id, generation) just before a slab's memory is
        # unmapped to go to another owner, so memory regions over it are deregistered first.
        self.on_retire: list[Callable[[int, int], None]] = []
        if prefault:
            # Allocate and fault in the whole tier now (owner None: never seen by anyone),
            # so no request pays for zeroing fresh pages.
            for i in range(self.num_slabs):
                self._generations[i] = 1
                self._idle[i] = (None, DramRegion(i, slab_size, 1))

    def _assign(self, slab: Slab) -> None:
        owner = self._owner(slab.klass)
        kept = self._idle.pop(slab.id, None)
        if kept is not None and kept[0] in (owner, None):
            # Same owner as before: reuse the memory (already faulted in, and clients'
            # mappings of this generation stay valid; no other owner ever saw it).
            self.regions[slab.id] = kept[1]
            return
        if kept is not None:
            for hook in self.on_retire:
                hook(slab.id, kept[1].generation)
            kept[1].close()
        self._generations[slab.id] += 1
        self.regions[slab.id] = DramRegion(slab.id, self.slab_size, self._generations[slab.id])

    def _release(self, slab: Slab) -> None:
        region = self.regions.pop(slab.id, None)
        if region is not None:
            # Keep the memory for this owner until another owner needs the slab; its
            # generation bumps then, so no mapping of the old memory is ever reused.
            self._idle[slab.id] = (self._owner(slab.klass), region)

    def allocate(self, slot_size: int, n: int, owner: Owner = None
                 ) -> list[SlotRef] | None:
        """``n`` slots of ``slot_size`` in slabs of ``owner`` (a namespace, ``(tenant,
        digest)``, or a tenant name), all or nothing."""
        return self.alloc.allocate(self.klass(owner, slot_size), slot_size, n)

    @staticmethod
    def klass(owner: Owner, slot_size: int) -> Hashable:
        return (owner, slot_size)

    @staticmethod
    def _owner(klass: object) -> object:
        return klass[0] if isinstance(klass, tuple) else None

    def free(self, slot: SlotRef) -> None:
        self.alloc.free(slot)

    def free_many(self, slots: Sequence[SlotRef]) -> None:
        """:meth:`free` of each of ``slots`` (in order), one step per run in one slab."""
        self.alloc.free_many(slots)

    def capacity_bytes(self) -> int:
        return self.num_slabs * self.slab_size

    def offset(self, ref: SlotRef) -> int:
        return ref.index * self.alloc.slabs[ref.slab].slot_size

    def view(self, ref: SlotRef, nbytes: int) -> memoryview:
        """The slot's bytes (``nbytes`` long) in the service's mapping."""
        off = self.offset(ref)
        return self.regions[ref.slab].view[off : off + nbytes]

    def slot_view(self, ref: SlotRef) -> memoryview:
        """The whole slot, padded to 4 KiB: what O_DIRECT reads and writes."""
        slab = self.alloc.slabs[ref.slab]
        off = ref.index * slab.slot_size
        return self.regions[ref.slab].view[off : off + slab.slot_size]

    def generation(self, slab_id: int) -> int:
        return self._generations[slab_id]

    def slot_arrays(self, refs: Sequence[SlotRef]) -> tuple[list[int], list[int], list[int]]:
        """(slab, generation, offset) of each of ``refs``: what a client maps and copies.
        The per-slab values are looked up once per slab, not once per ref (a 64 KiB
        get's Acquire has a thousand refs in a few slabs: 145 -> 105 µs for lease_slots)."""
        slabs = [r[0] for r in refs]
        used = set(slabs)
        gen = {i: self._generations[i] for i in used}
        slot = {i: self.alloc.slabs[i].slot_size for i in used}
        return slabs, [gen[i] for i in slabs], [r[1] * slot[r[0]] for r in refs]

    def slot_ndarrays(self, refs: Sequence[SlotRef]) -> tuple[np.ndarray, np.ndarray,
                                                              np.ndarray]:
        """:meth:`slot_arrays` as numpy arrays (uint32 slab, uint32 generation, uint64
        offset), what an Acquire's answer is encoded from: the per-slab values looked up
        once per slab and spread by indexing a small table of the slab ids' range (a
        lease's slots lie in a few neighbouring slabs; ``np.unique``'s sort, used when the
        range is wider than the lease, cost 48 of a 64 KiB get Acquire's 565 µs)."""
        n = len(refs)
        if n < SLOT_NDARRAYS_MIN:  # a few refs: numpy's fixed costs would dominate
            slabs_l, gens_l, offsets_l = self.slot_arrays(refs)
            return (int_array(slabs_l, wide=False), int_array(gens_l, wide=False),
                    int_array(offsets_l, wide=True))
        slab_ids, indexes = zip(*refs, strict=True)  # both fields in one pass
        slabs = int_array(slab_ids, wide=False)
        index = int_array(indexes, wide=True)
        lo, hi = int(slabs.min()), int(slabs.max())
        ids: Sequence[int]
        where: np.ndarray
        if hi - lo < n:
            ids = range(lo, hi + 1)
            where = slabs - np.uint32(lo)
        else:
            used, where = np.unique(slabs, return_inverse=True)
            ids = used.tolist()
        gen_of, slabs_of = self._generations, self.alloc.slabs
        # Slabs in the range that hold none of the slots may be unassigned: 0, never used.
        gens = int_array([gen_of[i] for i in ids], wide=False)[where]
        sizes = int_array([slabs_of[i].slot_size for i in ids], wide=True)[where]
        return slabs, gens, index * sizes

    def region_owner(self, slab_id: int) -> object:
        """The slab's owner now (None when unassigned): what a MAP is checked against."""
        return self._owner(self.alloc.slabs[slab_id].klass)

    def region_tenant(self, slab_id: int) -> str | None:
        """The tenant the slab's owner belongs to (RDMA checks, stats by tenant)."""
        return owner_tenant(self.region_owner(slab_id))

    def used_bytes(self) -> int:
        return sum(s.used * s.slot_size for s in self.alloc.slabs)

    def close(self) -> None:
        for region in self.regions.values():
            region.close()
        for _owner, region in self._idle.values():
            region.close()
        self.regions.clear()
        self._idle.clear()
