"""``ctxmem demo`` and ``ctxmem bench`` (the shim's side of the ``ctxmem`` command)."""

from __future__ import annotations


def demo_command(argv: list[str]) -> int:
    from ctxmem.demo import run

    return run(argv)


def bench_command(argv: list[str]) -> int:
    """``ctxmem bench`` (data path vs limits) and ``ctxmem bench ttft``."""
    if argv and argv[0] == "ttft":
        from ctxmem.bench_ttft import run as run_ttft

        return run_ttft(argv[1:])
    from ctxmem.bench import run

    return run(argv)
