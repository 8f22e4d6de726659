"""``ctxmem status [--json] [--watch [--count N] [--interval S]]``."""

from __future__ import annotations

import argparse
import json
import sys
import time

from ctxmem_common.config import load_config
from ctxmem_common.errors import CtxmemError
from ctxmem_dpu.status.scrape import Scrape, StatusError, scrape, status_document


def metrics_url(config: str | None, url: str | None) -> str:
    """``--url``, else ``metrics.listen`` of ``--config`` (or of the embedded default)."""
    if url:
        return url if "://" in url else f"http://{url}"
    listen = load_config(config).metrics.listen
    if not listen:
        raise StatusError(
            f"metrics.listen is empty in {config or 'the embedded default config'}: the "
            f"service serves no metrics endpoint, which `ctxmem status` reads; set it "
            f"(loopback, e.g. 127.0.0.1:9464) and restart the service")
    return f"http://{listen}"


def _parser() -> argparse.ArgumentParser:
    """The command's argument parser (also what tests/deploy/test_doc_shell_blocks.py
    checks the documented command lines with)."""
    p = argparse.ArgumentParser(
        prog="ctxmem status",
        description="One screen for an operator: health, tiers, traffic, tenants, grants, "
                    "devices, integrity; read from the service's loopback metrics endpoint.")
    p.add_argument("--config", help="the service's config file (for metrics.listen)")
    p.add_argument("--url", help="the metrics endpoint, http://HOST:PORT (instead of --config)")
    p.add_argument("--json", action="store_true", help="print the status document as JSON "
                   "(one line per refresh; docs/operations.md)")
    p.add_argument("--watch", action="store_true", help="refresh until interrupted")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes "
                   "(default 2; rates are measured over it)")
    p.add_argument("--count", type=int, default=0, help="with --watch: stop after N screens")
    p.add_argument("--timeout", type=float, default=5.0,
                   help="seconds each HTTP request may take (default 5)")
    p.add_argument("--width", type=int, default=0, help="columns (default: the terminal's)")
    return p


def status_command(argv: list[str]) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.interval <= 0 or args.timeout <= 0 or args.count < 0:
        p.error("--interval and --timeout must be > 0, --count >= 0")
    if args.count and not args.watch:
        p.error("--count needs --watch")
    try:
        url = metrics_url(args.config, args.url)
        return _run(args, url)
    except (StatusError, CtxmemError) as exc:
        print(f"ctxmem status: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def _run(args: argparse.Namespace, url: str) -> int:
    screens = (args.count or sys.maxsize) if args.watch else 1
    prev: Scrape | None = None
    live = None
    if args.watch and not args.json and sys.stdout.isatty():
        from rich.live import Live

        live = Live(auto_refresh=False, screen=False)
        live.start()
    try:
        for i in range(screens):
            if i:
                time.sleep(args.interval)
            now = scrape(url, args.timeout)
            doc = status_document(now, prev)
            prev = now
            if args.json:
                print(json.dumps(doc, sort_keys=True), flush=True)
            elif live is not None:
                from ctxmem_dpu.status.render import status_renderable

                live.update(status_renderable(doc), refresh=True)
            else:
                from ctxmem_dpu.status.render import render_text

                print(render_text(doc, args.width or _width()), flush=True)
    finally:
        if live is not None:
            live.stop()
    return 0


def _width() -> int:
    import shutil

    return max(80, shutil.get_terminal_size((100, 40)).columns)
