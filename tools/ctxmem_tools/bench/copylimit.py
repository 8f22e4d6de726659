"""The copy limit of ``ctxmem bench concurrency``, sized past the last-level cache.

Why: a figure's limit must be what the machine's memory offers, steadily. The limit used
to copy each process's own 32 MiB batch into the same 32 MiB buffer every round; on a
machine with a 32 MiB L3 and a free core much of that copy ran from cache, and the
limit swung from run to run (N=1: 39.8 GB/s in one run, 27.3 in another; issue 17,
item 1). The clients' batches go through the service's slots and their own buffers, far
more than the cache holds, so the limit must too.

Here each limit process copies one batch per round, like a client, but rotates over
``pairs`` (source, destination) pairs of batch bytes each, sized by :func:`size_limit`:

* at least two pairs, so consecutive rounds never touch the same buffers;
* between two uses of one pair the process itself streams at least a cache's worth of
  other bytes (``(pairs - 1) * 2 * batch >= cache``), so nothing it copied last time is
  still cached, whatever the other processes do;
* the process's whole working set is at least twice the cache.

Every buffer is written once when it is made (its pages faulted in, untimed). The cache
size is read from sysfs (the highest level of cpu0's data or unified caches); where sysfs
does not say, :data:`ASSUMED_CACHE` stands in and the printout says so.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MiB = 1 << 20
CACHE_SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")
ASSUMED_CACHE = 64 * MiB  # where sysfs says nothing: larger than most one-CCX/die L3s
COPY_WAIT_S = 300.0  # one copy part's result: a stuck copy fails the run, not hangs it
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_cache_size(text: str) -> int:
    """Bytes of a sysfs cache ``size`` (``"32768K"``, ``"8M"``, ``"512"``)."""
    s = text.strip().upper()
    unit = s[-1] if s and s[-1] in _UNITS else ""
    digits = s[:-1] if unit else s
    if not digits.isdigit():
        raise ValueError(f"cache size {text!r}: expected digits with an optional K/M/G")
    return int(digits) * _UNITS[unit]


def last_level_cache_bytes(root: Path = CACHE_SYSFS) -> int | None:
    """Size of the highest-level data or unified cache of cpu0, or None where sysfs
    (``root/index*/{level,type,size}``) does not say."""
    best: tuple[int, int] | None = None
    for idx in sorted(root.glob("index*")):
        try:
            level = int((idx / "level").read_text())
            kind = (idx / "type").read_text().strip()
            size = parse_cache_size((idx / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified") and (best is None or level > best[0]):
            best = (level, size)
    return best[1] if best else None


@dataclass(frozen=True)
class LimitSizing:
    """How much one limit process copies from and to, and the cache it must exceed."""

    cache_bytes: int  # the last-level cache the working set is sized against
    cache_from_sysfs: bool  # False: sysfs said nothing, ASSUMED_CACHE stands in
    batch: int  # bytes copied per round (a client's batch)
    pairs: int  # (source, destination) pairs rotated over, one per round

    @property
    def per_process_bytes(self) -> int:
        return 2 * self.batch * self.pairs

    @property
    def reuse_distance_bytes(self) -> int:
        """Bytes this process streams between two uses of one pair."""
        return 2 * self.batch * (self.pairs - 1)

    def describe(self) -> str:
        cache = f"{self.cache_bytes / MiB:g} MiB" + ("" if self.cache_from_sysfs
                                                     else " (assumed: sysfs says nothing)")
        return (f"last-level cache {cache}; each limit process rotates over {self.pairs} "
                f"source/destination pairs of {self.batch / MiB:g} MiB = "
                f"{self.per_process_bytes / MiB:g} MiB working set")


def size_limit(batch: int, cache_bytes: int | None = None) -> LimitSizing:
    """The pairs a limit process copying ``batch`` bytes per round rotates over so that
    its copies run from memory, not cache (rules in the module docstring)."""
    if batch <= 0:
        raise ValueError(f"batch {batch} B: must be positive")
    known = cache_bytes is not None
    cache = cache_bytes if cache_bytes is not None else ASSUMED_CACHE
    pairs = max(2, 1 + math.ceil(cache / (2 * batch)), math.ceil(cache / batch))
    return LimitSizing(cache, known, batch, pairs)


def make_pairs(sizing: LimitSizing, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``sizing.pairs`` (source, destination) buffers, every page written once."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(sizing.pairs):
        src = rng.integers(0, 255, sizing.batch, dtype=np.uint8)
        dst = np.full(sizing.batch, 0xA5, dtype=np.uint8)
        pairs.append((src, dst))
    return pairs


def copier(method: str, pairs: list[tuple[np.ndarray, np.ndarray]], threads: int
           ) -> tuple[Callable[[int], None], Callable[[], None]]:
    """(copy, close): ``copy(r)`` copies pair ``r % len(pairs)`` by ``method``: numpy's
    one-thread copy, or the copy split over ``threads`` threads (numpy releases the GIL)."""
    if method.startswith("numpy"):
        def copy_one(r: int) -> None:
            src, dst = pairs[r % len(pairs)]
            np.copyto(dst, src)

        return copy_one, (lambda: None)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="bench-copy")
    nbytes = pairs[0][0].nbytes
    bounds = np.linspace(0, nbytes, threads + 1, dtype=np.int64) // 4096 * 4096
    bounds[-1] = nbytes
    cuts = list(itertools.pairwise(bounds.tolist()))
    parts = [[(dst[a:b], src[a:b]) for a, b in cuts] for src, dst in pairs]

    def copy_split(r: int) -> None:
        for f in [pool.submit(np.copyto, d, s) for d, s in parts[r % len(parts)]]:
            f.result(timeout=COPY_WAIT_S)

    return copy_split, (lambda: pool.shutdown(wait=True))
