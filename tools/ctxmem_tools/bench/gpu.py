"""``ctxmem bench gpu``: host/GPU copies and GPU time to first token (issue 27 item 6).

NOT yet measured: no session that built this had a CUDA device. It is tested for import,
argument handling, its refusal without CUDA and its CPU-side arithmetic and report only
(tests/tools/test_bench_gpu.py); docs/benchmarks.md ("GPU") has the script a session with
a lent device runs first.

Copy rows, each beside a limit measured in the same run (GB/s, 1e9 bytes per second):

* ``h2d_pinned_<B>`` / ``d2h_pinned_<B>``: a batch of ``--batch`` bytes copied between a
  CUDA tensor and the engine's own pinned host buffer (``torch.empty(pin_memory=True)``)
  one block of ``B`` bytes at a time (``copy_(non_blocking=True)`` per block, one
  synchronize per batch: how an engine offloads KV block by block): the ``cudaMemcpy``
  baseline;
* ``h2d_slab_<B>`` / ``d2h_slab_<B>``: the same batch between the CUDA tensor and a real
  ctxmem service's DRAM slab, mapped by the shim over shared memory and registered with
  CUDA (``cudaHostRegister`` on the mapping, ``cudaHostUnregister`` before the shim
  unmaps it: :class:`RegisteredHost`). The slab's bytes are the bench's own stored blocks:
  H2D runs first, and D2H writes the very same bytes back, so what the service stored
  stays as committed;
* their limit (``limit_h2d_<B>`` / ``limit_d2h_<B>``): the whole batch in one copy from
  and to pinned memory: the link's rate for these bytes on this machine.

End-to-end rows, through the shim's ordinary API (``Namespace.put``/``get`` on shared
memory) with the GPU copy before or after: ``gpu_put_<B>`` (D2H into pinned buffers, then
put) and ``get_gpu_<B>`` (get into pinned buffers, then H2D), each against the serial
limit of its two copies (the D2H or H2D limit and the host's memory-copy limit,
:func:`serial_rate`). The same through the registered mapping (``gpu_put_slab_<B>``,
``get_gpu_slab_<B>``) has no value: the shim offers no way yet to copy between the GPU
and a slot it allocated or leased (service-owned staging regions are issue 27 item 1, not
built); the row's note says so.

TTFT rows: ``ctxmem bench ttft --device cuda`` at ``--lengths`` (8K, 16K, 32K tokens by
default) run as a child process (recompute against a load from ctxmem's DRAM tier, with
the new-tokens-only prefill as the floor); and, with ``--vllm-python`` (a CUDA vLLM's
interpreter; ``--vllm-model``, else bench engine's tiny model with room for the longest
length), ``ctxmem bench engine`` at the same lengths: vLLM with no cache, with ctxmem's connector
and with LMCache's (skipped, with its reason, where LMCache does not import there). Each
row carries the command that produced it.

Without CUDA (torch missing, or ``torch.cuda.is_available()`` False) it prints one line
saying so and what to run where, and exits with status 2. ``--json`` writes
``{"benchmark": "gpu", "results": [{name, value, unit, limit, limit_name, ratio, ...}],
"params": {...}, "machine": {...}}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ctxmem_common.units import parse_size
from ctxmem_tools.models import MODEL_CONFIGS

MiB = 1 << 20
DEFAULT_BLOCKS = "64KiB,2MiB"
DEFAULT_BATCH = "64MiB"
DEFAULT_LENGTHS = "8192,16384,32768"
TTFT_TOKENS_PER_BLOCK = 256  # bench ttft's default --tokens-per-block: lengths are multiples
CHILD_TIMEOUT_S = 1800.0  # one TTFT child: a stuck one fails the run, not hangs it
SLAB_NOT_OFFERED = (
    "not offered by the shim yet: a put copies from the caller's buffers and a get into "
    "them; nothing hands an engine an allocated or leased slot to cudaMemcpy into or out "
    "of (service-owned staging regions: issue 27 item 1, not built)"
)
DOC = "docs/benchmarks.md, \"GPU: ctxmem bench gpu\""


@dataclass
class GpuRow:
    """One figure and the limit it is read against (``None``: not measured, see note)."""

    name: str
    value: float | None
    unit: str
    limit: float | None = None
    limit_name: str = ""
    block_bytes: int | None = None
    prompt_tokens: int | None = None
    note: str = ""
    command: str = ""

    @property
    def ratio(self) -> float | None:
        """``value / limit`` for rates, ``limit / value`` for times (1.0: at the limit)."""
        if self.value is None or self.limit is None or self.value <= 0 or self.limit <= 0:
            return None
        if self.unit in ("ms", "s"):
            return self.limit / self.value
        return self.value / self.limit


def gbps(nbytes: int, seconds: float) -> float:
    """GB/s (1e9 bytes per second) of ``nbytes`` moved in ``seconds``."""
    if seconds <= 0:
        raise ValueError(f"{seconds} s for {nbytes} bytes: a timing must be positive")
    return nbytes / seconds / 1e9


def serial_rate(*rates: float | None) -> float | None:
    """The rate of copies done one after the other at ``rates`` each (the same bytes
    through each): ``1 / sum(1 / r)``; None when any is unknown or not positive."""
    if not rates or any(r is None or r <= 0 for r in rates):
        return None
    return 1.0 / sum(1.0 / r for r in rates if r is not None)


def size_label(nbytes: int) -> str:
    """``65536`` -> ``64KiB``, ``2097152`` -> ``2MiB`` (bytes otherwise)."""
    if nbytes >= MiB and nbytes % MiB == 0:
        return f"{nbytes // MiB}MiB"
    if nbytes >= 1024 and nbytes % 1024 == 0:
        return f"{nbytes // 1024}KiB"
    return f"{nbytes}B"


def blocks_per_batch(batch: int, block: int) -> int:
    """How many ``block``-byte blocks one batch of ``batch`` bytes holds (at least one)."""
    if block <= 0 or batch < block:
        raise ValueError(f"--batch {batch} B is smaller than the block {block} B")
    return batch // block


def parse_sizes(text: str, where: str) -> list[int]:
    """``"64KiB,2MiB"`` -> ``[65536, 2097152]`` (sorted, distinct, positive)."""
    out = sorted({parse_size(x.strip(), where) for x in text.split(",") if x.strip()})
    if not out or out[0] <= 0:
        raise ValueError(f"{where}: expected positive sizes such as 64KiB,2MiB, got {text!r}")
    return out


def parse_lengths(text: str) -> list[int]:
    """``"8192,16384"`` -> ``[8192, 16384]`` (sorted, distinct, positive)."""
    try:
        out = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--lengths: expected token counts such as 8192,16384,32768, got "
                         f"{text!r}") from None
    bad = [n for n in out if n <= 0 or n % TTFT_TOKENS_PER_BLOCK]
    if not out or bad:
        raise ValueError(f"--lengths: {bad or text!r}: expected positive multiples of "
                         f"{TTFT_TOKENS_PER_BLOCK} tokens (bench ttft's block)")
    return out


def copy_row(name: str, block: int, seconds: float, nbytes: int, limit_gbps: float | None,
             limit_name: str, note: str = "") -> GpuRow:
    """A GB/s row of ``nbytes`` moved in ``seconds`` beside its limit."""
    return GpuRow(name, gbps(nbytes, seconds), "GB/s", limit_gbps, limit_name, block,
                  note=note)


def ttft_rows(doc: dict[str, Any], command: str) -> list[GpuRow]:
    """``bench ttft --json``'s results as rows: per prefix length, recompute and the load
    from ctxmem's DRAM tier (and flash, where it ran) in ms, each load against the
    new-tokens-only prefill (the floor an infinitely fast tier reaches)."""
    by_len: dict[int, dict[str, float]] = {}
    for r in doc.get("results", []):
        by_len.setdefault(int(r["prefix_tokens"]), {})[str(r["name"])] = float(r["value"])
    rows: list[GpuRow] = []
    for n in sorted(by_len):
        m = by_len[n]
        floor = m.get("prefill.new_tokens")
        floor_ms = None if floor is None else floor * 1e3
        if "ttft.recompute" in m:
            rows.append(GpuRow("ttft_recompute", m["ttft.recompute"] * 1e3, "ms",
                               prompt_tokens=n, note="full prefill, no reuse",
                               command=command))
        for path, label in (("ttft.load_dram", "DRAM"), ("ttft.load_flash", "flash")):
            if path in m:
                speedup = m.get("ttft.recompute", math.nan) / m[path]
                rows.append(GpuRow(f"ttft_ctxmem_{label.lower()}", m[path] * 1e3, "ms",
                                   floor_ms, "prefill of the new tokens alone",
                                   prompt_tokens=n,
                                   note=f"load from ctxmem's {label} tier; "
                                        f"{speedup:.1f}x faster than recompute",
                                   command=command))
    return rows


def engine_rows(doc: dict[str, Any], command: str) -> list[GpuRow]:
    """``bench engine --json``'s results as rows: per vLLM configuration and prompt
    length, the repeat's TTFT (the prefix seen before) against the same server's cold
    one; a skipped configuration is a row with no value and the reason."""
    rows: list[GpuRow] = []
    for r in doc.get("results", []):
        slug = str(r["config"]).replace(" ", "_").lower()
        rows.append(GpuRow(f"engine_{slug}", float(r["repeat_ttft_ms"]), "ms",
                           prompt_tokens=int(r["prompt_tokens"]),
                           note=f"vLLM on CUDA, repeat prompt; cold {r['cold_ttft_ms']} ms"
                                + (f"; {r['note']}" if r.get("note") else ""),
                           command=command))
    for config, reason in doc.get("skipped", {}).items():
        slug = str(config).replace(" ", "_").lower()
        rows.append(GpuRow(f"engine_{slug}", None, "ms", note=f"skipped: {reason}",
                           command=command))
    return rows


def results(rows: Sequence[GpuRow]) -> list[dict[str, Any]]:
    """The ``--json`` ``results`` list: each row's fields and its ratio."""
    return [{**asdict(r), "ratio": r.ratio} for r in rows]


