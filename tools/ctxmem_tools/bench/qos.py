"""``ctxmem bench qos``: one tenant's gets while another floods the service.

Issue 29 item 2: a load is on a request's critical path, a store is not. This measures
what a quiet tenant ("victim") sees while another ("flood") puts and cold-gets as fast as
it can, against the same victim on the same service with nobody else on it:

* the victim's DRAM-hit get and cold get (evicted to flash first) of one batch, p50 and
  p99 over ``--rounds`` rounds, idle and then under the flood, and their ratio (the
  target: p99 under the flood within 1.5x of idle);
* the flood runs in a process of its own (``multiprocessing``, spawn): puts of new
  blocks, evict, cold get, delete, in a loop until told to stop; its GB/s and how many
  of its puts the service shed (``flash.shed_backlog_bytes``, set by ``--shed-mib``) are
  reported beside it;
* every get's bytes are compared with what was put.

The service is a real ``ctxmem serve`` (encryption on, a flash file under the workdir).
``--json`` writes ``{"results": [...], "params": {...}}``. On a 2-core machine the flood,
the service's I/O threads and the victim share two CPUs: read the figures with that.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ctxmem.client import Client
from ctxmem_common.keys import chain_hashes
from ctxmem_common.layout import KVLayout
from ctxmem_tools.launcher import ServiceProcess, local_config

MiB = 1 << 20
GB = 1e9
STOP_WAIT_S = 60.0


@dataclass
class Result:
    name: str
    value: float
    unit: str


def _layout(block: int) -> KVLayout:
    return KVLayout(dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=block // 2,
                    tokens_per_block=1)


def _blocks(n: int, block: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, block, dtype=np.uint8) for _ in range(n)]


def _flood(endpoint: str, block: int, batch: int, stop: Any, out: Any) -> None:
    """The flooding tenant's loop (a spawned process): until ``stop`` is set, put a new
    batch, evict it, cold-get it, delete it. Puts the service sheds are counted."""
    import ctxmem

    layout = _layout(block)
    data = _blocks(batch, block, 99)
    bufs = [np.empty(block, np.uint8) for _ in range(batch)]
    moved, shed, rounds = 0, 0, 0
    t0 = time.perf_counter()
    with Client(endpoint) as c:
        ns = c.open_namespace(layout, model_id="flood", tenant="flood")
        r = 0
        while not stop.is_set():
            keys = chain_hashes(np.arange(batch) + r * batch, 1, salt=b"flood")
            r += 1
            try:
                ns.put(keys, data)
            except ctxmem.Shed:
                shed += 1
                continue
            ns.evict(keys)
            ns.get(keys, bufs)
            ns.delete(keys)
            moved += 2 * batch * block
            rounds += 1
    out.put({"gbs": moved / (time.perf_counter() - t0) / GB, "shed": shed,
             "rounds": rounds})


def _victim_rounds(ns: Any, keys: list[bytes], data: list[np.ndarray], rounds: int
                   ) -> tuple[list[float], list[float]]:
    bufs = [np.empty_like(d) for d in data]
    hit, cold = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        n = ns.get(keys, bufs)
        hit.append(time.perf_counter() - t)
        if n != len(keys) or not all(np.array_equal(a, b)
                                     for a, b in zip(data, bufs, strict=True)):
            raise RuntimeError("the victim's DRAM-hit get returned wrong bytes or misses")
        ns.evict(keys)
        t = time.perf_counter()
        n = ns.get(keys, bufs)
        cold.append(time.perf_counter() - t)
        if n != len(keys) or not all(np.array_equal(a, b)
                                     for a, b in zip(data, bufs, strict=True)):
            raise RuntimeError("the victim's cold get returned wrong bytes or misses")
    return hit, cold


def _p(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def run(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ctxmem bench qos", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=40, help="victim rounds per phase")
    ap.add_argument("--victim-mib", type=int, default=4, help="the victim's batch, MiB")
    ap.add_argument("--flood-mib", type=int, default=32, help="the flood's batch, MiB")
    ap.add_argument("--block-kib", type=int, default=256)
    ap.add_argument("--shed-mib", type=int, default=64,
                    help="flash.shed_backlog_bytes of the service, MiB (0: never shed)")
    ap.add_argument("--workdir", default=None,
                    help="where the service's files go (O_DIRECT: not tmpfs; default a "
                         "new directory under /var/tmp)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if args.workdir is not None and not Path(args.workdir).is_dir():
        ap.error(f"--workdir {args.workdir}: not an existing directory")
    block = args.block_kib << 10
    base = Path(tempfile.mkdtemp(prefix="ctxmem-bench-qos-", dir=args.workdir or "/var/tmp"))
    cfg = local_config(base / "svc", encryption=True, dram_size="512MiB", dram_slab="32MiB",
                       flash_size="2GiB", flash_slab="64MiB",
                       flash={"shed_backlog_bytes": f"{args.shed_mib}MiB"})
    out: list[Result] = []
    with ServiceProcess(base / "svc", cfg) as svc:
        layout = _layout(block)
        n = max(1, (args.victim_mib * MiB) // block)
        keys = chain_hashes(np.arange(n), 1, salt=b"victim")
        data = _blocks(n, block, 1)
        with Client(svc.endpoint) as c:
            ns = c.open_namespace(layout, model_id="victim", tenant="victim")
            ns.put(keys, data)
            idle = _victim_rounds(ns, keys, data, args.rounds)
            ctx = mp.get_context("spawn")
            stop, q = ctx.Event(), ctx.Queue()
            flood = ctx.Process(target=_flood, args=(svc.endpoint, block,
                                                     max(1, (args.flood_mib * MiB) // block),
                                                     stop, q), daemon=True)
            flood.start()
            try:
                time.sleep(1.0)  # let the flood reach its pace before timing the victim
                busy = _victim_rounds(ns, keys, data, args.rounds)
            finally:
                stop.set()
            stats = q.get(timeout=STOP_WAIT_S)
            flood.join(STOP_WAIT_S)
            shed_total = c.stats()["puts_shed"]
    nbytes = n * block
    for label, (hit, cold) in (("idle", idle), ("flood", busy)):
        for what, ts in (("DRAM-hit get", hit), ("cold get", cold)):
            out.append(Result(f"victim {what}, {label}, p50", _p(ts, 0.5) * 1e3, "ms"))
            out.append(Result(f"victim {what}, {label}, p99", _p(ts, 0.99) * 1e3, "ms"))
            out.append(Result(f"victim {what}, {label}, GB/s (median)",
                              nbytes / statistics.median(ts) / GB, "GB/s"))
    for what, i in (("DRAM-hit get", 0), ("cold get", 1)):
        out.append(Result(f"victim {what} p99, flood / idle (target <= 1.5)",
                          _p(busy[i], 0.99) / _p(idle[i], 0.99), "x"))
    out.append(Result("flood throughput (put + cold get)", stats["gbs"], "GB/s"))
    out.append(Result("flood puts shed (its count)", stats["shed"], "calls"))
    out.append(Result("puts shed (the service's count)", shed_total, "calls"))
    width = max(len(r.name) for r in out)
    for r in out:
        print(f"{r.name:<{width}}  {r.value:10.3f} {r.unit}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"results": [asdict(r) for r in out], "params": vars(args)}, indent=1))
    return 0
