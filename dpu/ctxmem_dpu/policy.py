"""Eviction order: a segmented LRU that keeps reused prefix blocks longer.

Each tier keeps two LRU lists. New blocks enter *probation*. A block that has been
acquired ``protect_after_hits`` times (each acquire is a request reusing it: a block that
prefixes many sequences gets many) moves to *protected*. Victims come from probation,
least recently used first, and only when probation is empty from protected, LRU first.
Protected holds at most ``ceil(protected_fraction * blocks in the tier)``; when it overflows,
its LRU block drops back to probation's most-recent end (it keeps one more chance).

Why not plain LRU: a long one-off prompt streams through and would flush the system
prompt and shared document prefixes that every request reuses (scan resistance).
``OrderedDict`` gives O(1) move-to-end and removal from the middle; the order is exact and
deterministic, which the tests assert block by block.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class SegmentedLRU(Generic[T]):
    """Two LRU segments, probation and protected, in the order described above."""

    def __init__(self, protect_after_hits: int = 2, protected_fraction: float = 0.8) -> None:
        self.protect_after_hits = protect_after_hits
        self.protected_fraction = protected_fraction
        self._probation: OrderedDict[T, None] = OrderedDict()
        self._protected: OrderedDict[T, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, item: T) -> bool:
        return item in self._probation or item in self._protected

    def add(self, item: T, hits: int = 0) -> None:
        """Insert (or refresh) ``item`` as most recently used."""
        self.remove(item)
        if hits >= self.protect_after_hits:
            self._protected[item] = None
            self._rebalance()
        else:
            self._probation[item] = None

    def add_unhit(self, items: Iterable[T]) -> None:
        """Insert ``items``, none of them used yet and none already here, at probation's
        most recently used end, in order. For bulk loads (the index rebuild inserts a
        million blocks): one dict update instead of an :meth:`add` (remove + insert) each."""
        self._probation.update(dict.fromkeys(items))

    def touch(self, item: T, hits: int) -> None:
        """``item`` was used; ``hits`` is its reuse count so far."""
        if item in self._protected:
            self._protected.move_to_end(item)
        elif item in self._probation:
            if hits >= self.protect_after_hits:
                del self._probation[item]
                self._protected[item] = None
                self._rebalance()
            else:
                self._probation.move_to_end(item)

    def touch_many(self, items: Iterable[T], hits: Iterable[int]) -> None:
        """:meth:`touch` each of ``items`` in order (``hits``: each one's reuse count),
        leaving exactly the order that one :meth:`touch` per item leaves. One call per
        lease instead of one per block: the segments, the threshold and protected's cap
        are looked up once (moves between segments do not change the total, so the cap
        holds for the whole batch), and the rebalance is inlined. A batch that moves no
        item between segments runs without Python per item."""
        prot, prob = self._protected, self._probation
        threshold = self.protect_after_hits
        items, hits = list(items), list(hits)
        if len(items) != len(hits):
            raise ValueError(f"touch_many: {len(items)} items and {len(hits)} hit counts")
        # Common batches in one C-level pass each: every item in protected (a reused
        # prefix), or every one in probation and staying there (a first reuse). Moving
        # each to its segment's end in order is then exactly what the loop below does.
        if all(map(prot.__contains__, items)):
            deque(map(prot.move_to_end, items), maxlen=0)
            return
        if (not hits or max(hits) < threshold) and all(map(prob.__contains__, items)):
            deque(map(prob.move_to_end, items), maxlen=0)
            return
        cap = math.ceil(self.protected_fraction * len(self))
        for item, h in zip(items, hits, strict=True):
            if item in prot:
                prot.move_to_end(item)
            elif item in prob:
                if h >= threshold:
                    del prob[item]
                    prot[item] = None
                    while len(prot) > cap:
                        demoted, _ = prot.popitem(last=False)
                        prob[demoted] = None
                else:
                    prob.move_to_end(item)

    def remove(self, item: T) -> None:
        """Forget ``item`` (no-op when absent)."""
        self._probation.pop(item, None)
        self._protected.pop(item, None)

    def _rebalance(self) -> None:
        cap = math.ceil(self.protected_fraction * len(self))
        while len(self._protected) > cap:
            demoted, _ = self._protected.popitem(last=False)
            self._probation[demoted] = None

    def victims(self, skip: Callable[[T], bool] | None = None) -> Iterator[T]:
        """Eviction candidates in order. Iterates over a snapshot, so the caller may
        remove items while iterating."""
        for seg in (list(self._probation), list(self._protected)):
            for item in seg:
                if skip is None or not skip(item):
                    yield item

    def order(self) -> list[T]:
        """The full eviction order (tests and debugging)."""
        return list(self._probation) + list(self._protected)
