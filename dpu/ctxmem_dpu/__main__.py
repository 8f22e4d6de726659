"""``python -m ctxmem_dpu serve ...`` (same as ``ctxmem serve``) and
``python -m ctxmem_dpu check ...`` (same as ``ctxmem check``): the service's commands
without the ``ctxmem`` entry point installed."""

import sys

from ctxmem_dpu.cli import serve_command

if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "check":
        from ctxmem_dpu.check import check_command

        raise SystemExit(check_command(args[1:]))
    if args and args[0] == "serve":
        args = args[1:]
    raise SystemExit(serve_command(args))
