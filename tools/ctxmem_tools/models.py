"""Small Llama models built locally, and the prefill / decode loops the tools run on them.

``build_model`` makes a ``LlamaForCausalLM`` from a named config with seeded random
weights (no download), for the demo, ``ctxmem bench ttft``, the cost-model calibration and
the transformer proof tests. ``prefill`` and ``greedy_decode`` drive such a model the way an
engine would (block-aligned chunked prefill, greedy decoding), so the tools can compare a
cached prefix with full recompute. These are tooling, not engine glue: the engine-facing
KV packing stays in :mod:`ctxmem.kvtransfer`. torch and transformers are imported when a
function runs, so ``ctxmem bench ttft`` can say what is missing instead of failing to load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["MODEL_CONFIGS", "build_model", "greedy_decode", "prefill", "random_prompt"]

# Llama-architecture configs, built with seeded random weights.
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    # ~0.3M params: the CI proof model.
    "tiny": {
        "vocab_size": 1000,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    # ~57M params, GQA 8 query / 4 KV heads of 64: 16 KiB of fp32 KV per token. Sized so
    # a 32K-token prefill takes minutes, not hours, on a 2-core CPU.
    "small": {
        "vocab_size": 32000,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
    # ~1.2B params, Llama-3.2-1B-like shapes (GQA 32/8 heads of 64): for a GPU run.
    "1b": {
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
}



def build_model(
    name: str = "tiny",
    *,
    dtype: str = "float32",
    device: str = "cpu",
    seed: int = 0,
    max_positions: int = 131072,
    attn_implementation: str = "sdpa",
) -> Any:
    """A ``LlamaForCausalLM`` from ``MODEL_CONFIGS[name]``, seeded random init, eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ctxmem.kvtransfer import torch_dtype

    params: dict[str, Any] = dict(MODEL_CONFIGS[name])
    params.update(
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        attn_implementation=attn_implementation,
        dtype=dtype,
    )
    config = LlamaConfig(**params)
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(config)
    return model.to(device=device, dtype=torch_dtype(dtype)).eval()


def _cache_kwarg(model: Any) -> str:
    """The forward's name for the KV cache: ``cache`` since transformers 5.2x (where
    ``past_key_values`` still works but warns), ``past_key_values`` before."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_of(out: Any) -> Any:
    """The KV cache of a forward's output, under either name (see :func:`_cache_kwarg`)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def random_prompt(num_tokens: int, vocab_size: int, seed: int) -> Any:
    """``[1, num_tokens]`` token ids, deterministic in ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, num_tokens), generator=gen)



def prefill(
    model: Any,
    input_ids: torch.Tensor,
    *,
    cache: Any | None = None,
    start: int = 0,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, Any]:
    """Compute tokens ``input_ids[:, start:]`` after ``cache`` (which holds ``start`` tokens).

    Returns ``(next-token logits of the last position [batch, vocab], cache)``. With
    ``chunk_size`` the tokens are computed in chunks whose boundaries sit at absolute
    positions that are multiples of ``chunk_size`` (block-aligned chunked prefill, as
    engines do), so a request whose first ``k * chunk_size`` tokens come from a cache
    runs exactly the same kernels on the same shapes as one that computes everything.
    """
    import torch
    from transformers import DynamicCache

    if cache is None:
        if start != 0:
            raise ValueError("start > 0 needs a cache holding those tokens")
        cache = DynamicCache(config=model.config)
    total = int(input_ids.shape[1])
    if start >= total:
        raise ValueError(f"nothing to compute: start={start} >= {total} tokens")
    logits: torch.Tensor | None = None
    with torch.inference_mode():
        pos = start
        while pos < total:
            end = total if not chunk_size else min(total, (pos // chunk_size + 1) * chunk_size)
            out = model(input_ids[:, pos:end], **{_cache_kwarg(model): cache}, use_cache=True,
                        logits_to_keep=1)
            logits, cache, pos = out.logits[:, -1], _cache_of(out), end
    assert logits is not None
    return logits, cache


def greedy_decode(
    model: Any, logits: torch.Tensor, cache: Any, steps: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy-decode ``steps`` tokens (batch 1) from next-token ``logits`` and ``cache``.

    Returns the tokens and the logits each was chosen from (the first is ``logits``).
    """
    import torch

    tokens: list[int] = []
    seen: list[torch.Tensor] = []
    with torch.inference_mode():
        for step in range(steps):
            seen.append(logits[0])
            token = int(torch.argmax(logits[0]).item())
            tokens.append(token)
            if step + 1 < steps:
                ids = torch.tensor([[token]], device=logits.device)
                out = model(ids, **{_cache_kwarg(model): cache}, use_cache=True)
                logits, cache = out.logits[:, -1], _cache_of(out)
    return tokens, seen
