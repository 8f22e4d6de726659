"""``python -m ctxmem_dpu serve ...`` (same as ``ctxmem serve``)."""

import sys

from ctxmem_dpu.cli import serve_command

if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "serve":
        args = args[1:]
    raise SystemExit(serve_command(args))
