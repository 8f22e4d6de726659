"""``ctxmem bench``'s staged-put rows (issue 27 item 1): ``dram_put_staged_<size>``.

A staged put (:mod:`ctxmem.staging`) names blocks that already lie in a service-owned
staging region (the engine's offload buffer); the service copies each into its slot with
the CRC32C fused, one pass over memory. The batch is written into the region once,
before the timed rounds (what an engine's own copy into its offload buffer does, not
the put's work); each round then puts the whole region's blocks under new keys in one
call per batch. The rows sit beside ``dram_put_<size>`` and are held against the same
memcpy limit (and, as every put row, against ``put_two_pass``). Shared memory only: on
another transport there are no rows.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import numpy as np

from ctxmem_common.keys import chain_hashes

if TYPE_CHECKING:
    from ctxmem.client import Client
    from ctxmem.namespace import Namespace
    from ctxmem_tools.bench.cpu import CpuMeter
    from ctxmem_tools.bench.datapath import Result

__all__ = ["bench_staged", "staged_row"]

GB = 1e9


def staged_row(size: str, crypt: str) -> str:
    """The row's name, beside ``dram_put_<size>[_xts]``."""
    return f"dram_put_staged_{size}{crypt}"


def bench_staged(client: Client, ns: Namespace, bufs: list[np.ndarray], rounds: int,
                 size: str, crypt: str, salt: bytes, limit: float, meter: CpuMeter,
                 results: list[Result]) -> None:
    """``rounds`` staged puts of ``bufs`` (one block each, ``ns``'s block size) through a
    region of ``client``; appends the GB/s row (median batch) and its p50/p99 ms rows.
    The first round's blocks are read back and compared before any figure is kept."""
    from ctxmem_tools.bench.datapath import Result, _pct

    if client.transport_in_use != "shm":
        return
    block = ns.block_nbytes
    batch = len(bufs)
    nbytes = block * batch
    name = staged_row(size, crypt)
    offsets = [i * block for i in range(batch)]
    times: list[float] = []
    with client.staging(nbytes) as region:
        data = region.array()
        for i, b in enumerate(bufs):
            data[i * block:(i + 1) * block] = b
        for r in range(rounds):
            keys = chain_hashes(np.arange(batch) + r * batch, 1, salt=salt + size.encode())
            with meter.phase(name, nbytes):
                t = time.perf_counter()
                res = region.put(ns, keys, offsets)
                times.append(time.perf_counter() - t)
            assert res.stored == batch and not res.refused, res
            if r == 0:
                out = [np.empty(block, np.uint8) for _ in range(batch)]
                assert ns.get(keys, out) == batch
                assert all(np.array_equal(a, b) for a, b in zip(bufs, out, strict=True))
            ns.delete(keys)
    del data
    gbs = nbytes / statistics.median(times) / GB
    results.append(Result(name, gbs, "GB/s", limit, gbs / limit, *meter.per_gb(name)))
    ideal_ms = nbytes / (limit * GB) * 1e3
    for q, label in ((0.5, "p50"), (0.99, "p99")):
        ms = _pct(times, q) * 1e3
        results.append(Result(f"{name}_{label}", ms, "ms/batch", ideal_ms, ideal_ms / ms))
