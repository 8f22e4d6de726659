"""``ctxmem demo`` and ``ctxmem bench`` (the shim's side of the ``ctxmem`` command)."""

from __future__ import annotations


def demo_command(argv: list[str]) -> int:
    from ctxmem.demo import run

    return run(argv)


def bench_command(argv: list[str]) -> int:
    """``ctxmem bench`` (data path vs limits), ``ctxmem bench ttft`` and
    ``ctxmem bench recovery``."""
    if argv and argv[0] == "ttft":
        from ctxmem.bench_ttft import run as run_ttft

        return run_ttft(argv[1:])
    if argv and argv[0] == "recovery":
        from ctxmem.bench_recovery import run as run_recovery

        return run_recovery(argv[1:])
    from ctxmem.bench import run

    return run(argv)