def table(rows: Sequence[GpuRow]) -> str:
    """A markdown table of the rows (``—``: not measured; the note says why)."""
    lines = ["| row | block | tokens | value | limit | of limit | note |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        value = "—" if r.value is None else f"{r.value:.2f} {r.unit}"
        limit = "—" if r.limit is None else f"{r.limit:.2f} {r.unit} ({r.limit_name})"
        ratio = "—" if r.ratio is None else f"{r.ratio:.0%}"
        block = "" if r.block_bytes is None else size_label(r.block_bytes)
        tokens = "" if r.prompt_tokens is None else str(r.prompt_tokens)
        lines.append(f"| {r.name} | {block} | {tokens} | {value} | {limit} | {ratio} | "
                     f"{r.note} |")
    return "\n".join(lines)


def no_cuda_reason() -> str | None:
    """Why this machine cannot run the bench (None: a CUDA device is visible)."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not installed ({exc})"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    return None


def ttft_command(lengths: Sequence[int], model_config: str, json_path: str,
                 repeats: int) -> list[str]:
    """``ctxmem bench ttft --device cuda`` at ``lengths``, as a child's argv."""
    return [sys.executable, "-m", "ctxmem_tools.bench.ttft", "--device", "cuda",
            "--lengths", ",".join(map(str, lengths)), "--model-config", model_config,
            "--dtype", "bfloat16", "--no-flash", "--repeats", str(repeats),
            "--json", json_path]


def engine_command(lengths: Sequence[int], python: str, model: str, json_path: str,
                   rounds: int) -> list[str]:
    """``ctxmem bench engine`` on a CUDA vLLM at ``lengths``, as a child's argv (no
    ``model``: bench engine's tiny model, built with room for the longest length)."""
    return [sys.executable, "-m", "ctxmem_tools.bench.engine", "--python", python,
            *(["--model", model] if model else []), "--lengths", ",".join(map(str, lengths)),
            "--rounds", str(rounds), "--configs", "no cache,ctxmem,LMCache", "--cpus", "",
            "--json", json_path]


# -- CUDA ---------------------------------------------------------------------------------


class RegisteredHost:
    """Host memory registered with CUDA for its lifetime (``with``): page-locked and
    mapped for DMA, so ``cudaMemcpy`` to and from it runs like from pinned memory.
    Unregistered on exit, after a device synchronize (no copy may still use it): the
    caller must keep the memory mapped until then and unmap it only after."""

    def __init__(self, ptr: int, nbytes: int, what: str) -> None:
        self.ptr, self.nbytes, self.what = ptr, nbytes, what
        self.registered = False

    def __enter__(self) -> RegisteredHost:
        import torch

        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self.ptr, self.nbytes, 0)  # cudaHostRegisterDefault
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister({self.what}: {self.nbytes} bytes at "
                               f"{self.ptr:#x}) failed with cudaError {int(err)} (an "
                               f"earlier asynchronous CUDA error can surface here: rerun "
                               f"with CUDA_LAUNCH_BLOCKING=1 to tell)")
        self.registered = True
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        if not self.registered:
            return
        torch.cuda.synchronize()
        err = torch.cuda.cudart().cudaHostUnregister(self.ptr)
        self.registered = False
        if int(err) != 0:
            raise RuntimeError(f"cudaHostUnregister({self.what} at {self.ptr:#x}) failed "
                               f"with cudaError {int(err)}")


