"""``ctxmem chaos``: the command line of the fault campaign.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
from pathlib import Path

from ctxmem_tools.chaos.campaign import run_campaign, select_kinds


def _parser() -> argparse.ArgumentParser:
    """The command's argument parser (also what tests/deploy/test_doc_shell_blocks.py
    checks the documented command lines with)."""
    p = argparse.ArgumentParser(
        prog="ctxmem chaos",
        epilog="ctxmem chaos pod --help: the pod campaign (three nodes, Redis, shared "
               "flash).",
        description="Inject faults (corruption, device errors, crashes) into a live ctxmem "
                    "service under a put/get workload; check no wrong block is ever served "
                    "and no durable block is lost.")
    p.add_argument("--faults", type=int, default=10_000, help="faults to inject (10000)")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument("--workdir", help="keep the service's files here (default: a temp dir)")
    p.add_argument("--device-fraction", type=float, default=0.05,
                   help="share of device faults (EIO, ENOSPC, slow, flaky, swap)")
    p.add_argument("--crash-fraction", type=float, default=0.02,
                   help="share of crashes (kill -9 at fault points, power cuts, ...)")
    p.add_argument("--scenario-fraction", type=float, default=0.002,
                   help="share of scenario faults (stalled client, full filesystem, both "
                        "superblocks, alias service), when selected")
    p.add_argument("--kinds", default="",
                   help="comma-separated fault kinds or groups (all, corruption, device, "
                        "crash, scenario; -KIND leaves one out); default: corruption, "
                        "device and crash kinds (the scenario kinds take seconds each)")
    p.add_argument("--write-policy", choices=("write_back", "write_through"),
                   default="write_back", help="the service's flash.write_policy")
    p.add_argument("--allocation-ttl", type=float, default=None,
                   help="the service's allocation_ttl_s (default 2 s with stalled_client "
                        "selected, else 30 s)")
    p.add_argument("--block-size", type=int, default=16384)
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    p.add_argument("--png", metavar="FILE",
                   help="draw the campaign over time (faults, blocks served, wrong = 0) and "
                        "the faults per kind into this PNG")
    p.add_argument("--from-json", metavar="FILE",
                   help="run nothing: draw --png from a report written by --json")
    p.add_argument("-q", "--quiet", action="store_true")
    return p


def chaos_command(argv: list[str]) -> int:
    if argv[:1] == ["pod"] or "--pod" in argv:  # the pod campaign (issue 26): .pod
        from ctxmem_tools.chaos.pod import pod_command

        return pod_command([a for a in argv[argv[:1] == ["pod"]:] if a != "--pod"])
    p = _parser()
    args = p.parse_args(argv)
    if args.from_json:
        if not args.png:
            p.error("--from-json draws a figure: give --png FILE")
        return _draw(Path(args.from_json), args.png)
    try:
        select_kinds(args.kinds or "corruption,device,crash")
    except ValueError as exc:
        p.error(str(exc))
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    if not args.quiet:
        print(f"ctxmem chaos: {args.faults} faults, seed {seed}", flush=True)
    # The shim warns on every get that a killed service answers with a miss: expected here.
    shim_log = logging.getLogger("ctxmem")
    level = shim_log.level
    shim_log.setLevel(logging.ERROR)
    try:
        report = run_campaign(args.faults, seed, Path(args.workdir) if args.workdir else None,
                              args.device_fraction, args.crash_fraction, args.block_size,
                              progress=not args.quiet, keep=args.keep, kinds=args.kinds,
                              scenario_frac=args.scenario_fraction,
                              write_policy=args.write_policy,
                              allocation_ttl_s=args.allocation_ttl)
    finally:
        shim_log.setLevel(level)
    summary = {k: report[k] for k in ("faults_injected", "blocks_committed", "blocks_served",
                                      "wrong_blocks", "blocks_lost", "lost_fraction",
                                      "durable_blocks_lost", "resurrected_blocks",
                                      "space_leak_bytes", "check_after_repair_clean",
                                      "restarts", "duration_s", "passed")}
    print(json.dumps(summary, indent=2))
    for kind, n in report["kind_failures"].items():
        print(f"{kind}: {'FAILED, ' + str(n) + ' failures' if n else 'passed'}",
              file=sys.stderr)
    for line in report["problems"]:
        print(f"problem: {line}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.png:
        from ctxmem_tools.plots import plot_chaos

        plot_chaos(report, args.png)
        print(f"wrote {args.png}")
    return 0 if report["passed"] else 1


def _draw(source: Path, png: str) -> int:
    from ctxmem_tools.plots import plot_chaos

    try:
        report = json.loads(source.read_text())
        plot_chaos(report, png)
    except (OSError, ValueError, KeyError) as exc:
        print(f"ctxmem chaos: cannot draw {source}: {exc!r} (is it a `ctxmem chaos --json` "
              "report?)", file=sys.stderr)
        return 2
    print(f"wrote {png}")
    return 0
