"""RDMA channel, shim side: caller buffers (addresses, owners), the registration cache,
the bounce plan, slot checks, the verified reads' landing rounds and work-request
chains. Pure bookkeeping: no verbs calls here (a verified read's transfer is passed in),
so all of it is tested without a device (tests/host/test_rdma_unit.py,
tests/host/test_verified_reads.py).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ctxmem.transport.base import TransportError
from ctxmem.transport.rdma_verbs import RdmaError
from ctxmem.transport.verified import ReadProgress
from ctxmem_common.codecs import crc32c
from ctxmem_common.proto import ctxmem_pb2 as pb

__all__ = [
    "Piece", "Registration", "RegistrationCache", "Work", "address_of", "bounce_plan",
    "chains", "land_verified", "landing_rounds", "owner_view", "slot_items",
]

log = logging.getLogger(__name__)


def address_of(view: memoryview) -> int:
    """Virtual address of a (possibly read-only) contiguous buffer's first byte."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def owner_view(view: memoryview) -> memoryview:
    """A byte view of the largest contiguous buffer that ``view`` is part of.

    numpy views are followed up their ``base`` chain (a block sliced out of a KV pool
    leads to the pool); the result always contains ``view``, else ``view`` itself.
    """
    obj: Any = view.obj
    best = memoryview(view)  # our own view object: the caller may release theirs
    if best.format != "B" or best.ndim != 1:
        best = best.cast("B")
    candidates: list[Any] = []
    while obj is not None and len(candidates) < 16:
        candidates.append(obj)
        obj = obj.base if isinstance(obj, np.ndarray) else None
    start, end = address_of(view), address_of(view) + view.nbytes
    for cand in candidates:
        try:
            mv = memoryview(cand)
        except TypeError:
            continue
        if not mv.c_contiguous or mv.nbytes <= best.nbytes:
            continue
        mv = mv.cast("B")
        a = address_of(mv)
        if a <= start and end <= a + mv.nbytes:
            best = mv
    return best


@dataclass
class Registration:
    start: int
    end: int
    lkey: int
    writable: bool
    handle: Any  # the MR
    pin: memoryview  # keeps the registered memory alive (and unmovable) while cached


class RegistrationCache:
    """Registered caller buffers, found by address containment, LRU-bounded by bytes.

    ``register(addr, nbytes, writable) -> (lkey, handle)`` and ``deregister(handle)``
    are the verbs calls (injected, so the policy is testable without a device);
    ``register`` raises :class:`RdmaError` when the memory cannot be registered.
    """

    def __init__(self, register: Callable[[int, int, bool], tuple[int, Any]],
                 deregister: Callable[[Any], None], *, min_bytes: int, max_bytes: int) -> None:
        self._register = register
        self._deregister = deregister
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self._regs: collections.OrderedDict[tuple[int, int], Registration] = \
            collections.OrderedDict()
        self._failed: set[tuple[int, int]] = set()
        self.registered_bytes = 0
        self.registrations = 0  # count of register() calls that succeeded

    def __len__(self) -> int:
        return len(self._regs)

    def find(self, addr: int, nbytes: int, need_write: bool) -> Registration | None:
        for key, reg in reversed(self._regs.items()):
            if reg.start <= addr and addr + nbytes <= reg.end and (reg.writable or not need_write):
                self._regs.move_to_end(key)
                return reg
        return None

    def lookup(self, view: memoryview, need_write: bool) -> tuple[int, int] | None:
        """(address, lkey) to use for ``view`` directly, or ``None``: stage it."""
        addr, n = address_of(view), view.nbytes
        reg = self.find(addr, n, need_write)
        if reg is not None:
            return addr, reg.lkey
        owner = owner_view(view)
        oaddr, on = address_of(owner), owner.nbytes
        if self.min_bytes <= on <= self.max_bytes:
            start, length = oaddr, on
        elif self.min_bytes <= n <= self.max_bytes:
            start, length = addr, n  # the owner is too big to pin whole: just this view
        else:
            return None
        writable = not owner.readonly
        if need_write and not writable:
            return None
        if (start, length) in self._failed:
            return None
        while self._regs and self.registered_bytes + length > self.max_bytes:
            self._evict_lru()
        try:
            lkey, handle = self._register(start, length, writable)
        except RdmaError as exc:
            log.info("ctxmem rdma: cannot register %d bytes at %#x (%s); staging through the "
                     "bounce buffer instead", length, start, exc)
            self._failed.add((start, length))
            return None
        self._regs[(start, length)] = Registration(start, start + length, lkey, writable,
                                                   handle, owner)
        self.registered_bytes += length
        self.registrations += 1
        return addr, lkey

    def _evict_lru(self) -> None:
        _key, reg = self._regs.popitem(last=False)
        self.registered_bytes -= reg.end - reg.start
        try:
            self._deregister(reg.handle)
        finally:
            reg.pin.release()

    def clear(self) -> None:
        while self._regs:
            self._evict_lru()