def _timed(pairs: Sequence[tuple[Any, Any]], repeats: int) -> float:
    """The fastest of ``repeats`` runs of ``dst.copy_(src)`` over every pair, queued
    without waiting and synchronized once per run (an engine's batched offload)."""
    import torch

    best = math.inf
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def _blocks(t: Any, block: int, count: int) -> list[Any]:
    return [t[i * block:(i + 1) * block] for i in range(count)]


def _host_copy_limit(batch: int, repeats: int) -> float:
    """The host's memory-copy rate for a batch (numpy, past the last-level cache:
    :mod:`~ctxmem_tools.bench.copylimit`), GB/s."""
    from ctxmem_tools.bench.copylimit import (
        copier,
        last_level_cache_bytes,
        make_pairs,
        size_limit,
    )

    sizing = size_limit(batch, last_level_cache_bytes())
    pairs = make_pairs(sizing, seed=11)
    copy, close = copier("numpy", pairs, 1)
    try:
        best = math.inf
        for r in range(max(repeats, sizing.pairs)):
            t0 = time.perf_counter()
            copy(r)
            best = min(best, time.perf_counter() - t0)
    finally:
        close()
    return gbps(batch, best)


def _mapped_slabs(ns: Any) -> list[memoryview]:
    """The service's DRAM slabs the shim's shared-memory channel has mapped for ``ns``
    (its gets map them). The shim has no public handle on its mappings (issue 27 item 1
    would give one); this reads the channel's table, and the views stay valid while the
    client is open."""
    from ctxmem.transport.shm import ShmChannel

    session = ns._session
    ch = None if session is None else session.channel
    if not isinstance(ch, ShmChannel):
        raise RuntimeError("the client is not on the shared-memory transport; "
                           "`ctxmem bench gpu` needs the service on this host")
    return [view for _gen, _mm, view in ch._maps.values()]


