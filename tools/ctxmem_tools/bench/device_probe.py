"""The flash device's O_DIRECT rates, measured once for the limits and again beside every
flash round of ``ctxmem bench``.

Why beside every round: the virtual disk of the project's machines runs at one of two
speeds from one minute to the next (2 MiB encrypted cold gets read 1.1-1.2 or
2.0-2.5 GB/s in the same hour, docs/benchmarks.md), so a cold get or a demotion held
against a limit measured once, seconds or minutes away, says as much about the disk as
about the code. :class:`DeviceProbe` writes one batch (then ``fdatasync``) and reads it
back in ``block``-sized I/Os, from one thread or several (I/Os in flight, as the
service's I/O threads have them); the limits take the better of one and two threads, and
the bench probes with two threads right next to each evict and each cold get, so that
:func:`paired_fraction` holds each round against its own probe (``*_paired`` rows).

The probe uses the limit's scratch place: a file beside the flash file (created here,
removed by :meth:`DeviceProbe.close`), or the last batch of a block device
(``--odirect-path``), zeroed again by :meth:`DeviceProbe.close` so a service finds it blank.
"""

from __future__ import annotations

import mmap
import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["DeviceProbe", "paired_fraction"]


class DeviceProbe:
    """One batch of ``count`` blocks of ``block`` bytes written and read with O_DIRECT at
    ``offset`` of ``scratch``. Use as a context manager (or call :meth:`close`)."""

    def __init__(self, scratch: Path, offset: int, block: int, count: int) -> None:
        self.scratch, self.offset, self.block, self.count = scratch, offset, block, count
        self.nbytes = block * count
        self.device = scratch.is_block_device()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_workers = 0
        self._fd = os.open(scratch, os.O_RDWR | os.O_DIRECT | (0 if self.device else os.O_CREAT),
                           0o600)
        try:
            if not self.device:
                os.ftruncate(self._fd, offset + self.nbytes)
            # Page-aligned buffers (O_DIRECT), filled with data that does not compress.
            self._bufs = [mmap.mmap(-1, block) for _ in range(count)]
            for b in self._bufs:
                b.write(os.urandom(64) * (block // 64))
        except BaseException:
            os.close(self._fd)
            raise

    def write(self, threads: int = 1) -> float:
        """Seconds to write the batch and ``fdatasync`` it; with ``threads`` > 1 that
        many threads write every ``threads``-th block each (as many I/Os in flight)."""
        t = time.perf_counter()
        self._each(threads, self._write_some)
        os.fdatasync(self._fd)
        return time.perf_counter() - t

    def read(self, threads: int = 1) -> float:
        """Seconds to read the batch back (``threads``: as :meth:`write`)."""
        t = time.perf_counter()
        self._each(threads, self._read_some)
        return time.perf_counter() - t

    def _write_some(self, first: int, step: int) -> None:
        for i in range(first, self.count, step):
            os.pwrite(self._fd, self._bufs[i], self.offset + i * self.block)

    def _read_some(self, first: int, step: int) -> None:
        for i in range(first, self.count, step):
            os.preadv(self._fd, [self._bufs[i]], self.offset + i * self.block)

    def _each(self, threads: int, part: Callable[[int, int], None]) -> None:
        if threads <= 1:
            part(0, 1)
            return
        if self._pool is None or self._pool_workers < threads - 1:
            if self._pool is not None:
                self._pool.shutdown()
            self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="bench-probe")
            self._pool_workers = threads - 1
        futures = [self._pool.submit(part, j, threads) for j in range(1, threads)]
        part(0, threads)
        for f in futures:
            f.result(timeout=120)

    def close(self) -> None:
        """Give the place back as it was: a scratch file removed, a device's bytes zeroed."""
        if self._fd < 0:
            return
        try:
            if self.device:
                zero = mmap.mmap(-1, self.block)
                for i in range(self.count):
                    os.pwrite(self._fd, zero, self.offset + i * self.block)
                os.fdatasync(self._fd)
        finally:
            if self._pool is not None:
                self._pool.shutdown()
            os.close(self._fd)
            self._fd = -1
            for b in self._bufs:
                b.close()
            if not self.device:
                self.scratch.unlink(missing_ok=True)

    def __enter__(self) -> DeviceProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def paired_fraction(op_s: Sequence[float], device_s: Sequence[float],
                    device_cap_s: float = 0.0) -> float:
    """The median over rounds of (the device's time for the batch in that round / the
    operation's time for the same bytes): each round held against the disk as it was
    then. ``device_cap_s``: a floor under each round's device time (with AES-XTS, the
    cipher's time for the batch when it is the slower of the two, as ``limit_for``)."""
    if len(op_s) != len(device_s) or not op_s:
        raise ValueError(f"{len(op_s)} timed operations against {len(device_s)} device "
                         f"probes: pair one probe with each round")
    return statistics.median(max(d, device_cap_s) / o for o, d in zip(op_s, device_s,
                                                                       strict=True))
