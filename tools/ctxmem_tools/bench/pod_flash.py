"""The shared-flash rows of ``ctxmem bench pod``: a get straight from a pod's shared
flash device next to the device's O_DIRECT read of the same extents.

The measurement runs in the service's package as a child program
(``python -m ctxmem_dpu.pod.bench_shared``: two pod nodes on one shared file, a real
redis-server for their slab leases, which this function starts); the tools never import
the service. Rows are :class:`~ctxmem_tools.bench.datapath.Result`, as every bench's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ctxmem_tools.bench.datapath import Result
from ctxmem_tools.redis_server import RedisServer

# A bound on the whole measurement (the child writes and reads a few hundred MiB).
BENCH_TIMEOUT_S = 600.0


def measure_shared_flash(workdir: Path | None = None, block_kib: Sequence[int] = (2048, 64),
                         blocks: int = 256, batch: int = 32, repeat: int = 3,
                         threads: int = 4) -> list[Result]:
    """Shared-flash get throughput (GB/s, every byte decrypted, CRC-checked and its
    authenticator verified) and the p50 latency of a one-block get (µs), per block size,
    each with its O_DIRECT limit.

    ``workdir`` must be on a filesystem with O_DIRECT (not tmpfs); default: a temporary
    directory. Raises RuntimeError naming the child's output when it fails."""
    return shared_flash_run(workdir, block_kib, blocks, batch, repeat, threads)[0]


def shared_flash_run(workdir: Path | None = None, block_kib: Sequence[int] = (2048, 64),
                     blocks: int = 256, batch: int = 32, repeat: int = 3, threads: int = 4,
                     env: dict[str, str] | None = None) -> tuple[list[Result], str]:
    """:func:`measure_shared_flash` with ``env`` set for the child over this process's
    environment (``--auth-ab``: bench/auth_ab.py); returns its rows and its stderr."""
    with tempfile.TemporaryDirectory(dir=workdir, prefix="ctxmem-podbench-") as tmp, \
            RedisServer(Path(tmp) / "redis") as redis:
        cmd = [sys.executable, "-m", "ctxmem_dpu.pod.bench_shared", "--url", redis.url,
               "--dir", tmp, "--blocks", str(blocks), "--batch", str(batch),
               "--repeat", str(repeat), "--threads", str(threads), "--block-kib",
               *map(str, block_kib)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False,
                                  timeout=BENCH_TIMEOUT_S, env={**os.environ, **(env or {})})
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"shared-flash bench took over {BENCH_TIMEOUT_S:g} s"
                               ) from None
    if done.returncode != 0:
        raise RuntimeError(f"shared-flash bench failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")
    rows = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
    return [Result(r["name"], r["value"], r["unit"], r["limit"], r["fraction_of_limit"])
            for r in rows], done.stderr
