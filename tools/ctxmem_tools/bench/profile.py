"""``ctxmem bench profile``: where the service's CPU goes during one data-path phase.

The benches print the service's CPU seconds per GB beside every figure; this finds what
those seconds are spent on. It starts a real service, drives one phase in a loop from
this process (``put``: puts of new keys, each batch deleted afterwards; ``get``: DRAM
hits of one stored batch; ``flash``: put, evict to flash, cold get, delete), and samples
the service with py-spy (``pip install py-spy``; it attaches by pid, no change to the
service), native frames included. py-spy's own idle test lets threads blocked in C
through (a pool worker in ``futex``, the gRPC poller in ``poll``, a thread waiting for
the GIL), so stacks that end in a wait (:data:`WAITS`) are dropped: what is left
approximates the service's CPU. Printed: the service CPU s/GB of the loop (from Stats),
then the top functions by self samples (the leaf frame: the C function, or with
``--python-only`` the Python line that called it) and by inclusive samples.

``--raw FILE`` keeps py-spy's collapsed stacks (flamegraph.pl or speedscope read them).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from ctxmem_tools.bench.cpu import GB

MiB = 1 << 20
# Native frames a blocked thread sits in: a stack with one of them near its leaf is idle.
WAITS = ("poll ", "epoll_wait", "select ", "pthread_cond_wait", "pthread_cond_timedwait",
         "PyThread_acquire_lock_timed", "sem_wait", "sem_timedwait", "take_gil",
         "nanosleep", "clock_nanosleep", "accept", "recvmsg ", "recv ")


def parse_block(text: str) -> int:
    t = text.strip().lower()
    for suffix, mult in (("kib", 1024), ("mib", MiB), ("k", 1024), ("m", MiB)):
        if t.endswith(suffix):
            return int(t[: -len(suffix)]) * mult
    return int(t)


def top_frames(raw: str, top: int
               ) -> tuple[int, int, list[tuple[str, int]], list[tuple[str, int]]]:
    """(samples, on-CPU samples, top self frames, top inclusive ctxmem frames) of
    py-spy's collapsed stacks (``frame;frame;...;leaf count`` per line), waits left out."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = busy = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        if any(f.startswith(WAITS) for f in frames[-4:]):
            continue
        busy += n
        own[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    # Inclusive: the project's own functions (the generic loop and thread frames above
    # them are in every stack and say nothing).
    mine = Counter({f: n for f, n in incl.items() if "ctxmem" in f})
    return total, busy, own.most_common(top), mine.most_common(top)


def _parser() -> argparse.ArgumentParser:
    """The command's argument parser (also what tests/deploy/test_doc_shell_blocks.py
    checks the documented command lines with)."""
    p = argparse.ArgumentParser(prog="ctxmem bench profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=["put", "get", "flash"], default="put")
    p.add_argument("--block", default="64KiB", help="block size (64KiB, 2MiB, ...)")
    p.add_argument("--transport", choices=["shm", "tcp"], default="shm")
    p.add_argument("--encryption", action="store_true", help="AES-XTS on flash")
    p.add_argument("--batch-mib", type=int, default=32)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--python-only", action="store_true",
                   help="Python frames only (no py-spy --native; waits are not recognised)")
    p.add_argument("--raw", metavar="FILE", help="keep py-spy's collapsed stacks here")
    p.add_argument("--workdir", default=None)
    return p


def run(argv: list[str] | None = None) -> int:
    from ctxmem.client import Client
    from ctxmem_common.keys import chain_hashes
    from ctxmem_common.layout import KVLayout
    from ctxmem_tools.launcher import ServiceProcess, local_config

    p = _parser()
    args = p.parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        p.error("py-spy not found (pip install py-spy into this environment)")
    block, batch = parse_block(args.block), args.batch_mib * MiB
    count = batch // block
    if count < 1:
        p.error(f"--batch-mib {args.batch_mib} holds no {args.block} block")
    base = Path(args.workdir or tempfile.mkdtemp(prefix="ctxmem-bench-profile-",
                                                 dir="/var/tmp"))
    raw_path = Path(args.raw) if args.raw else base / "pyspy.txt"
    cfg = local_config(base / "svc", encryption=args.encryption,
                       dram_size=f"{4 * args.batch_mib + 64}MiB", dram_slab="32MiB",
                       flash_size=f"{max(1024, 6 * args.batch_mib)}MiB" if args.op == "flash"
                       else None, flash_slab="64MiB", transports=[args.transport])
    layout = KVLayout(dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=block // 2,
                      tokens_per_block=1)
    bufs = [np.random.default_rng(i).integers(0, 255, block, dtype=np.uint8)
            for i in range(count)]
    outs = [np.empty(block, dtype=np.uint8) for _ in range(count)]
    with ServiceProcess(base / "svc", cfg) as svc, \
            Client(svc.endpoint, transport=args.transport) as client:
        assert svc.proc is not None
        ns = client.open_namespace(layout, model_id="bench-profile")
        stored = chain_hashes(np.arange(count), 1, salt=b"profile-get")
        if args.op == "get":
            ns.put(stored, bufs)
            ns.get(stored, outs)
        cpu0, moved, rounds = client.stats()["process_cpu_seconds"], 0, 0
        spy_proc = subprocess.Popen(
            [spy, "record", "-p", str(svc.proc.pid), "-r", str(args.rate), "-f", "raw",
             "-o", str(raw_path), "-d", str(max(1, round(args.seconds)))]
            + ([] if args.python_only else ["--native"]),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            if args.op == "get":
                if ns.get(stored, outs) != count:
                    raise RuntimeError("a DRAM-hit get missed: is DRAM too small?")
                moved += batch
            else:
                keys = chain_hashes(np.arange(count) + rounds * count, 1, salt=b"profile")
                if ns.put(keys, bufs).stored != count:
                    raise RuntimeError(f"put stored fewer than {count} blocks")
                moved += batch
                if args.op == "flash":
                    ns.evict(keys)
                    if ns.get(keys, outs) != count:
                        raise RuntimeError("a cold get missed blocks just evicted")
                    moved += 2 * batch
                ns.delete(keys)
            rounds += 1
        cpu1 = client.stats()["process_cpu_seconds"]
        try:
            out, _ = spy_proc.communicate(timeout=args.seconds + 60)
        except subprocess.TimeoutExpired:
            spy_proc.kill()
            out, _ = spy_proc.communicate(timeout=10)
        if spy_proc.returncode != 0 or not raw_path.exists():
            print(f"ctxmem bench profile: py-spy failed (exit {spy_proc.returncode}): {out}",
                  file=sys.stderr)
            return 2
    total, busy, own, incl = top_frames(raw_path.read_text(), args.top)
    print(f"service CPU {cpu1 - cpu0:.2f} s for {moved / GB:.2f} GB moved "
          f"({(cpu1 - cpu0) / (moved / GB):.3f} s/GB), {rounds} rounds of {args.op} "
          f"{args.block} over {args.transport}; {total} samples, {busy} on CPU (the shares "
          "below are of these)")
    for title, rows in (("self (leaf frame)", own), ("ctxmem functions, inclusive", incl)):
        print(f"\ntop {title}:")
        for frame, n in rows:
            print(f"  {100 * n / max(1, busy):5.1f}%  {frame}")
    print(f"\nraw stacks: {raw_path}")
    return 0
