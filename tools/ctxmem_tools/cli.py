"""The tools' side of the ``ctxmem`` command: ``ctxmem demo``, ``ctxmem bench`` (with
``bench ttft`` and ``bench recovery``) ``ctxmem chaos`` and ``ctxmem fuzz``.

Registered in the ``ctxmem.commands`` entry-point group (pyproject.toml), so the
dispatcher in ``ctxmem_common`` finds them by name; each command imports its module only
when it runs (``bench ttft`` needs torch, the others do not).
"""

from __future__ import annotations


def demo_command(argv: list[str]) -> int:
    """``ctxmem demo``: store a small model's KV cache and reuse it."""
    from ctxmem_tools.demo import run

    return run(argv)


def bench_command(argv: list[str]) -> int:
    """``ctxmem bench`` (data path vs limits), ``ctxmem bench ttft``,
    ``ctxmem bench concurrency`` (N clients at once), ``ctxmem bench stable``
    (instructions per block), ``ctxmem bench xts`` (the AES-XTS implementations per
    record), ``ctxmem bench engine`` (a real vLLM server's TTFT per cache),
    ``ctxmem bench gpu`` (host/GPU copies and GPU TTFT; needs CUDA),
    ``ctxmem bench s3`` (each S3 client through the S3 endpoint beside the shim) and
    ``ctxmem bench recovery``."""
    if argv and argv[0] == "ttft":
        from ctxmem_tools.bench.ttft import run as run_ttft

        return run_ttft(argv[1:])
    if argv and argv[0] == "security":
        from ctxmem_tools.bench.security import run as run_security

        return run_security(argv[1:])
    if argv and argv[0] == "pod":
        from ctxmem_tools.bench.pod import run as run_pod

        return run_pod(argv[1:])
    if argv and argv[0] == "engine":
        from ctxmem_tools.bench.engine import run as run_engine

        return run_engine(argv[1:])
    if argv and argv[0] == "gpu":
        from ctxmem_tools.bench.gpu import run as run_gpu

        return run_gpu(argv[1:])
    if argv and argv[0] == "qos":
        from ctxmem_tools.bench.qos import run as run_qos

        return run_qos(argv[1:])
    if argv and argv[0] == "concurrency":
        from ctxmem_tools.bench.concurrency import run as run_concurrency

        return run_concurrency(argv[1:])
    if argv and argv[0] == "stable":
        from ctxmem_tools.bench.stable import run as run_stable

        return run_stable(argv[1:])
    if argv and argv[0] == "profile":
        from ctxmem_tools.bench.profile import run as run_profile

        return run_profile(argv[1:])
    if argv and argv[0] == "xts":
        from ctxmem_tools.bench.xts import run as run_xts

        return run_xts(argv[1:])
    if argv and argv[0] == "s3":
        from ctxmem_tools.bench.s3 import run as run_s3

        return run_s3(argv[1:])
    if argv and argv[0] == "recovery":
        from ctxmem_tools.bench.recovery import run as run_recovery

        return run_recovery(argv[1:])
    from ctxmem_tools.bench.datapath import run

    return run(argv)


def chaos_command(argv: list[str]) -> int:
    """``ctxmem chaos``: a fault campaign against a live service."""
    from ctxmem_tools.chaos.cli import chaos_command as run_chaos

    return run_chaos(argv)


def fuzz_command(argv: list[str]) -> int:
    """``ctxmem fuzz``: a seeded adversarial fuzz of every RPC and the data-plane framing."""
    from ctxmem_tools.fuzz.cli import fuzz_command as run_fuzz

    return run_fuzz(argv)
