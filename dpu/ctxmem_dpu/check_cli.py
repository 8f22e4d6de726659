"""The command line of ``ctxmem check`` (the checker itself: :mod:`ctxmem_dpu.check`).

On a terminal, each device shows a bar, slab by slab, with an ETA (quiet with ``-q``, in
CI and when output is not a terminal: :mod:`ctxmem_common.progress`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ctxmem_common.config import load_config
from ctxmem_common.errors import CtxmemError
from ctxmem_dpu.check import WARNINGS, check_devices, read_master_key
from ctxmem_dpu.check_superblock import format_command


def check_command(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="ctxmem check",
        description="Check (and repair) ctxmem flash devices, like fsck. Exit status: 0 "
                    "clean, 1 problems found and repaired, 4 problems left, 8 cannot check.")
    p.add_argument("--config", help="the service's YAML config (devices, master key)")
    p.add_argument("--device", action="append", default=[], metavar="[NAME=]PATH",
                   help="check this device instead of the config's (repeatable)")
    p.add_argument("--repair", action="store_true",
                   help="invalidate bad and shadowed records, restore a damaged superblock "
                        "copy (the service must be stopped)")
    p.add_argument("--format", action="store_true",
                   help="format the --device(s) as new, empty devices: DISCARDS every record "
                        "on them (the service formats only blank devices by itself)")
    p.add_argument("--slab-size", metavar="SIZE",
                   help="slab size for --format (default: flash.slab_size of --config)")
    p.add_argument("--headers-only", action="store_true",
                   help="skip reading and verifying payloads (fast)")
    p.add_argument("--json", help="write the report as JSON here")
    p.add_argument("-q", "--quiet", action="store_true", help="print the summary line only")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config) if args.config else None
    except CtxmemError as exc:
        print(f"ctxmem check: invalid config: {exc}", file=sys.stderr)
        return 8
    devices: list[tuple[str, str]] = []
    for i, spec in enumerate(args.device):
        name, sep, path = spec.partition("=")
        devices.append((name, path) if sep else (f"device{i}", spec))
    if args.format:
        return format_command(args.device and devices, args.slab_size, cfg)
    if not devices and cfg is not None:
        for d in cfg.flash.devices:
            if d.backend != "local" or not d.path:
                print(f"ctxmem check: device {d.name!r} uses backend {d.backend!r}; attach it "
                      f"and pass its path with --device {d.name}=PATH", file=sys.stderr)
                return 8
            devices.append((d.name, d.path))
    if not devices:
        print("ctxmem check: no devices: pass --config or --device", file=sys.stderr)
        return 8
    master = read_master_key(cfg) if cfg is not None else None
    if master is None and os.environ.get("CTXMEM_MASTER_KEY"):
        try:
            master = bytes.fromhex(os.environ["CTXMEM_MASTER_KEY"].strip())
        except ValueError:
            master = None
    lines: list[str] = []
    try:
        report = check_devices(devices, master, args.repair, not args.headers_only, lines,
                               cfg.flash.slab_size if cfg is not None else 0,
                               show_progress=not args.quiet)
    except (OSError, CtxmemError) as exc:  # CtxmemError: an unsafe path (safepaths)
        print(f"ctxmem check: {exc}", file=sys.stderr)
        return 8
    if not args.quiet:
        for line in lines:
            print(line)
    print(f"ctxmem check: {len(report.devices)} device(s), {report.blocks} blocks, "
          f"{report.payloads_verified} payloads verified: {report.errors} problem(s), "
          f"{report.repaired} repaired, {report.warnings} warning(s)")
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2))
    if report.errors == 0:
        return 0
    unrepaired = sum(1 for d in report.devices for q in d.problems
                     if q.kind not in WARNINGS and not q.repaired)
    return 1 if unrepaired == 0 else 4

