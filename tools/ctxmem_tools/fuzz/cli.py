"""``ctxmem fuzz``: the command line of the fuzz campaign."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from ctxmem_tools.fuzz.runner import (
    DEFAULT_TARGETS,
    TARGET_WEIGHTS,
    FuzzOptions,
    FuzzRun,
    summary,
)


def fuzz_command(argv: list[str]) -> int:
    """Run a seeded fuzz campaign against a fresh local service; 0 when it passes."""
    p = argparse.ArgumentParser(
        prog="ctxmem fuzz",
        description="Fuzz every RPC and the raw data-plane framing (TCP, shared-memory "
                    "socket) of a fresh local ctxmem service; fail on a crash, a hang, a "
                    "wrong byte read back, a traceback in its log or RSS growth.")
    p.add_argument("--cases", type=int, default=3000, help="cases to run (3000)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument("--batch", type=int, default=100, help="cases between checks (100)")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--workdir", help="the service's files (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    p.add_argument("--max-seconds", type=float, default=3600.0,
                   help="stop after this long (3600)")
    p.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                   help="comma-separated targets: rpc, tcp, shm (the default), and peer: "
                        "a pod of two nodes (needs redis-server) and one node's peer port")
    p.add_argument("-q", "--quiet", action="store_true")
    args = p.parse_args(argv)
    targets = tuple(t for t in args.targets.split(",") if t)
    unknown = sorted(set(targets) - set(TARGET_WEIGHTS))
    if unknown or not targets:
        p.error(f"--targets: unknown {unknown or 'none given'}; choose from "
                f"{', '.join(TARGET_WEIGHTS)}")
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    if not args.quiet:
        print(f"ctxmem fuzz: {args.cases} cases, seed {seed}", flush=True)
    opts = FuzzOptions(cases=args.cases, seed=seed, batch=args.batch,
                       workdir=Path(args.workdir) if args.workdir else None, keep=args.keep,
                       max_seconds=args.max_seconds,
                       targets=targets)
    report = FuzzRun(opts, None if args.quiet else
                     (lambda msg: print(msg, flush=True))).run()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    print(summary(report))
    for failure in report["failures"][:10]:
        print(f"  {failure}")
    return 0 if report["ok"] else 1