@dataclass(frozen=True)
class Piece:
    """``length`` bytes of item ``item`` at ``offset``, staged at ``bounce_offset``."""

    item: int
    offset: int
    length: int
    bounce_offset: int


def bounce_plan(lengths: Sequence[int], capacity: int) -> list[list[Piece]]:
    """Rounds of pieces that each fit the bounce buffer; an item bigger than the buffer
    is split across rounds. Pieces start 64-byte aligned in the buffer."""
    rounds: list[list[Piece]] = []
    cur: list[Piece] = []
    used = 0
    for i, n in enumerate(lengths):
        off = 0
        while off < n:
            if used >= capacity:
                rounds.append(cur)
                cur, used = [], 0
            take = min(n - off, capacity - used)
            cur.append(Piece(i, off, take, used))
            used += (take + 63) // 64 * 64
            off += take
    if cur:
        rounds.append(cur)
    return rounds


def landing_rounds(lengths: Sequence[int], capacity: int) -> list[tuple[int, int]]:
    """[start, stop) of each round of whole items that fit ``capacity`` bytes together (an
    item bigger than ``capacity`` gets a round of its own): a verified read lands whole
    blocks, so it can check each before delivering it."""
    rounds: list[tuple[int, int]] = []
    start = 0
    while start < len(lengths):
        stop, used = start + 1, lengths[start]
        while stop < len(lengths) and used + lengths[stop] <= capacity:
            used += lengths[stop]
            stop += 1
        rounds.append((start, stop))
        start = stop
    return rounds


def land_verified(views: Sequence[memoryview], crcs: Sequence[int], progress: ReadProgress,
                  capacity: int, landing: Callable[[int], memoryview],
                  fetch: Callable[[int, int, list[memoryview]], None]) -> None:
    """A verified read, round by round of whole blocks (:func:`landing_rounds` of
    ``capacity`` bytes): ``fetch(start, stop, parts)`` fills ``parts``, the round's slices
    of ``landing(nbytes)`` (the channel's private landing buffer), with blocks
    ``start..stop``; each is then CRC-checked against ``crcs`` there and copied into its
    view only if it matches. The first block that fails stops the read (``progress.bad``;
    it and later views untouched); ``progress.done`` counts the blocks delivered. Nothing
    else writes the landing buffer once ``fetch`` returned, so the bytes copied are the
    bytes checked."""
    for start, stop in landing_rounds([v.nbytes for v in views], capacity):
        buf = landing(sum(v.nbytes for v in views[start:stop]))
        parts, off = [], 0
        for v in views[start:stop]:
            parts.append(buf[off : off + v.nbytes])
            off += v.nbytes
        fetch(start, stop, parts)
        for j, part in enumerate(parts):
            i = start + j
            if crc32c(part) != crcs[i]:
                progress.bad = i
                return
            views[i][:] = part
            progress.done = i + 1


def slot_items(op: str, slots: Sequence[pb.Slot], views: Sequence[memoryview],
               what: str) -> list[tuple[memoryview, int, int]]:
    """``(view, remote address, rkey)`` per view, from the slot at the same index.

    Raises:
        TransportError: fewer slots than views, a slot without an RDMA address or rkey
            (the session is not attached over RDMA), or a slot and view that differ in
            length; ``op`` and ``what`` (``"lease <id>"``) name the transfer.
    """
    if len(slots) < len(views):
        raise TransportError(f"RDMA {op} of {what}: {len(views)} buffers, {len(slots)} "
                             f"slots")
    items = []
    for i, view in enumerate(views):
        slot = slots[i]
        if not slot.rkey or not slot.remote_addr:
            raise TransportError(f"RDMA {op} of {what}: slot {i} carries no RDMA address "
                                 f"or rkey (the session is not attached over RDMA)")
        if slot.length != view.nbytes:
            raise TransportError(f"RDMA {op} of {what}: slot {i} is {slot.length} bytes, "
                                 f"the buffer {view.nbytes}")
        items.append((view, slot.remote_addr, slot.rkey))
    return items


def chains(n: int, signal_every: int) -> list[tuple[int, int]]:
    """[start, stop) of each chain of WRs; the last WR of each is the signalled one."""
    per = max(1, signal_every)
    return [(i, min(i + per, n)) for i in range(0, n, per)]


@dataclass(frozen=True)
class Work:
    laddr: int
    length: int
    lkey: int
    raddr: int
    rkey: int
