"""``ctxmem bench concurrency``: 1, 2, 4 and 8 client processes at once against one service.

A DPU serves several GPUs' engine workers at once (issue 17, item 1), so this runs N
client processes (``multiprocessing``, spawn) against one real service, over shm and
over TCP: DRAM-hit put and get of 2 MiB and 64 KiB blocks, each client moving its own
batch. Every round starts on a barrier, so the N batches really run together:

* aggregate GB/s of a round: N batches' bytes over the time from the first client's
  start to the last one's end; the figure is the median round;
* p99 (and p50) of one client's batch time over every client and round (N x rounds
  samples: with one client and 8 rounds the p99 is the slowest batch), and the ratio
  p99(N) / p99(1) beside N (target: it grows no faster than the client count);
* the limit, measured by the same N processes in the same run and with the same
  barrier: each copies one batch per round (numpy's one-thread copy, and a copy split
  over ``cpu_count // N`` threads, numpy releasing the GIL), rotating over buffers that
  together exceed the last-level cache (bench/copylimit.py: a batch copied into the same
  buffer every round ran partly from cache and the limit swung from run to run); the
  best of both, best of ``LIMIT_ROUND_FACTOR`` x rounds (target: aggregate >= 0.8 of it
  at every client count). The
  old cache-resident copy (``*_reused``: the client's own batch, same buffers each round)
  is measured beside it and printed for comparison, never used as the limit;
* each phase starts with one warm-up round, not counted (first page faults, slabs);
* CPU seconds per GB moved: the service's (its Stats, read by this process around each
  round while the clients wait on the barrier) and the clients' (each its own rusage).

``--json`` writes ``{"results": [...], "limits": {...}, "limit_sizing": {...},
"params": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import numpy as np

from ctxmem_tools.bench.copylimit import (
    LimitSizing,
    copier,
    last_level_cache_bytes,
    make_pairs,
    size_limit,
)
from ctxmem_tools.bench.cpu import GB, CpuMeter, own_cpu_seconds

MiB = 1 << 20
WAIT_S = 300.0  # any barrier wait or result read: a stuck client fails the run, not hangs it
TARGET_FRACTION = 0.8
# A copy round takes milliseconds, so copies run this many times the op rounds: their best
# round is one where every process had a core (on a shared machine a neighbour's burst
# serialises the processes of the others, and the limit would swing with the neighbours).
LIMIT_ROUND_FACTOR = 4
COPY_METHODS = ("numpy", "threads")  # the limit: buffers past the cache, rotated
REUSED_METHODS = ("numpy_reused", "threads_reused")  # the old, cache-resident copy: shown


@dataclass(frozen=True)
class Phase:
    """One step of the plan both sides walk in lockstep: a copy limit or a service op."""

    kind: str  # "copy" or "op"
    name: str  # copy method, or "put" / "get"
    block: int  # block bytes (0 for copies)

    def rounds(self, op_rounds: int) -> int:
        """Timed rounds of this phase (:data:`LIMIT_ROUND_FACTOR` for copies)."""
        return op_rounds * LIMIT_ROUND_FACTOR if self.kind == "copy" else op_rounds


def plan(blocks: list[int]) -> list[Phase]:
    phases = [Phase("copy", m, 0) for m in COPY_METHODS + REUSED_METHODS]
    for block in blocks:
        phases += [Phase("op", "put", block), Phase("op", "get", block)]
    return phases


def size_label(block: int) -> str:
    return f"{block // MiB}MiB" if block >= MiB else f"{block // 1024}KiB"


@dataclass
class Row:
    """One figure: ``op`` of ``block`` bytes by ``clients`` processes over ``transport``."""

    name: str
    transport: str
    clients: int
    op: str
    block: int
    value: float  # aggregate GB/s, median round
    unit: str
    limit: float  # aggregate copy GB/s of as many processes
    fraction_of_limit: float
    p50_ms: float
    p99_ms: float
    p99_ratio: float  # p99(N) / p99(1): target <= N
    service_cpu_s_per_gb: float | None
    client_cpu_s_per_gb: float | None
    meets_fraction: bool
    meets_p99: bool


# -- the client processes ---------------------------------------------------------------


def _keys(clients: int, idx: int, block: int, rnd: int, count: int) -> list[bytes]:
    """Keys of one client's batch, new for every client count, client, block and round
    (a put of keys already stored would store nothing)."""
    from ctxmem_common.keys import chain_hashes

    salt = f"cc-{clients}-{idx}-{block}-{rnd}".encode()
    return chain_hashes(np.arange(count), 1, salt=salt)


def _no_copy(_round: int) -> None:
    """The copy of a phase that is not a copy."""


def _nothing() -> None:
    """The close of a phase with nothing to close."""


def _client_main(idx: int, clients: int, endpoint: str, transport: str, batch: int,
                 blocks: list[int], rounds: int, sizing: LimitSizing, barrier: Barrier,
                 out: Any) -> None:
    """One client process: walks :func:`plan`, three barrier waits per round (prepare,
    start, end), and sends ``(phase index, round, t0, t1, cpu s)`` per round, then
    ``("done", idx)``. Any failure aborts the barrier so no one waits for it."""
    try:
        from ctxmem.client import Client
        from ctxmem_common.layout import KVLayout

        rng = np.random.default_rng(idx)
        src = rng.integers(0, 255, batch, dtype=np.uint8)
        dst = np.empty(batch, dtype=np.uint8)
        threads = max(1, (os.cpu_count() or 1) // clients)
        with Client(endpoint, transport=transport) as client:  # type: ignore[arg-type]
            pending: list[tuple[Any, list[bytes]]] = []  # keys to delete before next round
            for p_idx, phase in enumerate(plan(blocks)):
                copy: Callable[[int], None] = _no_copy
                close: Callable[[], None] = _nothing
                ns: Any = None
                bufs: list[np.ndarray] = []
                outs: list[np.ndarray] = []
                pairs: list[tuple[np.ndarray, np.ndarray]] = []  # freed phase by phase
                if phase.kind == "copy":
                    pairs = ([(src, dst)] if phase.name in REUSED_METHODS
                             else make_pairs(sizing, seed=idx))
                    copy, close = copier(phase.name, pairs, threads)
                else:
                    count = batch // phase.block
                    layout = KVLayout(dtype="uint8", num_layers=1, num_kv_heads=1,
                                      head_dim=phase.block // 2, tokens_per_block=1)
                    ns = client.open_namespace(layout, model_id=f"bench-cc-{phase.block}")
                    bufs = [src[i * phase.block:(i + 1) * phase.block] for i in range(count)]
                    outs = [dst[i * phase.block:(i + 1) * phase.block] for i in range(count)]
                # Round 0 warms up (page faults, first slabs).
                for r in range(phase.rounds(rounds) + 1):
                    for old_ns, old_keys in pending:  # untimed, before the round's barrier
                        old_ns.delete(old_keys)
                    pending = []
                    keys: list[bytes] = []
                    if phase.kind == "op":
                        keys = _keys(clients, idx, phase.block, r if phase.name == "put" else -1,
                                     len(bufs))
                        if phase.name == "get" and r == 0:
                            res = ns.put(keys, bufs)
                            if res.stored != len(keys):
                                raise RuntimeError(f"client {idx}: setup put stored "
                                                   f"{res.stored} of {len(keys)} blocks")
                    barrier.wait(WAIT_S)  # prepared
                    barrier.wait(WAIT_S)  # start (the parent has read the service's CPU)
                    c0 = own_cpu_seconds()
                    t0 = time.perf_counter()
                    if phase.kind == "copy":
                        copy(r)
                    elif phase.name == "put":
                        res = ns.put(keys, bufs)
                    else:
                        got = ns.get(keys, outs)
                    t1 = time.perf_counter()
                    c1 = own_cpu_seconds()
                    barrier.wait(WAIT_S)  # end
                    if phase.kind == "op" and phase.name == "put":
                        if res.stored != len(keys):
                            raise RuntimeError(f"client {idx}: put stored {res.stored} of "
                                               f"{len(keys)} blocks of {phase.block} B")
                        pending.append((ns, keys))
                    elif phase.kind == "op" and got != len(keys):
                        raise RuntimeError(f"client {idx}: get served {got} of {len(keys)} "
                                           f"blocks of {phase.block} B (DRAM too small?)")
                    out.put((p_idx, r, t0, t1, c1 - c0))
                if phase.kind == "op" and phase.name == "get":
                    if not np.array_equal(src, dst):
                        raise RuntimeError(f"client {idx}: get of {phase.block} B blocks "
                                           "returned other bytes than were put")
                    pending.append((ns, _keys(clients, idx, phase.block, -1, len(bufs))))
                close()
            for old_ns, old_keys in pending:
                old_ns.delete(old_keys)
        out.put(("done", idx))
    except BaseException as exc:
        out.put(("error", idx, f"{type(exc).__name__}: {exc}"))
        barrier.abort()
        raise


# -- the coordinating process -----------------------------------------------------------


@dataclass
class Samples:
    spans: dict[tuple[int, int], list[tuple[float, float]]]  # (phase, round) -> (t0, t1)
    client_cpu: dict[int, float]  # phase -> summed client CPU seconds


def _drain(out: Any, samples: Samples, errors: list[str], done: set[int]) -> None:
    while True:
        try:
            msg = out.get_nowait()
        except queue.Empty:
            return
        if msg[0] == "done":
            done.add(msg[1])
        elif msg[0] == "error":
            errors.append(f"client {msg[1]}: {msg[2]}")
        else:
            p_idx, r, t0, t1, cpu = msg
            if r == 0:  # the warm-up round
                continue
            samples.spans.setdefault((p_idx, r), []).append((t0, t1))
            samples.client_cpu[p_idx] = samples.client_cpu.get(p_idx, 0.0) + cpu


def run_clients(endpoint: str, transport: str, clients: int, batch: int, blocks: list[int],
                rounds: int, sizing: LimitSizing, service_cpu: Callable[[], float]
                ) -> tuple[Samples, dict[int, float]]:
    """Start ``clients`` processes, walk the plan with them, return their samples and
    the service CPU seconds per phase (the empty-phase baseline taken off)."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(clients + 1)
    out = ctx.Queue()
    procs = [ctx.Process(target=_client_main, name=f"bench-client-{i}", daemon=True,
                         args=(i, clients, endpoint, transport, batch, blocks, rounds,
                               sizing, barrier, out)) for i in range(clients)]
    meter = CpuMeter(service_cpu)
    meter.calibrate()
    samples = Samples({}, {})
    errors: list[str] = []
    done: set[int] = set()
    service_s: dict[int, float] = {}
    for p in procs:
        p.start()
    try:
        for p_idx, phase in enumerate(plan(blocks)):
            for r in range(phase.rounds(rounds) + 1):
                barrier.wait(WAIT_S)
                s0 = service_cpu()
                barrier.wait(WAIT_S)
                barrier.wait(WAIT_S)
                s1 = service_cpu()
                if r:  # round 0 is the warm-up
                    service_s[p_idx] = (service_s.get(p_idx, 0.0)
                                        + max(0.0, s1 - s0 - meter.baseline_s))
                _drain(out, samples, errors, done)
        deadline = time.monotonic() + WAIT_S
        while len(done) < clients and not errors and time.monotonic() < deadline:
            _drain(out, samples, errors, done)
            time.sleep(0.01)
    except threading.BrokenBarrierError:
        time.sleep(0.5)  # let the failing client's message arrive
        _drain(out, samples, errors, done)
        raise RuntimeError(f"bench concurrency: {clients} clients over {transport} failed: "
                           + ("; ".join(errors) or "a client died without a word (see "
                              "above)")) from None
    finally:
        for p in procs:
            p.join(timeout=WAIT_S if not errors else 5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    if errors or len(done) < clients:
        raise RuntimeError(f"bench concurrency: {clients} clients over {transport}: "
                           + ("; ".join(errors) or f"only {len(done)} finished"))
    return samples, service_s


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _aggregates(samples: Samples, p_idx: int, rounds: int, nbytes: int) -> list[float]:
    """GB/s of each round: every client's bytes over first start to last end."""
    out = []
    for r in range(1, rounds + 1):
        spans = samples.spans[(p_idx, r)]
        wall = max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans)
        out.append(len(spans) * nbytes / wall / GB)
    return out


