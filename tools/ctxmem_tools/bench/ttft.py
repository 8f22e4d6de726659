"""``ctxmem bench ttft``: time to first token against reused-prefix length.

For each prefix length L the benchmark builds a prompt of L shared tokens plus
``--new-tokens`` new ones and measures, on a Llama-architecture model built locally
from a config with seeded random weights (no download):

* ``recompute`` -- full prefill of the prompt (no reuse): the engine's TTFT today;
* ``load_dram`` -- Lookup + Get of the L prefix tokens' KV from the DRAM tier, rebuild
  the cache, prefill only the new tokens;
* ``load_flash`` -- the same after ``evict`` dropped the DRAM copies (a cold flash hit:
  the service reads, decrypts and verifies the blocks first);
* ``prefill_new`` -- prefill of the new tokens alone with the prefix already resident
  (the floor both load paths approach: an infinitely fast tier);

plus the model's prefill throughput, put (store) time and transfer rates. The service is
the one at ``--endpoint`` or one this command starts (``python -m ctxmem_dpu serve``)
with a temporary config. Results go to stdout, ``--json`` (a ``results`` list of
``{name, value, unit, prefix_tokens}``) and ``--png`` (matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ctxmem_tools.bench.ttft_report import LengthResult, best, jsonable, plot, results, table
from ctxmem_tools.models import MODEL_CONFIGS, build_model, prefill, random_prompt

__all__ = ["DEFAULT_LENGTHS", "MODEL_CONFIGS", "build_model", "random_prompt", "run"]

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)



def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _measure_length(
    model: Any,
    ns: Any,
    geometry: Any,
    prefix_tokens: int,
    new_tokens: int,
    *,
    device: str,
    chunk: int | None,
    repeats: int,
    seed: int,
    flash: bool,
) -> LengthResult:
    import torch

    import ctxmem
    from ctxmem import kvtransfer as kt

    prompt = random_prompt(prefix_tokens + new_tokens, model.config.vocab_size, seed).to(device)
    flat = prompt[0].tolist()

    _sync(device)
    t0 = time.perf_counter()
    logits, cache = prefill(model, prompt, chunk_size=chunk)
    first = int(torch.argmax(logits[0]).item())
    _sync(device)
    recompute_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    saved = kt.save_kv(ns, flat[:prefix_tokens], cache, geometry)
    store_s = time.perf_counter() - t0
    del cache, logits
    keys = ctxmem.chain_hashes(flat[:prefix_tokens], geometry.tokens_per_block)
    res = LengthResult(
        prefix_tokens, new_tokens, saved.num_blocks * geometry.block_nbytes, recompute_s, store_s
    )

    def load_once(path: str) -> tuple[float, float]:
        _sync(device)
        t0 = time.perf_counter()
        loaded = kt.load_kv(
            ns,
            flat,
            geometry,
            max_tokens=prefix_tokens,
            device=device,
            config=model.config,
            pin_memory=device.startswith("cuda"),
        )
        if loaded.num_tokens != prefix_tokens:
            raise RuntimeError(f"loaded {loaded.num_tokens} of {prefix_tokens} prefix tokens")
        t1 = time.perf_counter()
        logits, _ = prefill(
            model, prompt, cache=loaded.cache, start=loaded.num_tokens, chunk_size=chunk
        )
        token = int(torch.argmax(logits[0]).item())
        _sync(device)
        t2 = time.perf_counter()
        total = t2 - t0
        res.same_first_token &= token == first
        res.note(
            path,
            total,
            {
                "hash_lookup": t1 - t0 - loaded.get_s - loaded.unpack_s,
                "get": loaded.get_s,
                "unpack": loaded.unpack_s,
                "compute_new_tokens": t2 - t1,
            },
        )
        return total, loaded.get_s

    for _ in range(repeats):
        total, get_s = load_once("load_dram")
        res.load_dram_s.append(total)
        res.get_dram_s.append(get_s)
    if flash:
        for _ in range(repeats):
            ns.evict(keys, tier="dram")
            tiers = list(ns.lookup(keys).tiers)
            res.flash_tiers_ok &= bool(tiers) and all(t == "flash" for t in tiers)
            total, get_s = load_once("load_flash")
            res.load_flash_s.append(total)
            res.get_flash_s.append(get_s)
    # the compute floor: prefix resident, only the new tokens computed
    loaded = kt.load_kv(
        ns, flat, geometry, max_tokens=prefix_tokens, device=device, config=model.config
    )
    pairs = kt.cache_layers(loaded.cache)
    for _ in range(repeats):
        cache = kt.build_cache([(k.clone(), v.clone()) for k, v in pairs], model.config)
        _sync(device)
        t0 = time.perf_counter()
        logits, _ = prefill(model, prompt, cache=cache, start=prefix_tokens, chunk_size=chunk)
        int(torch.argmax(logits[0]).item())
        _sync(device)
        res.prefill_new_s.append(time.perf_counter() - t0)
    ns.delete(keys)
    return res



def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ctxmem bench ttft",
        description="Time to first token vs reused-prefix length: recompute, load from the "
        "DRAM tier, load from the flash tier.",
    )
    p.add_argument(
        "--lengths",
        default=",".join(map(str, DEFAULT_LENGTHS)),
        help="comma-separated prefix lengths in tokens (default: %(default)s)",
    )
    p.add_argument(
        "--new-tokens",
        type=int,
        default=64,
        help="new (not reused) tokens after the prefix (default: %(default)s)",
    )
    p.add_argument("--model-config", choices=sorted(MODEL_CONFIGS), default="small")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="model and KV dtype (default: float32 on cpu, bfloat16 on cuda)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--tokens-per-block", type=int, default=256)
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=0,
        help="chunked prefill size in tokens (0: one forward pass)",
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="repeats of the load paths (the fastest is reported)"
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--no-flash", action="store_true", help="skip the flash-tier runs")
    p.add_argument(
        "--endpoint", default=None, help="use this running service instead of starting one"
    )
    p.add_argument("--transport", choices=["auto", "shm", "tcp"], default="auto")
    p.add_argument("--tenant", default="bench")
    p.add_argument("--dram-size", default="2GiB", help="DRAM tier of the service started here")
    p.add_argument("--flash-size", default="4GiB", help="flash file of the service started here")
    p.add_argument(
        "--no-encryption", action="store_true", help="start the service with encryption off"
    )
    p.add_argument(
        "--workdir",
        default=None,
        help="where the started service keeps its files (default: a temp dir under /var/tmp, "
        "removed afterwards; must support O_DIRECT)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None, help="write results as JSON here")
    p.add_argument("--png", dest="png_path", default=None, help="write the plot here")
    return p


@contextlib.contextmanager
def _service(args: argparse.Namespace) -> Iterator[str]:
    """The endpoint to use: ``--endpoint``, or a service started here for the run."""
    if args.endpoint:
        yield args.endpoint
        return
    from ctxmem_tools.launcher import ServiceProcess, local_config

    base = Path(args.workdir or tempfile.mkdtemp(prefix="ctxmem-ttft-", dir="/var/tmp"))
    cfg = local_config(
        base,
        encryption=not args.no_encryption,
        dram_size=args.dram_size,
        dram_slab="64MiB",
        flash_size=args.flash_size,
        flash_slab="256MiB",
    )
    try:
        with ServiceProcess(base, cfg) as svc:
            yield svc.endpoint
    finally:
        if not args.workdir:
            shutil.rmtree(base, ignore_errors=True)


def run(argv: list[str] | None = None) -> int:
    """Entry point of ``ctxmem bench ttft``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        lengths = sorted({int(x) for x in str(args.lengths).split(",") if x.strip()})
    except ValueError:
        print(f"ctxmem bench ttft: bad --lengths {args.lengths!r}", file=sys.stderr)
        return 2
    tpb = args.tokens_per_block
    bad = [n for n in lengths if n <= 0 or n % tpb]
    if bad:
        print(
            f"ctxmem bench ttft: lengths {bad} are not positive multiples of "
            f"--tokens-per-block {tpb}",
            file=sys.stderr,
        )
        return 2
    try:
        import torch
        import transformers  # noqa: F401

        if args.png_path:
            import matplotlib  # noqa: F401
    except ImportError as exc:
        print(
            f"ctxmem bench ttft needs torch, transformers and (for --png) matplotlib: {exc}. "
            "Install them with: pip install 'ctxmem-kv[models]'",
            file=sys.stderr,
        )
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("ctxmem bench ttft: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)

    import ctxmem
    from ctxmem import kvtransfer as kt
    from ctxmem.costmodel import CostModel

    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    model = build_model(
        args.model_config,
        dtype=dtype,
        device=args.device,
        seed=args.seed,
        max_positions=max(lengths) + args.new_tokens + 1024,
    )
    geometry = kt.geometry_from_config(model.config, tokens_per_block=tpb, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    chunk = args.prefill_chunk or None
    print(
        f"model {args.model_config}: {n_params / 1e6:.1f}M params, {dtype}, {args.device}; "
        f"KV {geometry.block_nbytes // tpb} B/token, block {geometry.block_nbytes} B "
        f"({tpb} tokens)",
        flush=True,
    )

    # warm up kernels and allocator so the first length is not penalised
    warm = random_prompt(min(lengths[0], 512) + args.new_tokens, model.config.vocab_size, 99)
    prefill(model, warm.to(args.device), chunk_size=chunk)

    rows: list[LengthResult] = []
    cost = CostModel()
    with _service(args) as endpoint, ctxmem.Client(endpoint, transport=args.transport) as client:
        ns = client.open_namespace(
            geometry.layout(), model_id=f"bench-{args.model_config}", tenant=args.tenant
        )
        for i, n in enumerate(lengths):
            r = _measure_length(
                model,
                ns,
                geometry,
                n,
                args.new_tokens,
                device=args.device,
                chunk=chunk,
                repeats=max(1, args.repeats),
                seed=args.seed + 1000 + i,
                flash=not args.no_flash,
            )
            rows.append(r)
            cost.observe_prefill(n + args.new_tokens, r.recompute_s)
            cost.observe_transfer("dram", r.kv_bytes, best(r.get_dram_s))
            if r.get_flash_s:
                cost.observe_transfer("flash", r.kv_bytes, best(r.get_flash_s))
            flash_txt = f", flash {best(r.load_flash_s):.3f}s" if r.load_flash_s else ""
            print(
                f"  {n:>6} tokens: recompute {r.recompute_s:.3f}s, "
                f"DRAM {best(r.load_dram_s):.3f}s{flash_txt}, "
                f"new-only {best(r.prefill_new_s):.3f}s, put {r.store_s:.3f}s"
                + ("" if r.same_first_token else "  (FIRST TOKEN DIFFERS)")
                + ("" if r.flash_tiers_ok else "  (evict did not move blocks to flash)"),
                flush=True,
            )
        server_stats = client.stats()

    decisions = {}
    for r in rows:
        for tier in ("dram", "flash"):
            d = cost.decide(r.prefix_tokens, r.kv_bytes, tier)
            decisions[f"{tier}@{r.prefix_tokens}"] = {
                "load": d.load,
                "est_load_s": d.est_load_s,
                "est_recompute_s": d.est_recompute_s,
            }
    print()
    print(table(rows))
    title = (
        f"ctxmem TTFT — {args.model_config} Llama ({n_params / 1e6:.0f}M, {dtype}) on "
        f"{args.device}, +{args.new_tokens} new tokens"
    )
    if args.json_path:
        doc = {
            "benchmark": "ttft",
            "results": results(rows),
            "machine": {
                "device": args.device,
                "device_name": (
                    torch.cuda.get_device_name()
                    if args.device == "cuda"
                    else platform.processor() or platform.machine()
                ),
                "cpus": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "torch": torch.__version__,
            },
            "params": {
                "model_config": args.model_config,
                "model": MODEL_CONFIGS[args.model_config],
                "model_params": n_params,
                "dtype": dtype,
                "tokens_per_block": tpb,
                "block_nbytes": geometry.block_nbytes,
                "new_tokens": args.new_tokens,
                "prefill_chunk": chunk,
                "repeats": args.repeats,
                "transport": args.transport,
                "encryption": None if args.endpoint else not args.no_encryption,
                "endpoint": args.endpoint or "started for the run",
                "argv": list(sys.argv[1:] if argv is None else argv),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
            "costmodel": {"snapshot": cost.snapshot(), "decisions": decisions},
            "service_stats": jsonable(server_stats),
            "checks": {
                "same_first_token": all(r.same_first_token for r in rows),
                "flash_tiers_ok": all(r.flash_tiers_ok for r in rows),
            },
        }
        Path(args.json_path).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json_path}")
    if args.png_path:
        plot(rows, args.png_path, title)
        print(f"wrote {args.png_path}")
    if not all(r.flash_tiers_ok for r in rows):
        print("warning: after evict, lookup did not report every block on flash", file=sys.stderr)
    return 0




if __name__ == "__main__":
    raise SystemExit(run())
