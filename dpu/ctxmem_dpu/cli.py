"""``ctxmem serve``: run the service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from ctxmem_common.config import default_config_yaml, load_config
from ctxmem_common.errors import CtxmemError


def _parser() -> argparse.ArgumentParser:
    """The command's argument parser (also what tests/deploy/test_doc_shell_blocks.py
    checks the documented command lines with)."""
    p = argparse.ArgumentParser(prog="ctxmem serve", description="Run the ctxmem service.")
    p.add_argument("--config", help="YAML config file (default: the embedded default config)")
    p.add_argument("--print-default-config", action="store_true",
                   help="print the embedded default config, its paths resolved for this user, "
                        "and exit")
    p.add_argument("--ready-file", help="write the gRPC port here once serving (for scripts)")
    return p


def serve_command(argv: list[str]) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.print_default_config:
        print(default_config_yaml(), end="")
        return 0
    try:
        cfg = load_config(args.config)
    except CtxmemError as exc:
        print(f"ctxmem serve: invalid config: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, cfg.logging.level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from ctxmem_dpu.app import serve
    from ctxmem_dpu.storage import StorageError

    try:
        asyncio.run(serve(cfg, args.ready_file))
    except (CtxmemError, StorageError, OSError) as exc:
        print(f"ctxmem serve: cannot start: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0
