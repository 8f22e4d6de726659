"""``ctxmem bench``: put/get throughput and latency, each next to the machine's limit.

In one run, on the same buffers and the same flash file, it measures:

* the limits: memcpy (the same 2 MiB buffers; the better of numpy's one-thread copy and
  the copy split over every CPU, both also reported), O_DIRECT read and
  write of the flash file, CRC32C and AES-256-XTS throughput, and ``put_two_pass``: the
  two passes over memory a put verified by the service makes (the fused copy + CRC32C,
  then a CRC32C of what was copied, each on every CPU) with no call between, the
  ceiling of that design here; each put row is printed again against it
  (``dram_put_*_of_two_pass``);
* through a real service and the shim: DRAM-hit get and put, a staged put
  (``dram_put_staged_*``: blocks already in a service-owned staging region, one call,
  the service's fused copy + CRC32C; shared memory only, bench/staged.py), cold flash
  get (each batch evicted to flash first, so every byte is read from the device,
  decrypted and CRC-checked), demotion to flash, for 2 MiB and 64 KiB blocks,
  encryption on and off;
* a 10,000-key Lookup (p50/p99 of one call over 1,000 calls, target p99 < 2 ms, once the
  write-back demotion of the blocks it finds is done; ``lookup_10k_busy_*``: the calls made
  while it ran, reported) and a 100,000-key one (reported, no target);
* with ``--peer lmcache`` (or ``mooncake``, or both: ``lmcache,mooncake``; Mooncake Store in
  bench/peer_mooncake.py, ``mooncake_*`` rows, ``"peer_mooncake"`` in ``--json``),
  LMCache's own storage manager beside the encrypted service's
  rounds, on the same buffers (bench/peer_lmcache.py): ``lmcache_*`` rows, and a table
  (``"peer"`` in ``--json``) pairing each with ctxmem's;
* DRAM-hit get with CRC32C verification on (the default) and off (``verify_gets=False``),
  alternating on the same blocks, next to memcpy, CRC32C, copy-then-CRC (``copy_crc``:
  the one-thread cost of copying and checking every byte in two passes) and the fused
  copy + CRC32C the data path uses (``copy_crc_native``: one pass, the CRC32C
  implementation printed in the header, see ``ctxmem_common.codecs.crc``).

Each figure is printed next to its limit and, for throughputs, the CPU seconds per GB
moved that the service (from its own Stats) and the bench process spent in that phase;
``--json`` writes ``{"results": [{"name", "value", "unit", "limit", "fraction_of_limit",
"service_cpu_s_per_gb", "client_cpu_s_per_gb"}]}``. ``ctxmem bench concurrency`` runs
several clients at once (bench/concurrency.py); ``ctxmem bench stable`` counts
instructions per block (bench/stable.py).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ctxmem.client import Client
from ctxmem_common.codecs import (
    CRC32C_IMPLEMENTATION,
    XTS_IMPLEMENTATION,
    XtsCipher,
    copy_crc32c,
    crc32c,
)
from ctxmem_common.keys import chain_hashes
from ctxmem_common.layout import KVLayout
from ctxmem_common.progress import Progress, progress
from ctxmem_tools.bench import auth_ab
from ctxmem_tools.bench.cpu import CpuMeter
from ctxmem_tools.bench.device_probe import DeviceProbe, paired_fraction
from ctxmem_tools.bench.pinning import Pinning, add_pinning_args
from ctxmem_tools.bench.staged import bench_staged
from ctxmem_tools.launcher import ServiceProcess, local_config

MiB = 1 << 20
GB = 1e9
#: Threads of the device probe beside each flash round, and of the O_DIRECT limit's
#: second measure (the service's default ``service.io_threads`` is 2 as well).
PROBE_THREADS = 2
PeerRound = Callable[[int, list[np.ndarray], list[np.ndarray]], None]
#: ``--auth-ab``: the suffix of a row measured with block authenticators off.
AUTH_OFF_SUFFIX = "_authoff"
LOOKUP_10K_TARGET_MS = 2.0  # issue 17 item 5: p99 of a 10,000-key Lookup


@dataclass
class Result:
    name: str
    value: float
    unit: str
    limit: float
    fraction_of_limit: float
    # CPU seconds per GB moved in the phase (throughput rows): the service's own (from
    # Stats) and the bench process's (the client side). None where not measured.
    service_cpu_s_per_gb: float | None = None
    client_cpu_s_per_gb: float | None = None


def _best_rate(fn: Callable[[], object], nbytes: int, repeat: int) -> float:
    """Bytes per second of the best of ``repeat`` runs (limits: what the machine can do)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def measure_limits(scratch: Path, block: int, count: int, repeat: int,
                   offset: int = 0) -> dict[str, float]:
    """GB/s of the primitives the data path is built from, on ``count`` blocks.

    O_DIRECT is measured on ``scratch``: a file beside the flash file (created, then
    removed), or a block device (``offset`` onward, zeroed again afterwards)."""
    src = [np.random.default_rng(i).integers(0, 255, block, dtype=np.uint8) for i in range(count)]
    dst = [np.empty(block, dtype=np.uint8) for _ in range(count)]
    total = block * count

    def memcpy() -> None:
        for s, d in zip(src, dst, strict=True):
            np.copyto(d, s)

    # The same copy split over every CPU this process may use (numpy releases the GIL
    # while it copies): the limit is the best the machine offers, and one thread is not
    # always that (issue 17). Under --client-cpus: the best the client's own CPUs offer.
    threads = max(1, len(os.sched_getaffinity(0)))
    pool = ThreadPoolExecutor(threads, thread_name_prefix="bench-memcpy")
    shares = [list(zip(src[i::threads], dst[i::threads], strict=True)) for i in range(threads)]

    def copy_share(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for s, d in pairs:
            np.copyto(d, s)

    def memcpy_threads() -> None:
        for f in [pool.submit(copy_share, share) for share in shares]:
            f.result(timeout=60)

    def fused_share(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for s, d in pairs:
            copy_crc32c(s.data, d.data)

    def check_share(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for _s, d in pairs:
            crc32c(d.data)

    def put_two_pass() -> None:
        # What a put verified by the service does to memory, with no call between:
        # the client's copy fused with its CRC32C, then the service's CRC32C of what
        # landed, each split over every CPU. A put's ceiling under that design.
        for work in (fused_share, check_share):
            for f in [pool.submit(work, share) for share in shares]:
                f.result(timeout=60)

    def crc() -> None:
        for s in src:
            crc32c(s.data)

    def copy_crc() -> None:
        for s, d in zip(src, dst, strict=True):
            np.copyto(d, s)
            crc32c(d.data)

    def copy_crc_native() -> None:
        for s, d in zip(src, dst, strict=True):
            copy_crc32c(s.data, d.data)

    key = os.urandom(64)
    out = np.empty(block, dtype=np.uint8)

    def xts_with(impl: str | None) -> Callable[[], None]:
        cipher = XtsCipher(key, impl)

        def xts() -> None:
            for i, s in enumerate(src):
                cipher.encrypt_into(s.data, out.data, (i).to_bytes(16, "little"))
        return xts

    with pool:
        numpy_rate = _best_rate(memcpy, total, repeat) / GB
        threads_rate = _best_rate(memcpy_threads, total, repeat) / GB
        two_pass_rate = _best_rate(put_two_pass, total, repeat) / GB
    limits = {
        "memcpy": max(numpy_rate, threads_rate),
        "memcpy_numpy": numpy_rate,
        "memcpy_threads": threads_rate,
        "crc32c": _best_rate(crc, total, repeat) / GB,
        "copy_crc": _best_rate(copy_crc, total, repeat) / GB,
        "copy_crc_native": _best_rate(copy_crc_native, total, repeat) / GB,
        # Reported beside the put rows, not their target's basis (that stays memcpy).
        "put_two_pass": two_pass_rate,
        # The active AES-XTS implementation (XTS_IMPLEMENTATION), the one the service runs
        # when started from this environment, and each one that loads here (the default
        # is chosen by OpenSSL release, not measured: these say which is faster here).
        "aes_xts": _best_rate(xts_with(None), total, repeat) / GB,
    }
    for impl in ("openssl", "cryptography"):
        with contextlib.suppress(ImportError):  # no system libcrypto: that row is left out
            limits[f"aes_xts_{impl}"] = _best_rate(xts_with(impl), total, repeat) / GB
    # One thread and two (two I/Os in flight, as the service's I/O threads): the device's
    # limit is the better of the two (issue 17: the best the machine offers).
    with DeviceProbe(scratch, offset, block, count) as probe:
        for op, fn in (("write", probe.write), ("read", probe.read)):
            one = _best_rate(fn, total, repeat) / GB
            two = _best_rate(functools.partial(fn, PROBE_THREADS), total, repeat) / GB
            limits[f"odirect_{op}"] = max(one, two)
            limits[f"odirect_{op}_threads"] = two
    return limits


def limit_for(name: str, limits: dict[str, float]) -> float:
    """The machine limit (GB/s) a throughput figure is compared with: memcpy for DRAM,
    the device's O_DIRECT rate for flash, and with encryption also AES-XTS (the slower).
    A peer's row (``lmcache_...``, ``mooncake_...``) is held against the same limit as
    ctxmem's."""
    name = name.removeprefix("lmcache_").removeprefix("mooncake_")
    if name.startswith("dram_"):
        return limits["memcpy"]
    device = limits["odirect_read" if name.startswith("flash_get") else "odirect_write"]
    return min(device, limits["aes_xts"]) if "_xts" in name else device


def of_two_pass(results: list[Result], limits: dict[str, float]) -> list[Result]:
    """Each put row (``dram_put_<size>[_xts]``, GB/s) again as ``..._of_two_pass``: held
    against ``put_two_pass``, the two passes a put verified by the service makes (the
    client's fused copy and CRC32C, then the service's CRC32C) run in one process with
    no call between. Its target stays a fraction of memcpy; this row says how much of
    the gap is the design's second pass and how much the rest of the put (docs/
    benchmarks.md)."""
    limit = limits["put_two_pass"]
    return [Result(f"{r.name}_of_two_pass", r.value, "GB/s", limit, r.value / limit,
                   r.service_cpu_s_per_gb, r.client_cpu_s_per_gb)
            for r in results
            if r.unit == "GB/s" and r.name.startswith("dram_put_")
            and not r.name.endswith("_of_two_pass")]


def bench_verify(svc: ServiceProcess, transport: str, layout: KVLayout, size: str,
                 bufs: list[np.ndarray], outs: list[np.ndarray], rounds: int,
                 limits: dict[str, float], results: list[Result]) -> None:
    """DRAM-hit get of the same blocks with verification on and off, alternating round by
    round so both see the same machine load: ``dram_get_<size>_verify`` / ``_noverify``."""
    nbytes = sum(b.nbytes for b in bufs)
    keys = chain_hashes(np.arange(len(bufs)), 1, salt=f"verify-{size}".encode())
    times: dict[bool, list[float]] = {True: [], False: []}
    with Client(svc.endpoint, transport=transport,  # type: ignore[arg-type]
                verify_gets=True) as on, \
            Client(svc.endpoint, transport=transport,  # type: ignore[arg-type]
                   verify_gets=False) as off:
        meter = CpuMeter(lambda: on.stats()["process_cpu_seconds"])
        meter.calibrate()
        spaces = {v: c.open_namespace(layout, model_id=f"bench-verify-{size}")
                  for v, c in ((True, on), (False, off))}
        assert spaces[True].put(keys, bufs).stored == len(keys)
        for _ in range(rounds):
            for verify, ns in spaces.items():
                with meter.phase(str(verify), nbytes):
                    t = time.perf_counter()
                    assert ns.get(keys, outs) == len(keys)
                    times[verify].append(time.perf_counter() - t)
        spaces[True].delete(keys)
    for verify, label in ((True, "verify"), (False, "noverify")):
        gbs = nbytes / statistics.median(times[verify]) / GB
        name = f"dram_get_{size}_{label}"
        results.append(Result(name, gbs, "GB/s", limits["memcpy"], gbs / limits["memcpy"],
                               *meter.per_gb(str(verify))))


def _pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


@dataclass(frozen=True)
class RowNames:
    """The names of one block size's round rows (``crypt``: ``_xts`` or empty)."""

    put: str
    get: str
    demote: str
    cold: str
    crypt: str

    @classmethod
    def of(cls, size: str, tag: str) -> RowNames:
        crypt = "_xts" if tag == "xts" else ""
        return cls(f"dram_put_{size}{crypt}", f"dram_get_{size}{crypt}",
                   f"flash_demote_{size}{crypt}", f"flash_get_{size}{crypt}", crypt)

    def suffixed(self, suffix: str) -> RowNames:
        return RowNames(self.put + suffix, self.get + suffix, self.demote + suffix,
                        self.cold + suffix, self.crypt)


@dataclass
class RoundTimes:
    """Seconds per round of each row, and of the device probe beside the flash rows."""

    put: list[float] = field(default_factory=list)
    get: list[float] = field(default_factory=list)
    cold: list[float] = field(default_factory=list)
    demote: list[float] = field(default_factory=list)
    dev_w: list[float] = field(default_factory=list)  # the probe's write beside each evict
    dev_r: list[float] = field(default_factory=list)  # its read beside each cold get


def _batch(block: int, batch: int) -> tuple[KVLayout, str, list[np.ndarray], list[np.ndarray]]:
    """The layout of ``block``-byte blocks, its size label, a batch of random blocks and
    as many buffers to get them into."""
    layout = KVLayout(dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=block // 2,
                      tokens_per_block=1)
    assert layout.block_nbytes == block
    size = f"{block // MiB}MiB" if block >= MiB else f"{block // 1024}KiB"
    rng = np.random.default_rng(7)
    bufs = [rng.integers(0, 255, block, dtype=np.uint8) for _ in range(batch)]
    outs = [np.empty(block, dtype=np.uint8) for _ in range(batch)]
    return layout, size, bufs, outs


def one_round(ns: Any, meter: CpuMeter, names: RowNames, keys: list[bytes],
              bufs: list[np.ndarray], outs: list[np.ndarray], times: RoundTimes,
              flash: bool, probe: DeviceProbe | None = None,
              probe_first: bool = False) -> None:
    """One round of :func:`bench_service` on namespace ``ns``: put, evict, cold get,
    DRAM-hit get (each timed into ``times`` and metered under its row's name), the bytes
    checked, the blocks deleted. With ``probe``, the device is written beside the evict
    and read beside the cold get, before them if ``probe_first``, after them otherwise."""
    batch = len(keys)
    nbytes = sum(b.nbytes for b in bufs)
    # Order: put, evict, cold get, DRAM-hit get. The demotion row is timed from the
    # put's start to the evict's return (every block durable and dropped): the
    # write-back demoter starts on a put's blocks as soon as they are committed, so
    # an evict timed alone (after a get, as before session 10) found part of the
    # batch already on flash and read up to 2.5x the disk's O_DIRECT write limit
    # (issue 27). From put to durable no row can beat the disk.
    if probe is not None and probe_first:
        times.dev_w.append(probe.write(PROBE_THREADS))
    with meter.phase(names.put, nbytes):
        t0 = time.perf_counter()
        res = ns.put(keys, bufs)
        times.put.append(time.perf_counter() - t0)
    assert res.stored == batch, res
    if flash:
        with meter.phase(names.demote, nbytes):
            ns.evict(keys)
            times.demote.append(time.perf_counter() - t0)
        if probe is not None:
            if not probe_first:
                times.dev_w.append(probe.write(PROBE_THREADS))
            else:
                times.dev_r.append(probe.read(PROBE_THREADS))
        with meter.phase(names.cold, nbytes):
            t = time.perf_counter()
            n = ns.get(keys, outs)
            times.cold.append(time.perf_counter() - t)
        if probe is not None and not probe_first:
            times.dev_r.append(probe.read(PROBE_THREADS))
        assert n == batch, f"cold get served {n} of {batch}"
    # The cold get left the blocks in DRAM: this get is a DRAM hit (without flash,
    # right after the put as before).
    with meter.phase(names.get, nbytes):
        t = time.perf_counter()
        n = ns.get(keys, outs)
        times.get.append(time.perf_counter() - t)
    assert n == batch and all(np.array_equal(a, b) for a, b in zip(bufs, outs, strict=True))
    ns.delete(keys)


def round_rows(cases: list[tuple[str, list[float]]], nbytes: int, limits: dict[str, float],
               meter: CpuMeter) -> list[Result]:
    """Per ``(row name, seconds per round)``: the GB/s of the median round, with its limit
    and CPU per GB (``meter``'s phase of that name), then its p50 and p99 in ms per batch
    against the batch's time at the limit."""
    out = []
    for name, times in cases:
        limit = limit_for(name, limits)
        # Throughput from the median batch: robust to one slow batch on a busy 2-core box.
        gbs = nbytes / statistics.median(times) / GB
        out.append(Result(name, gbs, "GB/s", limit, gbs / limit, *meter.per_gb(name)))
        ideal_ms = nbytes / (limit * GB) * 1e3
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            ms = _pct(times, q) * 1e3
            out.append(Result(f"{name}_{label}", ms, "ms/batch", ideal_ms, ideal_ms / ms))
    return out


def bench_service_ab(svcs: dict[bool, ServiceProcess], transport: str, block: int,
                     batch: int, rounds: int, tag: str, limits: dict[str, float],
                     results: list[Result], bar: Progress | None = None,
                     flash: bool = True) -> None:
    """``--auth-ab``: :func:`bench_service`'s round (put, demotion, cold get, DRAM-hit
    get) on two services at once, ``svcs[True]`` with block authenticators on and
    ``svcs[False]`` with them off (bench/auth_ab.py), the arms alternated round by round
    (:func:`~ctxmem_tools.bench.auth_ab.arm_order`). The "on" rows under their usual
    names, the "off" ones with :data:`AUTH_OFF_SUFFIX`; each arm's service CPU from its
    own Stats. No device probe, Lookup, staged put or verify rows: only the rows whose
    paths the authenticators could touch."""
    layout, size, bufs, outs = _batch(block, batch)
    names = {on: RowNames.of(size, tag).suffixed("" if on else AUTH_OFF_SUFFIX)
             for on in (True, False)}
    times = {on: RoundTimes() for on in (True, False)}
    with ExitStack() as stack:
        clients = {on: stack.enter_context(Client(svcs[on].endpoint,
                                                  transport=transport))  # type: ignore[arg-type]
                   for on in (True, False)}
        spaces = {on: c.open_namespace(layout, model_id=f"bench-{size}-{tag}")
                  for on, c in clients.items()}
        meters = {on: CpuMeter(functools.partial(_service_cpu, c)) for on, c in clients.items()}
        for meter in meters.values():
            meter.calibrate()
        for r in range(rounds):
            # The same keys on both services: each arm has its own.
            keys = chain_hashes(np.arange(batch) + r * batch + block, 1, salt=tag.encode())
            for on in auth_ab.arm_order(r):
                one_round(spaces[on], meters[on], names[on], keys, bufs, outs, times[on],
                          flash)
            if bar is not None:
                bar.update()
    for on in (True, False):
        n, t = names[on], times[on]
        cases = [(n.put, t.put), (n.get, t.get)]
        if flash:
            cases += [(n.demote, t.demote), (n.cold, t.cold)]
        results.extend(round_rows(cases, block * batch, limits, meters[on]))


def _service_cpu(client: Client) -> float:
    return float(client.stats()["process_cpu_seconds"])


def bench_service(svc: ServiceProcess, transport: str, block: int, batch: int, rounds: int,
                  tag: str, limits: dict[str, float], results: list[Result],
                  with_lookup: bool, bar: Progress | None = None,
                  peer_round: PeerRound | None = None, flash: bool = True,
                  probe: DeviceProbe | None = None) -> None:
    """Put/evict/cold-get/get of ``batch`` blocks of ``block`` bytes, ``rounds`` times.
    ``flash_demote_*`` is timed from the put's start until the evict returns (put to
    durable: the write-back demoter overlaps the put, so an evict timed alone is not a
    demotion rate); its CPU per GB is the evict's, the write-back CPU that overlaps the
    put is counted under the put. With ``peer_round``, a peer's round on the same
    buffers beside each (``--peer``) and the ``put_durable`` row (the same put-to-durable
    time) it is compared with. Without
    ``flash`` (a DRAM-only service) only the put and get rows. With ``probe`` (a batch of
    the same size), the device is written beside each evict and read beside each cold
    get, before it in odd rounds and after it in even ones, and the ``*_paired`` rows
    hold each round against its own probe (:mod:`~ctxmem_tools.bench.device_probe`)."""
    layout, size, bufs, outs = _batch(block, batch)
    nbytes = block * batch
    names = RowNames.of(size, tag)
    put_n, get_n, demote_n, cold_n = names.put, names.get, names.demote, names.cold
    crypt = names.crypt
    with Client(svc.endpoint, transport=transport) as client:  # type: ignore[arg-type]
        ns = client.open_namespace(layout, model_id=f"bench-{size}-{tag}")
        # Service and client CPU per phase, read around (never inside) each timed call.
        meter = CpuMeter(lambda: client.stats()["process_cpu_seconds"])
        meter.calibrate()
        rt = RoundTimes()
        put_t, get_t, cold_t, demote_t = rt.put, rt.get, rt.cold, rt.demote
        dev_w, dev_r = rt.dev_w, rt.dev_r
        for r in range(rounds):
            # The peer goes first in odd rounds: whichever side runs right after the other
            # is slowed (a ctxmem put right after an LMCache round: ~25%, not GC, not its
            # threads), so neither side always pays it.
            if peer_round is not None and r % 2:
                peer_round(r, bufs, outs)
            keys = chain_hashes(np.arange(batch) + r * batch + block, 1, salt=tag.encode())
            one_round(ns, meter, names, keys, bufs, outs, rt, flash, probe,
                      probe_first=flash and probe is not None and r % 2 == 1)
            if peer_round is not None and not r % 2:
                peer_round(r, bufs, outs)
            if bar is not None:
                bar.update()
        if tag == "plain":
            bench_verify(svc, transport, layout, size, bufs, outs, rounds, limits, results)
        cases = [(put_n, put_t), (get_n, get_t)]
        if flash:
            cases += [(demote_n, demote_t), (cold_n, cold_t)]
        if peer_round is not None:  # what the peer's durable put is held against
            durable_n = f"put_durable_{size}{crypt}"
            # The demotion row is already timed from the put's start to durable.
            cases.append((durable_n, list(demote_t)))
            for phase, moved in ((put_n, nbytes * rounds), (demote_n, 0)):
                cpu = meter.phases[phase]
                meter.add(durable_n, cpu.service_s, cpu.client_s, moved)
        results.extend(round_rows(cases, nbytes, limits, meter))
        if flash and probe is not None:
            for name, times, dev in ((demote_n, demote_t, dev_w), (cold_n, cold_t, dev_r)):
                # With AES-XTS the cipher may be the slower limit (as limit_for): its time
                # for the batch is a floor under each round's device time.
                cap = nbytes / (limits["aes_xts"] * GB) if crypt else 0.0
                results.append(Result(
                    f"{name}_paired", nbytes / statistics.median(times) / GB, "GB/s",
                    nbytes / max(statistics.median(dev), cap) / GB,
                    paired_fraction(times, dev, cap), *meter.per_gb(name)))
        # The staged put beside the put (shared memory): bench/staged.py.
        bench_staged(client, ns, bufs, rounds, size, crypt, tag.encode(),
                     limit_for(put_n, limits), meter, results)
        if with_lookup:
            lk = chain_hashes(np.arange(10_000), 1, salt=b"lookup")
            stored = lk[:5000]
            small = KVLayout(dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=2048,
                             tokens_per_block=1)
            lns = client.open_namespace(small, model_id="bench-lookup")
            for i in range(0, len(stored), 1000):
                lns.put(stored[i:i + 1000], [np.zeros(4096, np.uint8)] * 1000)
            # The service demotes the 5,000 blocks just put in the background (write-back)
            # for a few hundred ms: Lookups timed meanwhile share two cores with that
            # demotion and are reported apart (lookup_10k_busy_*, no target); the target's
            # figure is taken once nothing is left to demote.
            busy = []
            settle_by = time.monotonic() + 30
            while client.stats()["dirty_blocks"] > 0 and time.monotonic() < settle_by:
                for _ in range(10):
                    t = time.perf_counter()
                    lns.lookup(lk)
                    busy.append(time.perf_counter() - t)
            for q, label in ((0.5, "p50"), (0.99, "p99")):
                ms = _pct(busy, q) * 1e3 if busy else float("nan")
                results.append(Result(f"lookup_10k_busy_{label}", ms, "ms", float("nan"),
                                      float("nan")))
            # Enough calls that p99 is a percentile, not the slowest call: with 50 (the
            # count before session 9) it was the maximum, and swung 1.2-5 ms between runs
            # where 3,500 back-to-back calls gave 1.2-1.5 ms.
            times = []
            for _ in range(max(200, rounds * 125)):
                t = time.perf_counter()
                hit = lns.lookup(lk)
                times.append(time.perf_counter() - t)
                assert hit.num_hits == 5000
            for q, label in ((0.5, "p50"), (0.99, "p99")):
                ms = _pct(times, q) * 1e3
                target = LOOKUP_10K_TARGET_MS
                results.append(Result(f"lookup_10k_{label}", ms, "ms", target, target / ms))
            # 100,000 keys (the first 10,000 the same chain): reported, no target (NaN).
            lk100 = chain_hashes(np.arange(100_000), 1, salt=b"lookup")
            times = []
            for _ in range(max(100, rounds * 25)):
                t = time.perf_counter()
                hit = lns.lookup(lk100)
                times.append(time.perf_counter() - t)
                assert hit.num_hits == 5000
            for q, label in ((0.5, "p50"), (0.99, "p99")):
                ms = _pct(times, q) * 1e3
                results.append(Result(f"lookup_100k_{label}", ms, "ms", float("nan"),
                                      float("nan")))


def _parser() -> argparse.ArgumentParser:
    """The command's argument parser (also what tests/deploy/test_doc_shell_blocks.py
    checks the documented command lines with)."""
    p = argparse.ArgumentParser(prog="ctxmem bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write results as JSON here")
    p.add_argument("--transport", default="shm", choices=["shm", "tcp", "rdma"])
    p.add_argument("--workdir", default=None,
                   help="where the flash file goes (default: a temp dir under /var/tmp; must "
                        "support O_DIRECT)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--batch-mib", type=int, default=64, help="bytes per batch, MiB")
    p.add_argument("--quick", action="store_true", help="few rounds (smoke test)")
    p.add_argument("--png", metavar="FILE",
                   help="draw every figure as a fraction of its limit (one bar chart)")
    p.add_argument("--from-json", metavar="FILE",
                   help="run nothing: draw --png from results written by --json")
    p.add_argument("--flash-device", default=None, metavar="FILE",
                   help="a JSON file with one flash.devices entry (e.g. backend spdk: the "
                        "flash tier on SPDK) for the service instead of a flash file")
    p.add_argument("--odirect-path", default=None, metavar="PATH",
                   help="measure the O_DIRECT limit here: a block device (its last batch "
                        "of bytes, zeroed again afterwards; e.g. the same remote namespace "
                        "through the kernel initiator) instead of a scratch file in workdir; "
                        "the *_paired rows are then left out (no probe while the service "
                        "runs)")
    p.add_argument("--peer", choices=PEER_CHOICES, default=None,
                   help="also run a peer on the same buffers, a round beside each ctxmem "
                        "round of the encrypted service, and print both row by row: "
                        "lmcache (LMCache's own storage manager: its CPU and O_DIRECT local "
                        "disk backends), mooncake (Mooncake Store's CPU build: its master and "
                        "one client, DRAM put and get), or both")
    p.add_argument("--dram-only", action="store_true",
                   help="a service with no flash tier, unencrypted: only the DRAM put and "
                        "get rows, with no write-back demotion competing for the CPUs")
    p.add_argument("--auth-ab", action="store_true",
                   help="block authenticators on and off: two services of each kind, one "
                        "with them off (a benchmark harness, bench/auth_ab.py), the rounds "
                        "alternated on/off, off/on; only the put, demotion, cold get and "
                        "DRAM-hit get rows, each printed with both figures, on/off and the "
                        "service CPU per GB of each")
    add_pinning_args(p)
    return p


def run(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    pinning = Pinning.from_args(p, args)
    if args.dram_only and (args.peer or args.flash_device):
        p.error("--dram-only has no flash tier: it takes neither --peer nor --flash-device")
    if args.auth_ab and (args.peer or args.flash_device):
        p.error("--auth-ab runs two services at once, each with a flash file of its own: it "
                "takes neither --peer nor --flash-device")
    peer_info: dict[str, object] | None = None
    mooncake_info: dict[str, object] | None = None
    use_lmcache = args.peer in ("lmcache", "lmcache,mooncake")
    use_mooncake = args.peer in ("mooncake", "lmcache,mooncake")
    if args.peer:
        from ctxmem_tools.bench import peer_lmcache, peer_mooncake

        try:
            if use_lmcache:
                peer_version = peer_lmcache.lmcache_version()
            if use_mooncake:
                mooncake_info = peer_mooncake.describe(peer_mooncake.mooncake_version())
                peer_mooncake.master_binary()
        except peer_lmcache.PeerUnavailable as exc:
            p.error(str(exc))
    if args.from_json:
        if not args.png:
            p.error("--from-json draws a figure: give --png FILE")
        return _draw(Path(args.from_json), args.png)
    rounds = 3 if args.quick else args.rounds
    pinning.pin_client()  # before the limits: they are measured where the client runs
    base = Path(args.workdir or tempfile.mkdtemp(prefix="ctxmem-bench-", dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    batch_bytes = args.batch_mib * MiB
    print(f"ctxmem bench: transport={args.transport}, {args.batch_mib} MiB per batch, "
          f"{rounds} rounds, workdir {base}, CRC32C {CRC32C_IMPLEMENTATION}, "
          f"AES-XTS {XTS_IMPLEMENTATION}")
    print(pinning.describe())
    device_entry = json.loads(Path(args.flash_device).read_text()) if args.flash_device else None
    if device_entry is not None:
        print(f"flash tier: {device_entry.get('backend')} device {device_entry.get('name')}")
    if use_lmcache:
        peer_info = peer_lmcache.describe(peer_version, base / "lmcache-disk", device_entry)
        print(f"peer: LMCache {peer_version} ({peer_info['lmcache_backends']}), "
              f"disk {peer_info['lmcache_disk']}")
    if mooncake_info is not None:
        print(f"peer: Mooncake Store {mooncake_info['version']} "
              f"({mooncake_info['mooncake_setup']})")
    scratch, offset = base / "odirect-limit.bin", 0
    if args.odirect_path:
        scratch = Path(args.odirect_path)
        if not scratch.is_block_device():
            p.error(f"--odirect-path {scratch} is not a block device")
        with open(scratch, "rb") as dev:
            offset = (dev.seek(0, os.SEEK_END) - batch_bytes) // MiB * MiB
        if offset < 0:
            p.error(f"--odirect-path {scratch} is smaller than one batch ({batch_bytes} B)")
    count = batch_bytes // (2 * MiB)
    limits = measure_limits(scratch, 2 * MiB, count, repeat=5, offset=offset)
    # On a terminal: a bar with an ETA (the limits twice, then every round of each case).
    bar = progress(2 + (2 if args.dram_only else 4) * rounds, "ctxmem bench", "steps")
    bar.update()
    for name, value in limits.items():
        results.append(Result(f"limit_{name}", value, "GB/s", value, 1.0))
    flash_size = f"{max(1024, 6 * args.batch_mib)}MiB"
    flash = not args.dram_only
    services = (("plain", False),) if args.dram_only else (("xts", True), ("plain", False))
    # The device written and read beside every flash round (the *_paired rows), on the
    # limit's scratch file; given back before the limits are measured again. Not on an
    # --odirect-path device: the service may be using that device meanwhile (its flash
    # tier on the same namespace), and its last batch is only borrowed while no service
    # runs.
    probe = DeviceProbe(scratch, offset, 2 * MiB, count) \
        if flash and not args.odirect_path and not args.auth_ab else None
    auth_off_counts: dict[str, tuple[int, int] | None] = {}
    try:
        for tag, enc in services:
            def config_for(workdir: Path, enc: bool = enc) -> dict[str, Any]:
                cfg = local_config(workdir, encryption=enc,
                                   dram_size=f"{4 * args.batch_mib}MiB", dram_slab="32MiB",
                                   flash_size=flash_size if flash else None,
                                   flash_slab="64MiB", transports=[args.transport],
                                   service={"rdma_listen": os.environ.get(
                                       "CTXMEM_RDMA_LISTEN", "0.0.0.0"),  # rdma: any RoCE v2
                                       **pinning.service_section()})
                if device_entry is not None:
                    cfg["flash"]["devices"] = [device_entry]
                    cfg["flash"]["o_direct"] = True
                return cfg

            if args.auth_ab:
                auth_off_counts[tag] = _run_auth_ab(
                    base / tag, config_for, pinning, args.transport, batch_bytes, rounds, tag,
                    limits, results, bar, flash)
                continue
            cfg = config_for(base / tag)
            with pinning.spawning_service():
                svc = ServiceProcess(base / tag, cfg)
            with svc:
                for block in (2 * MiB, 64 * 1024):
                    with ExitStack() as stack:
                        peers: list[Any] = []
                        if use_lmcache and tag == "xts":
                            peers.append(stack.enter_context(peer_lmcache.lmcache_peer(
                                base / "lmcache-disk", block, batch_bytes // block, tag)))
                        if use_mooncake and tag == "xts":
                            peers.append(stack.enter_context(peer_mooncake.mooncake_peer(
                                base / "mooncake", block, batch_bytes // block, tag)))
                        bench_service(svc, args.transport, block, batch_bytes // block, rounds,
                                      tag, limits, results,
                                      with_lookup=(block == 2 * MiB
                                                   and (tag == "xts" or not flash)),
                                      bar=bar, flash=flash,
                                      peer_round=_peer_rounds(peers) if peers else None,
                                      probe=probe)
                        for peer in peers:
                            results.extend(peer.results(limits))
            (base / tag / "flash0.img").unlink(missing_ok=True)
    finally:
        if probe is not None:
            probe.close()
    # The flash file sits on a virtual disk whose speed drifts a lot from second to second
    # (host-side caching): measure the limits again after the runs and compare every
    # figure with the best the machine showed in this run, never with a lucky-low limit.
    again = measure_limits(scratch, 2 * MiB, count, repeat=5, offset=offset)
    bar.update()
    bar.close()
    for name, value in again.items():
        results.append(Result(f"limit_{name}_after", value, "GB/s", value, 1.0))
        limits[name] = max(limits[name], value)
    for r in results:
        if r.unit == "GB/s" and not r.name.startswith("limit_") \
                and not r.name.endswith("_paired"):  # those carry their rounds' own limit
            r.limit = limit_for(r.name, limits)
            r.fraction_of_limit = r.value / r.limit
        elif r.unit == "ms/batch":
            ideal_ms = batch_bytes / (limit_for(r.name.rsplit("_", 1)[0], limits) * GB) * 1e3
            r.limit = ideal_ms
            r.fraction_of_limit = ideal_ms / r.value
    results.extend(of_two_pass(results, limits))
    w = max([34] + [len(r.name) for r in results])  # --auth-ab's names are longer
    print(f"\n{'name':{w}} {'value':>10} {'unit':9} {'limit':>10} {'fraction':>9} "
          f"{'svc cpu s/GB':>12} {'cli cpu s/GB':>12}")
    for r in results:
        cpu = "" if r.service_cpu_s_per_gb is None and r.client_cpu_s_per_gb is None else \
            f" {_cpu_cell(r.service_cpu_s_per_gb)} {_cpu_cell(r.client_cpu_s_per_gb)}"
        print(f"{r.name:{w}} {r.value:10.3f} {r.unit:9} {r.limit:10.3f} "
              f"{r.fraction_of_limit:9.2f}{cpu}")
    ab_rows: list[auth_ab.AbRow] = []
    if args.auth_ab:
        ab_rows = auth_ab.pair_rows(results, AUTH_OFF_SUFFIX)
        auth_ab.print_rows(ab_rows, rounds)
        for tag, counts in auth_off_counts.items():
            said = "no count logged at exit" if counts is None else \
                f"{counts[0]} tags and {counts[1]} checks not computed"
            print(f"  'off' service ({tag}): {said}")
    if peer_info is not None:
        peer_info["pairs"] = peer_lmcache.pair_rows(results, ["2MiB", "64KiB"])
        peer_lmcache.print_pairs(peer_info)
    if mooncake_info is not None:
        mooncake_info["pairs"] = peer_mooncake.pair_rows(results, ["2MiB", "64KiB"])
        peer_mooncake.print_pairs(mooncake_info)
    if args.json:
        doc = {
            "results": [asdict(r) for r in results],
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(),
                        "crc32c": CRC32C_IMPLEMENTATION, "aes_xts": XTS_IMPLEMENTATION},
            "params": {"transport": args.transport, "batch_mib": args.batch_mib,
                       "rounds": rounds, "flash_device": device_entry,
                       "odirect_path": str(scratch), "peer": args.peer,
                       "dram_only": args.dram_only, "auth_ab": args.auth_ab,
                       **pinning.as_json()},
        }
        if args.auth_ab:
            doc["auth_ab"] = [asdict(r) for r in ab_rows]
            doc["auth_off_counts"] = {tag: None if c is None else
                                      {"tags": c[0], "verifies": c[1]}
                                      for tag, c in auth_off_counts.items()}
        if peer_info is not None:
            doc["peer"] = peer_info
        if mooncake_info is not None:
            doc["peer_mooncake"] = mooncake_info
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")
    if args.png:
        from ctxmem_tools.plots import plot_bench

        plot_bench({"results": [asdict(r) for r in results],
                    "params": {"transport": args.transport, "batch_mib": args.batch_mib,
                               "rounds": rounds}}, args.png)
        print(f"wrote {args.png}")
    return 0


PEER_CHOICES = ["lmcache", "mooncake", "lmcache,mooncake"]


def _run_auth_ab(workdir: Path, config_for: Callable[[Path], dict[str, Any]],
                 pinning: Pinning, transport: str, batch_bytes: int, rounds: int, tag: str,
                 limits: dict[str, float], results: list[Result], bar: Progress,
                 flash: bool) -> tuple[int, int] | None:
    """``--auth-ab`` for one kind of service (``tag``): an "on" and an "off" service
    (bench/auth_ab.py) side by side, each one's log checked for its arm at start and at
    the end, :func:`bench_service_ab` for each block size. Returns what the "off"
    service logged at exit: (tags, checks) the harness skipped, or None."""
    logs: dict[bool, Path] = {}
    with ExitStack() as stack:
        svcs: dict[bool, ServiceProcess] = {}
        for on in (True, False):
            d = workdir / auth_ab.ARMS[on]
            with pinning.spawning_service():
                svcs[on] = stack.enter_context(ServiceProcess(d, config_for(d),
                                                              env=auth_ab.arm_env(on)))
            logs[on] = svcs[on].log_path
            auth_ab.check_arm(logs[on], on, f"the {auth_ab.ARMS[on]} service ({tag})")
        for block in (2 * MiB, 64 * 1024):
            bench_service_ab(svcs, transport, block, batch_bytes // block, rounds, tag, limits,
                             results, bar=bar, flash=flash)
        for on in (True, False):
            auth_ab.check_arm(logs[on], on, f"the {auth_ab.ARMS[on]} service ({tag})")
    for on in (True, False):
        (workdir / auth_ab.ARMS[on] / "flash0.img").unlink(missing_ok=True)
    return auth_ab.exit_counts(logs[False])


def _peer_rounds(peers: list[Any]) -> PeerRound:
    """One ``peer_round`` hook running every peer's round, in the order given."""
    def both(r: int, bufs: list[np.ndarray], outs: list[np.ndarray]) -> None:
        for peer in peers:
            peer.round(r, bufs, outs)
    return both


def _cpu_cell(v: float | None) -> str:
    """A CPU s/GB column: ``-`` where not measured (a peer in this process has no service)."""
    return f"{'-':>12}" if v is None else f"{v:12.4f}"


def _draw(source: Path, png: str) -> int:
    from ctxmem_tools.plots import plot_bench

    try:
        plot_bench(json.loads(source.read_text()), png)
    except (OSError, ValueError, KeyError) as exc:
        print(f"ctxmem bench: cannot draw {source}: {exc!r} (is it a `ctxmem bench --json` "
              "file?)", file=sys.stderr)
        return 2
    print(f"wrote {png}")
    return 0
