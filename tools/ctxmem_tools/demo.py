"""``ctxmem demo``: offload a real transformer's KV cache and load it back.

Builds a small Llama-architecture model locally (seeded random weights: nothing is
downloaded), prefills a long prompt, stores its KV cache in ctxmem block by block, then
serves a second request that shares the prefix by loading the stored KV instead of
recomputing it: once from DRAM and once cold from flash. It checks that the next-token
logits equal a full recompute and prints the hit rate, the load bandwidth and the
prefill time saved. Without ``--endpoint`` it starts its own service (fallback mode,
embedded default config).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from ctxmem.client import Client
from ctxmem_tools.launcher import ServiceProcess, local_config
from ctxmem_tools.models import prefill


def build_model(layers: int, hidden: int, heads: int, kv_heads: int, seed: int = 0) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 3,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=16384)
    model = LlamaForCausalLM(cfg).eval()
    return model


def run_demo(endpoint: str, prompt_tokens: int, new_tokens: int, transport: str) -> int:
    import torch

    from ctxmem import kvtransfer

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = build_model(layers=8, hidden=512, heads=8, kv_heads=4)
    geometry = kvtransfer.geometry_from_config(model.config, tokens_per_block=16)
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, model.config.vocab_size, (1, prompt_tokens), generator=gen)
    suffix = torch.randint(0, model.config.vocab_size, (1, new_tokens), generator=gen)
    full = torch.cat([prefix, suffix], dim=1)

    with Client(endpoint, transport=transport) as client:  # type: ignore[arg-type]
        ns = client.open_namespace(geometry.layout(), model_id="demo-llama-8x512")
        # Request 1: prefill the long prompt, offload its KV.
        t = time.perf_counter()
        _logits, cache = prefill(model, prefix)
        prefill_prefix_s = time.perf_counter() - t
        saved = kvtransfer.save_kv(ns, prefix[0], cache, geometry)
        keys_total = saved.num_blocks
        print(f"request 1: prefilled {prompt_tokens} tokens in {prefill_prefix_s:.2f} s, stored "
              f"{saved.stored} blocks ({saved.nbytes / 2**20:.1f} MiB) in {saved.seconds:.3f} s "
              f"via {client.transport_in_use}"
              + (f"; {saved.already_stored} blocks were already stored (kept on flash by an "
                 f"earlier run: warm restart)" if saved.already_stored else ""))

        # Reference: request 2 computed from scratch.
        t = time.perf_counter()
        ref_logits, _ = prefill(model, full)
        recompute_s = time.perf_counter() - t

        rows = []
        for source in ("dram", "flash"):
            if source == "flash":
                import ctxmem

                keys = ctxmem.chain_hashes(prefix[0].tolist(), geometry.tokens_per_block)
                ns.evict(keys)
            t = time.perf_counter()
            loaded = kvtransfer.load_kv(ns, full[0], geometry, max_tokens=prompt_tokens,
                                        config=model.config)
            logits, _ = prefill(model, full, cache=loaded.cache,
                                           start=loaded.num_tokens)
            ttft_s = time.perf_counter() - t
            equal = torch.equal(logits, ref_logits)
            maxdiff = float((logits - ref_logits).abs().max())
            gbs = loaded.nbytes / max(loaded.get_s, 1e-9) / 1e9
            rows.append((source, loaded.num_blocks, keys_total, loaded.tiers[:1], gbs, ttft_s,
                         equal, maxdiff))
        print(f"request 2 (prefix {prompt_tokens} + {new_tokens} new tokens): full recompute "
              f"{recompute_s:.2f} s")
        ok = True
        for source, got, total, tiers, gbs, ttft_s, equal, maxdiff in rows:
            hit_rate = got / max(total, 1)
            how = "cold, evicted to flash first" if source == "flash" else "as stored"
            print(f"  {how:29}: hit rate {hit_rate:.0%} ({got}/{total} blocks, from "
                  f"{tiers[0] if tiers else '-'}), load {gbs:.2f} GB/s, first token "
                  f"{ttft_s:.2f} s, prefill time saved {recompute_s - ttft_s:.2f} s "
                  f"({recompute_s / ttft_s:.1f}x), logits equal to recompute: {equal} "
                  f"(max |diff| {maxdiff:.2e})")
            ok = ok and got == total and maxdiff <= 1e-4
        stats = client.stats()
        print(f"service: {int(stats['blocks'])} blocks, DRAM hits {int(stats['hits_dram'])}, "
              f"flash hits {int(stats['hits_flash'])}, integrity failures "
              f"{int(stats.get('integrity_failures', 0))}")
    print("demo OK" if ok else "demo FAILED: loaded KV did not reproduce the recompute")
    return 0 if ok else 1


def run(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ctxmem demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", help="use a running service (default: start one)")
    p.add_argument("--config", help="config for the service the demo starts (default: "
                                    "the embedded default)")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp"])
    args = p.parse_args(argv)
    if args.endpoint:
        return run_demo(args.endpoint, args.prompt_tokens, args.new_tokens, args.transport)
    workdir = Path(tempfile.mkdtemp(prefix="ctxmem-demo-", dir="/var/tmp"))
    if args.config:
        svc = ServiceProcess(workdir, config_path=Path(args.config))
    else:
        # The embedded default config, with free ports so the demo never collides with a
        # service already running on this host.
        svc = ServiceProcess(workdir, local_config(workdir, dram_size="1GiB",
                                                   dram_slab="64MiB", flash_size="4GiB",
                                                   flash_slab="256MiB"))
    print(f"started ctxmem service (fallback mode) at {svc.endpoint}; log: {svc.log_path}")
    try:
        return run_demo(svc.endpoint, args.prompt_tokens, args.new_tokens, args.transport)
    finally:
        svc.stop()
