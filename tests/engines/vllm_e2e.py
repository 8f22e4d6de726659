"""End-to-end: a real vLLM engine on CPU with CtxmemConnector and a real ctxmem service.

Run by ``test_vllm_connector.py::test_real_vllm_engine_end_to_end`` where vLLM imports
(``python tests/engines/vllm_e2e.py WORKDIR``). A tiny Llama (4 layers, random weights,
built locally, no hub) runs with vLLM's own prefix cache OFF, so a second request can
only skip prefill by loading from ctxmem. Checks: the repeat and a shared-prefix request
hit ctxmem (external tokens counted by the scheduler, blocks read by the service), their
greedy tokens and logprobs equal the first, cold run's, and a restarted engine process
(a new ``LLM``, same ``PYTHONHASHSEED`` and ``sha256_cbor``) still hits, also with
``ctxmem.async_load`` and with ``ctxmem.layerwise``.
Prints ``E2E OK`` on success.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU backend


def build_model(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def make_llm(model: Path, endpoint: str, **extra: Any) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(model=str(model), skip_tokenizer_init=True, dtype="bfloat16",
               max_model_len=1024, block_size=32, enable_prefix_caching=False,
               disable_log_stats=False,
               enforce_eager=True, max_num_seqs=4, gpu_memory_utilization=0.1,
               prefix_caching_hash_algo="sha256_cbor",
               kv_transfer_config=KVTransferConfig(
                   kv_connector="CtxmemConnector",
                   kv_connector_module_path="ctxmem.integrations.vllm",
                   kv_role="kv_both", kv_load_failure_policy="recompute",
                   kv_connector_extra_config={"ctxmem.endpoint": endpoint, **extra}))


def main(workdir: Path) -> int:
    import torch
    from vllm import SamplingParams

    import ctxmem
    from ctxmem.integrations.vllm import CtxmemConnector
    from ctxmem_tools.launcher import ServiceProcess, local_config

    # What vLLM's own scheduler and stats logger receive from the connector.
    sources: list[dict[str, int]] = []
    stats_seen: list[dict[str, Any]] = []
    real_sources = CtxmemConnector.get_external_cache_hit_sources
    real_build = CtxmemConnector.build_kv_connector_stats.__func__  # type: ignore[attr-defined]

    def record_sources(self: Any, request: Any, n: int) -> Any:
        out = real_sources(self, request, n)
        sources.append({str(k.value): v for k, v in out.items()} | {"_n": n})
        return out

    def record_build(cls: Any, data: Any = None) -> Any:
        if data:
            stats_seen.append(dict(data))
        return real_build(cls, data)

    events_seen: list[Any] = []
    real_take_events = CtxmemConnector.take_events

    def record_events(self: Any) -> Any:
        for e in real_take_events(self):
            events_seen.append(e)
            yield e

    CtxmemConnector.take_events = record_events  # type: ignore[method-assign]
    CtxmemConnector.get_external_cache_hit_sources = record_sources  # type: ignore[method-assign]
    CtxmemConnector.build_kv_connector_stats = classmethod(record_build)  # type: ignore[method-assign,assignment]

    model = workdir / "tiny-llama"
    build_model(model)
    svc = ServiceProcess(workdir / "svc", local_config(workdir / "svc"))
    try:
        t0 = time.time()
        llm = make_llm(model, svc.endpoint)
        print("startup_s", round(time.time() - t0, 1), flush=True)
        sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, detokenize=False)
        g = torch.Generator().manual_seed(1)
        prefix = torch.randint(5, 995, (200,), generator=g).tolist()
        p1 = {"prompt_token_ids": [*prefix, 7, 8, 9]}
        p2 = {"prompt_token_ids": [*prefix, 11, 12, 13, 14]}

        def stats() -> dict[str, float]:
            with ctxmem.Client(svc.endpoint) as c:
                return c.stats()

        def run(prompt: dict[str, Any]) -> Any:
            return llm.generate([prompt], sp, use_tqdm=False)[0]

        cold = run(p1)
        s_cold = stats()
        warm = run(p1)
        s_warm = stats()
        shared = run(p2)
        s_shared = stats()

        def same(a: Any, b: Any) -> bool:
            a, b = a.outputs[0], b.outputs[0]
            return a.token_ids == b.token_ids and all(
                x[t].logprob == y[t].logprob for x, y, t in zip(a.logprobs, b.logprobs,
                                                                a.token_ids, strict=True))

        keys = sorted(k for k in s_shared if any(w in k for w in ("get", "hit", "put",
                                                                  "block", "lookup")))
        print("stats", json.dumps({k: (s_cold.get(k), s_warm.get(k), s_shared.get(k))
                                   for k in keys})[:4000], flush=True)
        print("cold", cold.outputs[0].token_ids, "warm", warm.outputs[0].token_ids,
              "cached_tokens", getattr(warm, "num_cached_tokens", None),
              getattr(shared, "num_cached_tokens", None), flush=True)
        ok = True
        if not same(cold, warm):
            print("FAIL: the repeat (loaded from ctxmem) differs from the cold run")
            ok = False
        warm_cached = getattr(warm, "num_cached_tokens", None)
        if warm_cached is not None and warm_cached < 192:
            print(f"FAIL: the repeat reused only {warm_cached} tokens")
            ok = False
        shared_cached = getattr(shared, "num_cached_tokens", None)
        if shared_cached is not None and shared_cached < 192:
            print(f"FAIL: the shared-prefix request reused only {shared_cached} tokens")
            ok = False
        # Hit sources: vLLM asked the connector, and every loaded token came from the
        # service's DRAM ("host"); the split sums to what vLLM asked about.
        print("hit sources", sources, flush=True)
        if not sources or any(d.get("host", 0) != d["_n"] or len(d) != 2 for d in sources):
            print("FAIL: hit sources were not reported as DRAM (host) for every token")
            ok = False
        # KV events: vLLM's scheduler took a BlockStored (medium ctxmem) for the 6 blocks
        # the cold run saved, with their tokens and vLLM's own block hashes.
        stored = [e for e in events_seen if type(e).__name__ == "BlockStored"]
        print("kv events", [(len(e.block_hashes), len(e.token_ids), e.medium)
                            for e in stored], flush=True)
        first = stored[0] if stored else None
        if (first is None or len(first.block_hashes) != 6 or first.medium != "ctxmem"
                or first.token_ids != p1["prompt_token_ids"][:192]
                or first.parent_block_hash is not None):
            print("FAIL: no BlockStored event for the cold run's 6 blocks")
            ok = False
        # Connector stats reached vLLM's stats logger; Prometheus counters count them.
        from prometheus_client import REGISTRY

        loaded = sum(int(d.get("loaded_blocks", 0)) for d in stats_seen)
        saved = sum(int(d.get("saved_blocks", 0)) for d in stats_seen)
        print("connector stats", stats_seen, flush=True)
        if loaded < 12 or saved < 6:
            print(f"FAIL: connector stats loaded={loaded} saved={saved} (want >=12, >=6)")
            ok = False
        # vLLM's own Prometheus logger (stats on) built our counters through
        # build_prom_metrics and fed them the stats: read them from its registry.
        got = sum(sample.value for metric in REGISTRY.collect()
                  if metric.name == "vllm:ctxmem_loaded_blocks" for sample in metric.samples
                  if sample.name.endswith("_total"))
        print("prometheus vllm:ctxmem_loaded_blocks_total", got, flush=True)
        if got != loaded:
            print("FAIL: the Prometheus counter does not match the stats")
            ok = False
        del llm
        import gc

        gc.collect()
        llm = make_llm(model, svc.endpoint)  # a "restarted" engine
        again = run(p1)
        print("restart cached_tokens", getattr(again, "num_cached_tokens", None), flush=True)
        if not same(cold, again):
            print("FAIL: after an engine restart the output differs")
            ok = False
        if getattr(again, "num_cached_tokens", 192) < 192:
            print("FAIL: a restarted engine did not hit ctxmem")
            ok = False
        for mode in ("ctxmem.async_load", "ctxmem.layerwise"):
            del llm
            gc.collect()
            llm = make_llm(model, svc.endpoint, **{mode: True})
            out = run(p2)
            cached = getattr(out, "num_cached_tokens", None)
            print(mode, "cached_tokens", cached, flush=True)
            if not same(shared, out) or (cached is not None and cached < 192):
                print(f"FAIL: with {mode} the output differs or did not hit")
                ok = False
        # ctxmem.tp_shared (one block per KV head, readable by any TP size): a first
        # engine stores head-sliced blocks, a fresh one loads them; same answer.
        for step in ("store", "load"):
            del llm
            gc.collect()
            llm = make_llm(model, svc.endpoint, **{"ctxmem.tp_shared": True})
            out = run(p1)
            cached = getattr(out, "num_cached_tokens", None)
            print("tp_shared", step, "cached_tokens", cached, flush=True)
            if not same(cold, out) or (step == "load" and (cached or 0) < 192):
                print(f"FAIL: with ctxmem.tp_shared ({step}) the output differs or no hit")
                ok = False
        # Blocks that fail to load (a corrupt block is a miss in the shim) are reported
        # through get_block_ids_with_load_errors; kv_load_failure_policy="recompute" must
        # then recompute them and give the same answer.
        from ctxmem.integrations import vllm_core

        real_fetch = vllm_core.WorkerCore._fetch
        reported: list[int] = []
        real_take = vllm_core.WorkerCore.take_load_errors

        def short_fetch(self: Any, spec: Any, staging: Any) -> int:
            return min(real_fetch(self, spec, staging), 2)

        def take(self: Any) -> set[int]:
            errors = real_take(self)
            reported.extend(errors)
            return errors

        vllm_core.WorkerCore._fetch = short_fetch  # type: ignore[method-assign]
        vllm_core.WorkerCore.take_load_errors = take  # type: ignore[method-assign]
        del llm
        gc.collect()
        llm = make_llm(model, svc.endpoint)
        out = run(p1)
        print("load errors reported", sorted(reported), flush=True)
        if not same(cold, out) or len(reported) != 4:
            print("FAIL: failed loads were not recomputed correctly")
            ok = False
        print("E2E OK" if ok else "E2E FAILED", flush=True)
        return 0 if ok else 1
    finally:
        svc.stop()


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