def _latencies(samples: Samples, p_idx: int, rounds: int) -> list[float]:
    return [t1 - t0 for r in range(1, rounds + 1) for t0, t1 in samples.spans[(p_idx, r)]]


def measure(endpoint: str, transports: list[str], counts: list[int], batch: int,
            blocks: list[int], rounds: int, sizing: LimitSizing,
            service_cpu: Callable[[], float],
            on_step: Callable[[str], None] = lambda _: None
            ) -> tuple[list[Row], dict[int, dict[str, float]]]:
    """Every (transport, client count): rows, and the copy limits per client count
    (per method, ``best``: the best round of any :data:`COPY_METHODS` method over both
    transports, and ``best_reused``: the same over :data:`REUSED_METHODS`, for show), and
    ``<method>_cpu_s_per_gb``: the copy's CPU seconds per GB (summed over the processes
    and their threads; the lower of both transports). Wall-clock GB/s of N processes
    needs N free cores, which a shared machine does not always have; the CPU a copy costs
    per GB hardly moves with the neighbours, so a client's CPU per GB can be held against
    it.)"""
    phases = plan(blocks)
    limits: dict[int, dict[str, float]] = {}
    raw: list[tuple[str, int, Phase, list[float], list[float], float, float]] = []
    for transport in transports:
        for n in counts:
            on_step(f"{n} client(s) over {transport}")
            samples, service_s = run_clients(endpoint, transport, n, batch, blocks, rounds,
                                             sizing, service_cpu)
            lim = limits.setdefault(n, {})
            for p_idx, phase in enumerate(phases):
                agg = _aggregates(samples, p_idx, phase.rounds(rounds), batch)
                if phase.kind == "copy":
                    lim[phase.name] = max(lim.get(phase.name, 0.0), max(agg))
                    cpu = samples.client_cpu.get(p_idx, 0.0) / (
                        n * batch * phase.rounds(rounds) / GB)
                    key = f"{phase.name}_cpu_s_per_gb"
                    lim[key] = min(lim.get(key, cpu), cpu)
                    continue
                moved = n * batch * rounds / GB
                raw.append((transport, n, phase, agg, _latencies(samples, p_idx, rounds),
                            service_s.get(p_idx, 0.0) / moved,
                            samples.client_cpu.get(p_idx, 0.0) / moved))
    for lim in limits.values():
        lim["best"] = max(lim[m] for m in COPY_METHODS)
        lim["best_reused"] = max(lim[m] for m in REUSED_METHODS)
    p99_one = {(t, ph.name, ph.block): _pct(lat, 0.99) for t, n, ph, _, lat, _, _ in raw
               if n == 1}
    rows = []
    for transport, n, phase, agg, lat, svc, cli in raw:
        value = statistics.median(agg)
        limit = limits[n]["best"]
        p99 = _pct(lat, 0.99)
        one = p99_one.get((transport, phase.name, phase.block))
        ratio = p99 / one if one else float("nan")
        name = f"cc_{transport}_{phase.name}_{size_label(phase.block)}_x{n}"
        rows.append(Row(name, transport, n, phase.name, phase.block, value, "GB/s", limit,
                        value / limit, _pct(lat, 0.5) * 1e3, p99 * 1e3, ratio, svc, cli,
                        value / limit >= TARGET_FRACTION, not ratio > n))
    return rows, limits


