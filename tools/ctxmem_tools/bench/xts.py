"""``ctxmem bench xts``: the AES-256-XTS implementations side by side, per record.

For each record size (64 KiB and 2 MiB unless ``--sizes``) and thread count (1 and 2
unless ``--threads``), every implementation that loads here (``openssl``: the system's
libcrypto by ctypes, contexts kept; ``cryptography``) encrypts records from as many
threads at once through one cipher, each thread its own buffers and tweaks, as the
service's I/O threads do. Rounds alternate which implementation goes first, so both see
the same machine; printed are the medians over rounds of the wall time per record (all
threads' records over the wall time: the aggregate rate) and of this process's CPU time
per record (``time.process_time``: what sizes the cores), and the per-round ratio of each
implementation to the first. A paired A/B by construction: run it where the service
runs to see which implementation to force with ``CTXMEM_XTS_IMPL``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from ctxmem_common.codecs import XTS_IMPLEMENTATION, XtsCipher
from ctxmem_tools.bench.profile import parse_block

IMPLS = ("openssl", "cryptography")
MiB = 1 << 20



def one_round(cipher: XtsCipher, size: int, threads: int, records: int
              ) -> tuple[float, float]:
    """(wall µs per record, CPU µs per record) of ``records`` records of ``size`` bytes
    encrypted by ``threads`` threads through ``cipher``."""
    per = max(1, records // threads)
    rng = np.random.default_rng(size + threads)
    bufs = [(rng.integers(0, 256, size, dtype=np.uint8), np.empty(size, np.uint8))
            for _ in range(threads)]
    start = threading.Barrier(threads + 1, timeout=60)

    def work(i: int) -> None:
        src, dst = bufs[i][0].data, bufs[i][1].data
        start.wait()
        for k in range(per):
            cipher.encrypt_into(src, dst, (k * threads + i).to_bytes(16, "little"))

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    cpu0 = time.process_time()
    start.wait()
    t0 = time.perf_counter()
    for w in workers:
        w.join(timeout=600)
        if w.is_alive():
            raise RuntimeError(f"an XTS bench thread did not finish in 600 s ({size} B)")
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    n = per * threads
    return wall / n * 1e6, cpu / n * 1e6


def run(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ctxmem bench xts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64KiB,2MiB", help="record sizes (comma-separated)")
    p.add_argument("--threads", default="1,2", help="thread counts (comma-separated)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--mib", type=int, default=256, help="MiB encrypted per round and case")
    p.add_argument("--quick", action="store_true", help="few rounds, little data (smoke test)")
    p.add_argument("--json", help="write the results as JSON here")
    args = p.parse_args(argv)
    rounds, mib = (2, 4) if args.quick else (args.rounds, args.mib)
    sizes = [parse_block(s) for s in args.sizes.split(",")]
    counts = [int(t) for t in args.threads.split(",")]
    if any(s < 16 or s > 16 * MiB for s in sizes) or any(t < 1 for t in counts):
        p.error("sizes must be 16 B..16 MiB and thread counts at least 1")
    key = os.urandom(64)
    ciphers: dict[str, XtsCipher] = {}
    for impl in IMPLS:
        try:
            ciphers[impl] = XtsCipher(key, impl)
        except ImportError as exc:
            print(f"{impl}: not available here ({exc})")
    print(f"ctxmem bench xts: {rounds} rounds of {mib} MiB per case, active implementation "
          f"{XTS_IMPLEMENTATION}, {os.cpu_count()} CPUs")
    rows: list[dict[str, object]] = []
    names = list(ciphers)
    for size in sizes:
        for threads in counts:
            got: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
            records = max(threads, (mib * MiB) // size)
            for r in range(rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    got[name].append(one_round(ciphers[name], size, threads, records))
            for name in names:
                wall = statistics.median(w for w, _c in got[name])
                cpu = statistics.median(c for _w, c in got[name])
                ratio = statistics.median(
                    a[0] / b[0] for a, b in zip(got[names[0]], got[name], strict=True))
                rows.append({"impl": name, "size": size, "threads": threads,
                             "wall_us_per_record": wall, "cpu_us_per_record": cpu,
                             "gb_per_s": size / wall / 1e3,
                             f"speed_vs_{names[0]}": ratio})
                print(f"{size // 1024:6} KiB x{threads} threads {name:13} {wall:9.2f} µs/record "
                      f"({size / wall / 1e3:6.2f} GB/s) CPU {cpu:9.2f} µs/record, "
                      f"speed x{ratio:.2f} of {names[0]}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"results": rows, "active": XTS_IMPLEMENTATION, "cpus": os.cpu_count(),
             "params": {"rounds": rounds, "mib": mib, "sizes": sizes, "threads": counts}},
            indent=2))
    return 0
