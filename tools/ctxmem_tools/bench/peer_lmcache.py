"""``ctxmem bench --peer lmcache``: LMCache's own storage manager beside ctxmem, round by round.

The figure a reader wants is not "ctxmem is N% of memcpy" but "is ctxmem faster than what
they would run otherwise". So in the same run, on the same buffers, the same block size and
the same file system as ctxmem's flash file, this drives LMCache's ``StorageManager`` with
its two local backends and nothing else: ``LocalCPUBackend`` (the hot cache, LMCache's DRAM
tier) and ``LocalDiskBackend`` with ``use_odirect`` (its flash tier; no network, no GPU).
Each LMCache round runs beside a ctxmem round (``bench_service``'s ``peer_round`` hook:
after it in even rounds, before it in odd ones), so both see the same neighbours on a
shared machine and neither always runs in the other's wake.

An LMCache round does what its engine does around the GPU copy, with a numpy buffer in the
GPU's place: allocate memory objects from its allocator, copy the caller's blocks in
(``torch`` ``copy_``, as its connectors do) and ``batched_put`` to both backends; get is
``batched_get`` plus the copy out into the caller's buffers. Every get's bytes are compared
with what was stored (:class:`PeerMismatch`), so a broken adapter cannot post a fast figure.

LMCache's disk put is asynchronous and never syncs: ``LocalDiskBackend.write_file`` opens
one file per chunk with ``O_DIRECT``, ``os.write``s it and closes it, with no
``fsync``/``fdatasync`` (the file's extents and directory entry are not journaled, the
device's write cache is not flushed). So its put is timed three ways: when ``batched_put``
returns (``lmcache_dram_put``: the hot cache has it, the disk write is queued), when every
chunk is in its disk index (``lmcache_put_disk_*_nosync``: written, not durable), and after
an ``fdatasync`` of every chunk file and an ``fsync`` of the directory at the end of the
batch (``lmcache_put_durable``), which is what ctxmem's put plus demotion
(``put_durable_*_xts``: AES-XTS, CRC32C, ``fdatasync`` of the flash file) guarantees.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ctxmem_tools.bench.cpu import own_cpu_seconds
from ctxmem_tools.bench.datapath import GB, Result, _pct, limit_for

INSTALL = ("LMCache is not importable here; `ctxmem bench --peer lmcache` runs LMCache's own "
           "storage manager. Install it next to ctxmem with: pip install torch==2.13.0 "
           "lmcache==0.5.6 (torch==2.13.0 keeps the CPU build; docs/engines.md)")
TORCH_THREADS = 1
WAIT_S = 120.0  # the longest a batch's disk writes may take before the round fails
SYNC_NOTE = "LMCache writes each chunk file with O_DIRECT and never fsyncs"


class PeerUnavailable(RuntimeError):
    """LMCache (or torch) cannot be imported: the message says what to install."""


class PeerMismatch(AssertionError):
    """LMCache returned bytes that differ from what was stored (or too few blocks)."""


def lmcache_version() -> str:
    """LMCache's version, importing it quietly (no usage reporting, warnings only);
    :class:`PeerUnavailable` naming what to install when it cannot be imported."""
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    try:
        import lmcache
        import torch  # noqa: F401
        from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: F401
    except ImportError as exc:
        raise PeerUnavailable(f"{INSTALL} (import failed: {exc})") from exc
    return str(getattr(lmcache, "__version__", "unknown"))


@dataclass(frozen=True)
class Pair:
    """One printed row: a ctxmem figure and the LMCache figure it is held against."""

    row: str
    ctxmem: str
    lmcache: str
    note: str = ""


def pairs(size: str) -> list[Pair]:
    """The rows for one block size (``2MiB``/``64KiB``), ctxmem with CRC32C and AES-XTS on."""
    return [
        Pair("DRAM-hit get", f"dram_get_{size}_xts", f"lmcache_dram_get_{size}"),
        Pair("cold flash get", f"flash_get_{size}_xts", f"lmcache_flash_get_{size}",
             "LMCache: O_DIRECT read of one file per chunk"),
        Pair("put (call returns)", f"dram_put_{size}_xts", f"lmcache_dram_put_{size}",
             "LMCache: in its hot cache, disk write still queued"),
        Pair("put until on disk", f"put_durable_{size}_xts", f"lmcache_put_disk_{size}_nosync",
             f"LMCache NOT durable: {SYNC_NOTE}"),
        Pair("put until durable", f"put_durable_{size}_xts", f"lmcache_put_durable_{size}",
             "LMCache + fdatasync of each file and the dir at batch end"),
    ]


class LMCachePeer:
    """One LMCache ``StorageManager`` (hot cache + O_DIRECT local disk) for one block size,
    sized for two batches so nothing is evicted behind the benchmark's back."""

    def __init__(self, disk_dir: Path, block: int, batch: int, tag: str) -> None:
        import torch
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.storage_manager import StorageManager

        self._torch = torch
        # One intra-op thread for the copies in and out: with torch's default (one OpenMP
        # thread per core) a 2 MiB copy_ ran at 0.14 GB/s on the shared 2-core machine
        # (spinning barriers, oversubscribed cores) against 20+ GB/s with one thread, and
        # the spinning threads steal the ctxmem service's CPU. That would be a fake win.
        torch.set_num_threads(TORCH_THREADS)
        if block % 2048:
            raise ValueError(f"block {block} B is not a whole number of 2 x 1024-byte rows")
        self.block, self.batch, self.tag = block, batch, tag
        self.size = f"{block >> 20}MiB" if block >= 1 << 20 else f"{block >> 10}KiB"
        self.disk_dir = disk_dir
        disk_dir.mkdir(parents=True, exist_ok=True)
        tokens = block // 2 // 1024  # KV_2LTD: [2, 1 layer, tokens, 1024] uint8 per chunk
        self._shape = torch.Size([2, 1, tokens, 1024])
        batch_gib = block * batch / 2**30
        # The disk tier's capacity is the whole file system: LocalDiskBackend.remove() does
        # not give the bytes back to its admission count (current_cache_size, 0.5.6), so
        # with a few batches' capacity a later round's put is refused (logged, dropped)
        # although every earlier chunk was deleted. Nothing is preallocated either way.
        fs = os.statvfs(disk_dir)
        cfg = LMCacheEngineConfig.from_dict({
            "chunk_size": tokens, "local_cpu": True,
            "max_local_cpu_size": 2 * batch_gib + 0.0625,
            "local_disk": str(disk_dir),
            "max_local_disk_size": fs.f_blocks * fs.f_frsize / 2**30,
            "extra_config": {"use_odirect": True},
        })
        md = LMCacheMetadata(model_name=f"ctxmem-bench-{tag}", world_size=1,
                             local_world_size=1, worker_id=0, local_worker_id=0,
                             kv_dtype=torch.uint8, kv_shape=(1, 2, tokens, 1, 1024),
                             use_mla=False, chunk_size=tokens)
        self.sm: Any = StorageManager(cfg, md, EventManager())
        self.disk: Any = self.sm.storage_backends["LocalDiskBackend"]
        if not self.disk.use_odirect:
            raise RuntimeError(f"LMCache's LocalDiskBackend at {disk_dir} did not take "
                               "use_odirect: its figures would come from the page cache")
        self.times: dict[str, list[float]] = {p.lmcache: [] for p in pairs(self.size)}
        # CPU seconds of this process (every thread: LMCache's writers and readers too)
        # per row; LMCache has no service, so this is all of its CPU.
        self.cpu: dict[str, float] = dict.fromkeys(self.times, 0.0)
        self.last_put_cpu = (0.0, 0.0, 0.0)

    def _keys(self, r: int) -> list[Any]:
        from lmcache.utils import CacheEngineKey

        base = (r + 1) * 1_000_003 + self.block
        return [CacheEngineKey(f"ctxmem-bench-{self.tag}", 1, 0, base + i, self._torch.uint8)
                for i in range(self.batch)]

    def _paths(self, keys: list[Any]) -> list[str]:
        return [self.disk._key_to_path(k) for k in keys]

    def put(self, keys: list[Any], bufs: list[np.ndarray]) -> tuple[float, float, float]:
        """Store ``bufs``; seconds until ``batched_put`` returned, until every chunk is in
        the disk index, and until those files and their directory are fdatasync'd (the
        CPU seconds at each point in :attr:`last_put_cpu`)."""
        from lmcache.v1.memory_management import MemoryFormat

        torch = self._torch
        c0 = own_cpu_seconds()
        t0 = time.perf_counter()
        objs = self.sm.batched_allocate(self._shape, torch.uint8, len(keys),
                                        fmt=MemoryFormat.KV_2LTD)
        if objs is None:
            raise RuntimeError(f"LMCache could not allocate {len(keys)} x {self.block} B")
        for obj, buf in zip(objs, bufs, strict=True):
            obj.tensor.view(-1).copy_(torch.from_numpy(buf))
        self.sm.batched_put(keys, objs)
        returned = time.perf_counter() - t0
        c_returned = own_cpu_seconds() - c0
        deadline = time.monotonic() + WAIT_S
        for k in keys:  # writes land in order of submission, roughly: poll the next missing
            while not self.disk.contains(k):
                # A finished write enters the index before it leaves the put tasks: in
                # neither means the backend refused it (admission), which it only logs.
                if not self.disk.exists_in_put_tasks(k) and not self.disk.contains(k):
                    raise RuntimeError(f"LMCache's disk backend refused chunk {k.chunk_hash} "
                                       f"({self.block} B) in {self.disk_dir}: full?")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"LMCache did not write chunk {k.chunk_hash} to "
                                       f"{self.disk_dir} within {WAIT_S:.0f} s")
                time.sleep(0.0002)
        written = time.perf_counter() - t0
        c_written = own_cpu_seconds() - c0
        for path in self._paths(keys):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        self._fsync_dir()
        durable = time.perf_counter() - t0
        self.last_put_cpu = (c_returned, c_written, own_cpu_seconds() - c0)
        return returned, written, durable

    def _fsync_dir(self) -> None:
        dfd = os.open(self.disk_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def get(self, keys: list[Any], outs: list[np.ndarray], location: str) -> float:
        """``batched_get`` from one backend and copy out into ``outs``; seconds taken."""
        torch = self._torch
        t0 = time.perf_counter()
        objs = self.sm.batched_get(keys, location=location)
        missing = sum(o is None for o in objs)
        if missing:
            raise PeerMismatch(f"LMCache {location} served {len(keys) - missing} of "
                               f"{len(keys)} chunks")
        for obj, out in zip(objs, outs, strict=True):
            torch.from_numpy(out).copy_(obj.tensor.view(-1))
            obj.ref_count_down()
        return time.perf_counter() - t0

    def evict_to_disk(self, keys: list[Any]) -> None:
        """Drop the chunks from the hot cache (and any page-cache pages of their files), so
        the next get reads the device."""
        self.sm.batched_remove(keys, locations=["LocalCPUBackend"])
        for path in self._paths(keys):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def round(self, r: int, bufs: list[np.ndarray], outs: list[np.ndarray]) -> None:
        """One round on fresh keys: put (three times), DRAM-hit get, cold get, delete;
        every get's bytes compared with ``bufs``."""
        keys = self._keys(r)
        s = self.size
        names = (f"lmcache_dram_put_{s}", f"lmcache_put_disk_{s}_nosync",
                 f"lmcache_put_durable_{s}")
        for name, secs, cpu in zip(names, self.put(keys, bufs), self.last_put_cpu, strict=True):
            self.times[name].append(secs)
            self.cpu[name] += cpu
        for name, location in ((f"lmcache_dram_get_{s}", "LocalCPUBackend"),
                               (f"lmcache_flash_get_{s}", "LocalDiskBackend")):
            if location == "LocalDiskBackend":
                self.evict_to_disk(keys)
            for out in outs:
                out.fill(0)
            c0 = own_cpu_seconds()
            self.times[name].append(self.get(keys, outs, location))
            self.cpu[name] += own_cpu_seconds() - c0
            check_equal(bufs, outs, f"{name} round {r}")
        self.sm.batched_remove(keys)
        self._fsync_dir()  # commit the unlinks now, not during ctxmem's next timed put

    def results(self, limits: dict[str, float]) -> list[Result]:
        """GB/s of the median batch and p50/p99 ms per batch, as ctxmem's rows."""
        return peer_results(self.times, self.cpu, self.block * self.batch, limits)

    def close(self) -> None:
        self.sm.close()


def peer_results(times: dict[str, list[float]], cpu: dict[str, float], nbytes: int,
                 limits: dict[str, float]) -> list[Result]:
    """A peer's rows as ctxmem's: GB/s of the median batch of ``nbytes`` (its CPU seconds
    per GB from ``cpu``, the peer's own process) and p50/p99 ms per batch."""
    out: list[Result] = []
    for name, ts in times.items():
        if not ts:
            continue
        limit = limit_for(name, limits)
        gbs = nbytes / statistics.median(ts) / GB
        cpu_per_gb = cpu[name] / (nbytes * len(ts) / GB)
        out.append(Result(name, gbs, "GB/s", limit, gbs / limit, None, cpu_per_gb))
        ideal_ms = nbytes / (limit * GB) * 1e3
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            ms = _pct(ts, q) * 1e3
            out.append(Result(f"{name}_{label}", ms, "ms/batch", ideal_ms, ideal_ms / ms))
    return out


def check_equal(bufs: list[np.ndarray], outs: list[np.ndarray], what: str) -> None:
    """:class:`PeerMismatch` naming the first block whose bytes differ."""
    for i, (a, b) in enumerate(zip(bufs, outs, strict=True)):
        if not np.array_equal(a, b):
            raise PeerMismatch(f"{what}: block {i} read back differs from what was stored")


@contextmanager
def lmcache_peer(disk_dir: Path, block: int, batch: int, tag: str) -> Iterator[LMCachePeer]:
    """An :class:`LMCachePeer`, closed (its threads stopped, its files removed) on exit."""
    peer = LMCachePeer(disk_dir, block, batch, tag)
    try:
        yield peer
    finally:
        peer.close()
        for f in disk_dir.glob("*.pt"):
            f.unlink(missing_ok=True)


def pair_rows(results: list[Result], sizes: list[str],
              pairs_of: Callable[[str], list[Pair]] | None = None,
              peer: str = "lmcache") -> list[dict[str, Any]]:
    """Each of ``peer``'s GB/s figures next to ctxmem's (``pairs_of``: the rows of one
    size, LMCache's :func:`pairs` by default): ``ratio`` > 1 when ctxmem is faster; CPU
    seconds per GB beside them (ctxmem: service + client; the peer: its process)."""
    by_name = {r.name: r for r in results}
    rows: list[dict[str, Any]] = []
    for size in sizes:
        for p in (pairs_of or pairs)(size):
            if p.ctxmem not in by_name or p.lmcache not in by_name:
                continue
            c, other = by_name[p.ctxmem], by_name[p.lmcache]
            c_cpu = None if c.service_cpu_s_per_gb is None else \
                c.service_cpu_s_per_gb + (c.client_cpu_s_per_gb or 0.0)
            rows.append({"row": p.row, "size": size, "ctxmem": p.ctxmem, peer: p.lmcache,
                         "ctxmem_value": c.value, f"{peer}_value": other.value,
                         "unit": "GB/s",
                         "ratio": c.value / other.value if other.value > 0 else float("inf"),
                         "ctxmem_cpu_s_per_gb": c_cpu,
                         f"{peer}_cpu_s_per_gb": other.client_cpu_s_per_gb, "note": p.note})
    return rows


def describe(version: str, disk_dir: Path, flash_device: dict[str, Any] | None) -> dict[str, Any]:
    """What ran on each side, for the printout and ``--json``."""
    where = str(disk_dir)
    if flash_device is not None:
        where += (f" (workdir file system: LMCache cannot use ctxmem's "
                  f"{flash_device.get('backend')} device)")
    return {"name": "lmcache", "version": version,
            "ctxmem_checks": "CRC32C on put and get, AES-256-XTS on flash",
            "lmcache_checks": "none (no CRC, no encryption)",
            "lmcache_backends": "StorageManager: LocalCPUBackend + LocalDiskBackend "
                                "(use_odirect)",
            "lmcache_disk": where, "lmcache_fsync": SYNC_NOTE,
            "copies": f"caller's numpy buffers <-> LMCache memory objects by torch copy_ "
                      f"({TORCH_THREADS} thread); ctxmem's client copies with numpy",
            "order": "one LMCache round beside each ctxmem round (after it in even rounds, "
                     "before it in odd ones), same buffers"}


def print_pairs(info: dict[str, Any], peer: str = "lmcache", label: str = "LMCache") -> None:
    """The row-by-row table: ``info`` from a peer's ``describe`` with ``pairs`` added
    (``peer``: the key prefix of its rows, ``label``: its name in the header)."""
    rows: list[dict[str, Any]] = info["pairs"]
    extra = f"; LMCache disk: {info['lmcache_disk']}" if "lmcache_disk" in info else ""
    print(f"\nctxmem ({info['ctxmem_checks']}) vs {label} {info['version']} "
          f"({info[f'{peer}_checks']}){extra}")
    width = max(12, len(label) + 5)
    print(f"{'row':20} {'size':6} {'ctxmem GB/s':>11} {label + ' GB/s':>{width}} {'ratio':>6} "
          f"{'ahead':8} {'CPU s/GB ctxmem':>15} {label:>8} note")

    def cell(v: float | None, width: int) -> str:
        return f"{'-':>{width}}" if v is None else f"{v:{width}.3f}"

    for r in rows:
        ahead = "ctxmem" if r["ratio"] >= 1 else label
        print(f"{r['row']:20} {r['size']:6} {r['ctxmem_value']:11.3f} "
              f"{r[f'{peer}_value']:{width}.3f} {r['ratio']:6.2f} {ahead:8} "
              f"{cell(r['ctxmem_cpu_s_per_gb'], 15)} {cell(r[f'{peer}_cpu_s_per_gb'], 8)} "
              f"{r['note']}")