def _print(rows: list[Row], limits: dict[int, dict[str, float]], sizing: LimitSizing
           ) -> None:
    print("\naggregate copy limit (GB/s), N processes at once, each its own buffers:")
    print(f"  {sizing.describe()}")
    for n, lim in sorted(limits.items()):
        parts = "  ".join(f"{m} {lim[m]:7.3f}" for m in (*COPY_METHODS, "best"))
        cpu = " ".join(f"{lim[f'{m}_cpu_s_per_gb']:.4f}" for m in COPY_METHODS)
        print(f"  N={n}: {parts}   CPU s/GB {cpu}   [{n * sizing.per_process_bytes / MiB:g} "
              f"MiB in all; old same-buffer copy, not the limit: {lim['best_reused']:7.3f}]")
    print(f"\n{'name':28} {'GB/s':>8} {'limit':>8} {'frac':>5} {'>=0.8':>5} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'p99/p99(1)':>10} {'<=N':>4} {'svc s/GB':>9} {'cli s/GB':>9}")
    for r in rows:
        print(f"{r.name:28} {r.value:8.3f} {r.limit:8.3f} {r.fraction_of_limit:5.2f} "
              f"{'yes' if r.meets_fraction else 'NO':>5} {r.p50_ms:8.2f} {r.p99_ms:8.2f} "
              f"{r.p99_ratio:10.2f} {'yes' if r.meets_p99 else 'NO':>4} "
              f"{r.service_cpu_s_per_gb or 0.0:9.4f} {r.client_cpu_s_per_gb or 0.0:9.4f}")