def measure_copies(endpoint: str, blocks: Sequence[int], batch: int, repeats: int
                   ) -> list[GpuRow]:
    """The copy rows and the end-to-end rows of every block size (module docstring)."""
    import numpy as np
    import torch

    import ctxmem
    from ctxmem_common.layout import KVLayout

    rows: list[GpuRow] = []
    host_limit = _host_copy_limit(batch, repeats)
    rows.append(GpuRow("limit_host_copy", host_limit, "GB/s", note="numpy copy of a batch, "
                       "past the last-level cache (bench/copylimit.py)"))
    dev = torch.empty(batch, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(batch, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(torch.randint(0, 256, (batch,), dtype=torch.uint8))
    # the limit: the whole batch in one copy, each way
    limit_h2d = gbps(batch, _timed([(dev, pinned)], repeats))
    limit_d2h = gbps(batch, _timed([(pinned, dev)], repeats))
    with ctxmem.Client(endpoint, transport="shm") as client:
        for block in blocks:
            n = blocks_per_batch(batch, block)
            nbytes = n * block
            lbl = size_label(block)
            rows.append(GpuRow(f"limit_h2d_{lbl}", limit_h2d, "GB/s", block_bytes=block,
                               note="the batch in one copy from pinned memory"))
            rows.append(GpuRow(f"limit_d2h_{lbl}", limit_d2h, "GB/s", block_bytes=block,
                               note="the batch in one copy to pinned memory"))
            d, p = _blocks(dev, block, n), _blocks(pinned, block, n)
            rows.append(copy_row(f"h2d_pinned_{lbl}", block, _timed(list(zip(d, p, strict=True)),
                                 repeats), nbytes, limit_h2d, "one copy from pinned"))
            rows.append(copy_row(f"d2h_pinned_{lbl}", block, _timed(list(zip(p, d, strict=True)),
                                 repeats), nbytes, limit_d2h, "one copy to pinned"))

            layout = KVLayout(dtype="uint8", num_layers=1, num_kv_heads=1,
                              head_dim=block // 2, tokens_per_block=1)
            ns = client.open_namespace(layout, model_id=f"bench-gpu-{lbl}")
            host = pinned.numpy()
            views = [host[i * block:(i + 1) * block] for i in range(n)]
            out = [np.empty(block, dtype=np.uint8) for _ in range(n)]

            # end to end through the ordinary API: D2H + put, get + H2D (fresh keys per run)
            put_best = get_best = math.inf
            keys: list[bytes] = []
            for r in range(repeats):
                if keys:
                    ns.delete(keys)
                keys = [f"gpu-{lbl}-{r}-{i}".encode().ljust(32, b".") for i in range(n)]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for dst, src in zip(p, d, strict=True):
                    dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()
                stored = ns.put(keys, views)
                put_best = min(put_best, time.perf_counter() - t0)
                if stored.stored + stored.existing != n:
                    raise RuntimeError(f"put stored {stored.stored} of {n} blocks of "
                                       f"{lbl}; is the service's DRAM tier large enough?")
                t0 = time.perf_counter()
                got = ns.get(keys, views)
                for dst, src in zip(d, p, strict=True):
                    dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()
                get_best = min(get_best, time.perf_counter() - t0)
                if got != n:
                    raise RuntimeError(f"get returned {got} of {n} blocks of {lbl}")
            e2e_put = serial_rate(limit_d2h, host_limit)
            e2e_get = serial_rate(host_limit, limit_h2d)
            rows.append(copy_row(f"gpu_put_{lbl}", block, put_best, nbytes, e2e_put,
                                 "D2H then one host copy", "D2H into pinned, Namespace.put "
                                 "over shared memory"))
            rows.append(copy_row(f"get_gpu_{lbl}", block, get_best, nbytes, e2e_get,
                                 "one host copy then H2D", "Namespace.get over shared "
                                 "memory into pinned, H2D"))
            rows.append(GpuRow(f"gpu_put_slab_{lbl}", None, "GB/s", e2e_put,
                               "D2H then one host copy", block, note=SLAB_NOT_OFFERED))
            rows.append(GpuRow(f"get_gpu_slab_{lbl}", None, "GB/s", e2e_get,
                               "one host copy then H2D", block, note=SLAB_NOT_OFFERED))

            # the service's slab, mapped by the shim and registered with CUDA
            if ns.get(keys, out) != n:
                raise RuntimeError(f"get of {lbl} blocks (to map the slab) came back short")
            slab = max(_mapped_slabs(ns), key=lambda v: v.nbytes)
            m = min(n, slab.nbytes // block)
            slab_t = torch.frombuffer(slab, dtype=torch.uint8)
            note = (f"{m} blocks of the service's {slab.nbytes // MiB} MiB slab"
                    + ("" if m == n else f" (the batch holds {n})"))
            with RegisteredHost(slab_t.data_ptr(), slab.nbytes, f"ctxmem slab of {lbl}"):
                s = _blocks(slab_t, block, m)
                # H2D first, then D2H writes the same bytes back: the stored blocks stay
                h2d_s = _timed(list(zip(d[:m], s, strict=True)), repeats)
                d2h_s = _timed(list(zip(s, d[:m], strict=True)), repeats)
            del s, slab_t, slab
            rows.append(copy_row(f"h2d_slab_{lbl}", block, h2d_s, m * block, limit_h2d,
                                 "one copy from pinned", note))
            rows.append(copy_row(f"d2h_slab_{lbl}", block, d2h_s, m * block, limit_d2h,
                                 "one copy to pinned", note))
            ns.delete(keys)
    return rows


def _child(argv: list[str], json_path: Path, what: str) -> dict[str, Any]:
    print(f"{what}: {shlex.join(argv)}", flush=True)
    out = subprocess.run(argv, timeout=CHILD_TIMEOUT_S, check=False)
    if out.returncode != 0 or not json_path.exists():
        raise RuntimeError(f"{what} exited with status {out.returncode} (command: "
                           f"{shlex.join(argv)})")
    doc: dict[str, Any] = json.loads(json_path.read_text())
    return doc


@contextlib.contextmanager
def _service(workdir: Path, batch: int) -> Iterator[str]:
    from ctxmem_tools.launcher import ServiceProcess, local_config

    slab = max(64 * MiB, batch)
    cfg = local_config(workdir / "svc", dram_size=f"{4 * slab // MiB}MiB",
                       dram_slab=f"{slab // MiB}MiB", flash_size=None)
    with ServiceProcess(workdir / "svc", cfg) as svc:
        yield svc.endpoint


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ctxmem bench gpu",
        description="Host/GPU copy rates (pinned buffer vs a ctxmem service's DRAM slab "
                    "registered with CUDA) and GPU time to first token (recompute vs "
                    "ctxmem vs LMCache). Needs a CUDA device; without one it exits with "
                    "status 2. " + DOC + ".")
    p.add_argument("--blocks", default=DEFAULT_BLOCKS,
                   help="block sizes, comma-separated (default: %(default)s)")
    p.add_argument("--batch", default=DEFAULT_BATCH,
                   help="bytes per batch of blocks (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5,
                   help="runs per copy row, the fastest reported (default: %(default)s)")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS,
                   help="TTFT prompt lengths in tokens (default: %(default)s)")
    p.add_argument("--model-config", choices=sorted(MODEL_CONFIGS), default="1b",
                   help="bench ttft's model (default: %(default)s)")
    p.add_argument("--ttft-repeats", type=int, default=2)
    p.add_argument("--vllm-python", default="",
                   help="a CUDA vLLM's python: adds bench engine's rows (no cache, ctxmem, "
                        "LMCache)")
    p.add_argument("--vllm-model", default="",
                   help="with --vllm-python: a local model directory allowing the longest "
                        "--lengths (default: bench engine's tiny model; a real model's "
                        "tokenizer makes bench engine's word prompts longer than --lengths)")
    p.add_argument("--engine-rounds", type=int, default=2)
    p.add_argument("--no-copy", action="store_true", help="skip the copy rows")
    p.add_argument("--no-ttft", action="store_true", help="skip the TTFT rows")
    p.add_argument("--workdir", default=None,
                   help="an existing directory (default: a temporary one, removed)")
    p.add_argument("--json", dest="json_path", default=None, help="write results here")
    return p


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[int], int,
                                                  list[int]]:
    """(args, block sizes, batch bytes, lengths); a bad argument exits with status 2
    and a message naming it (argparse's ``error``)."""
    p = _parser()
    args = p.parse_args(argv)
    try:
        blocks = parse_sizes(args.blocks, "--blocks")
        batch = parse_size(args.batch, "--batch")
        lengths = parse_lengths(args.lengths)
        for b in blocks:
            blocks_per_batch(batch, b)
    except ValueError as exc:
        p.error(str(exc))
    for name in ("repeats", "ttft_repeats", "engine_rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.vllm_model and not args.vllm_python:
        p.error("--vllm-model needs --vllm-python (a CUDA vLLM's python)")
    if args.workdir and not Path(args.workdir).is_dir():
        p.error(f"--workdir {args.workdir}: not a directory")
    if args.no_copy and args.no_ttft:
        p.error("--no-copy and --no-ttft leave nothing to measure")
    return args, blocks, batch, lengths


def run(argv: list[str] | None = None) -> int:
    """Entry point of ``ctxmem bench gpu``; returns the exit status."""
    args, blocks, batch, lengths = parse_args(argv)
    reason = no_cuda_reason()
    if reason is not None:
        print(f"ctxmem bench gpu: no CUDA device is visible ({reason}); run it on a "
              f"machine with an NVIDIA GPU and a CUDA build of torch (the script in {DOC})",
              file=sys.stderr)
        return 2
    import torch

    base = Path(args.workdir or tempfile.mkdtemp(prefix="ctxmem-bench-gpu-"))
    rows: list[GpuRow] = []
    try:
        if not args.no_copy:
            with _service(base, batch) as endpoint:
                rows += measure_copies(endpoint, blocks, batch, args.repeats)
        if not args.no_ttft:
            path = base / "ttft.json"
            argv_t = ttft_command(lengths, args.model_config, str(path), args.ttft_repeats)
            rows += ttft_rows(_child(argv_t, path, "bench ttft"), shlex.join(argv_t[1:]))
            if args.vllm_python:
                path = base / "engine.json"
                argv_e = engine_command(lengths, args.vllm_python, args.vllm_model,
                                        str(path), args.engine_rounds)
                rows += engine_rows(_child(argv_e, path, "bench engine"),
                                    shlex.join(argv_e[1:]))
            else:
                rows.append(GpuRow("engine_lmcache", None, "ms", note="not run: give "
                                   "--vllm-python (a CUDA vLLM's python)"))
    finally:
        if not args.workdir:
            import shutil

            shutil.rmtree(base, ignore_errors=True)
    print()
    print(table(rows))
    for command in dict.fromkeys(r.command for r in rows if r.command):
        print(f"command: {command}")
    if args.json_path:
        doc = {
            "benchmark": "gpu",
            "results": results(rows),
            "machine": {"device_name": torch.cuda.get_device_name(), "cpus": os.cpu_count(),
                        "platform": platform.platform(), "torch": torch.__version__,
                        "cuda": torch.version.cuda},
            "params": {"blocks": blocks, "batch": batch, "repeats": args.repeats,
                       "lengths": lengths, "model_config": args.model_config,
                       "argv": list(sys.argv[1:] if argv is None else argv),
                       "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
        }
        Path(args.json_path).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run())