def _parser() -> argparse.ArgumentParser:
    """The command's argument parser (also what tests/deploy/test_doc_shell_blocks.py
    checks the documented command lines with)."""
    p = argparse.ArgumentParser(prog="ctxmem bench concurrency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write results as JSON here")
    p.add_argument("--transports", default="shm,tcp", help="comma-separated (shm, tcp)")
    p.add_argument("--clients", default="1,2,4,8", help="client counts, comma-separated")
    p.add_argument("--batch-mib", type=int, default=32, help="bytes per client batch, MiB")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--workdir", default=None, help="the service's files (default: a temp "
                   "dir under /var/tmp)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 1 and 2 clients, 8 MiB batches, 2 rounds")
    return p


def run(argv: list[str] | None = None) -> int:
    from ctxmem.client import Client
    from ctxmem_tools.launcher import ServiceProcess, local_config

    p = _parser()
    args = p.parse_args(argv)
    counts = [1, 2] if args.quick else [int(c) for c in args.clients.split(",")]
    batch_mib = 8 if args.quick else args.batch_mib
    rounds = 2 if args.quick else args.rounds
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if 1 not in counts:
        p.error("--clients must include 1: p99(N) is compared with p99(1)")
    bad = sorted(set(transports) - {"shm", "tcp"})
    if bad:
        p.error(f"--transports: {bad} not supported here (shm, tcp)")
    batch = batch_mib * MiB
    blocks = [2 * MiB, 64 * 1024]
    base = Path(args.workdir or tempfile.mkdtemp(prefix="ctxmem-bench-cc-", dir="/var/tmp"))
    print(f"ctxmem bench concurrency: transports {transports}, clients {counts}, "
          f"{batch_mib} MiB per client batch, {rounds} rounds, workdir {base}")
    # DRAM for the largest count's batches twice over (a put round's and the blocks left
    # from the other size), no flash: every get is a DRAM hit and nothing is demoted.
    dram = max(counts) * batch_mib * 2 + 64
    sizing = size_limit(batch, last_level_cache_bytes())
    print(f"copy limit: {sizing.describe()}")
    cfg = local_config(base / "svc", dram_size=f"{dram}MiB", dram_slab="32MiB",
                       flash_size=None, transports=transports)
    with ServiceProcess(base / "svc", cfg) as svc, Client(svc.endpoint) as ctl:
        rows, limits = measure(svc.endpoint, transports, counts, batch, blocks, rounds,
                               sizing, lambda: ctl.stats()["process_cpu_seconds"],
                               on_step=lambda s: print(f"  ... {s}", flush=True))
    _print(rows, limits, sizing)
    if args.json:
        doc = {"results": [asdict(r) for r in rows],
               "limits": {str(n): lim for n, lim in limits.items()},
               "limit_sizing": {**asdict(sizing),
                                "per_process_bytes": sizing.per_process_bytes,
                                "reuse_distance_bytes": sizing.reuse_distance_bytes},
               "targets": {"fraction_of_limit": TARGET_FRACTION, "p99_ratio": "<= clients"},
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                           "python": platform.python_version()},
               "params": {"transports": transports, "clients": counts, "batch_mib": batch_mib,
                          "rounds": rounds, "limit_rounds": rounds * LIMIT_ROUND_FACTOR,
                          "blocks": blocks}}
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")
    return 0
