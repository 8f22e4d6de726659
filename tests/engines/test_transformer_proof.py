"""Proof on a real transformer: KV loaded from ctxmem gives the same answers as recompute.

A Llama-architecture model (transformers' ``LlamaForCausalLM``, 4 layers, hidden 128,
4 query / 2 KV heads, vocab 1000, seeded random weights, eval mode) prefills a prompt;
its KV goes to a REAL ctxmem service block by block, keyed by ``ctxmem.chain_hashes``.
A second request that shares a prefix looks the prefix up, gets the stored blocks,
rebuilds the cache and computes only its new tokens. Checked, per case:

1. the loaded KV bytes are exactly the stored ones (``torch.equal`` per layer);
2. block-aligned chunked prefill (as engines run it): next-token logits are bit-exact
   equal to full recompute, and so are the logits of every greedy decode step;
3. single-pass prefill (transformers' default): logits within the float tolerance
   argued in ``docs/engines-proof.md``, greedy generations identical.

Cases: encryption on/off x DRAM tier / flash tier (after ``evict``; Lookup must say
"flash"), a partly stored prefix, a repeated prompt, bfloat16, a service restart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import ctxmem  # noqa: E402
from ctxmem import kvtransfer as kt  # noqa: E402
from ctxmem_tools.models import greedy_decode, prefill  # noqa: E402

TPB = 32  # tokens per block, and the chunk size of the block-aligned prefill
PROMPT_A = 320  # first request: 10 full blocks
SHARED = 200  # the second request shares A's first 200 tokens (6 full blocks)...
NEW = 60  # ...then has 60 tokens of its own
GREEDY_STEPS = 8
# float32 logits of a single-pass prefill vs prefix-cached compute: see docs/engines-proof.md
FP32_ATOL = 1e-5
BF16_ATOL = 2.0**-6  # 4 bf16 ulps of logits in [0.5, 1)


@dataclass
class Prompts:
    a: Any  # [1, PROMPT_A]
    b: Any  # [1, SHARED + NEW]


def _prompts(seed: int = 1, vocab: int = 1000) -> Prompts:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(0, vocab, (1, PROMPT_A), generator=gen)
    b = torch.cat([a[:, :SHARED], torch.randint(0, vocab, (1, NEW), generator=gen)], dim=1)
    return Prompts(a, b)


def _clone_cache(model: Any, cache: Any) -> Any:
    return kt.build_cache([(k.clone(), v.clone()) for k, v in kt.cache_layers(cache)], model.config)


_memo: dict[tuple[Any, ...], Any] = {}


def _memoised(key: tuple[Any, ...], fn: Any) -> Any:
    """References depend only on (model, prompt): compute each once per session."""
    if key not in _memo:
        _memo[key] = fn()
    return _memo[key]


def _chunked_kv(model: Any, ids: Any) -> list[tuple[Any, Any]]:
    def run() -> list[tuple[Any, Any]]:
        return kt.cache_layers(prefill(model, ids, chunk_size=TPB)[1])

    return _memoised((id(model), "kv", ids.numpy().tobytes()), run)


def _reference(model: Any, ids: Any, chunked: bool) -> tuple[Any, list[int], list[Any]]:
    """Full recompute: next-token logits, greedy tokens and each step's logits."""

    def run() -> tuple[Any, list[int], list[Any]]:
        logits, cache = prefill(model, ids, chunk_size=TPB if chunked else None)
        tokens, seen = greedy_decode(model, logits, cache, GREEDY_STEPS)
        return logits, tokens, seen

    return _memoised((id(model), "ref", chunked, ids.numpy().tobytes()), run)


def _store_prompt(
    ns: Any, model: Any, ids: Any, geometry: kt.KVGeometry, num_tokens: int | None = None
) -> kt.SaveResult:
    """Prefill ``ids`` (block-aligned chunks) and store its first ``num_tokens`` tokens' KV."""
    tokens = ids[0] if num_tokens is None else ids[0, :num_tokens]
    return kt.save_kv(ns, tokens, _chunked_kv(model, ids), geometry)


def _check_loaded_bytes(model: Any, loaded: kt.LoadResult, source_ids: Any) -> None:
    """The loaded KV equals, bit for bit, the KV the first request computed."""
    n = loaded.num_tokens
    for (k, v), (k2, v2) in zip(
        _chunked_kv(model, source_ids), kt.cache_layers(loaded.cache), strict=True
    ):
        assert k2.shape[2] == n
        assert torch.equal(k[:, :, :n], k2) and torch.equal(v[:, :, :n], v2)


def _check_exact(model: Any, ids: Any, loaded: kt.LoadResult) -> None:
    """Block-aligned chunked prefill: loaded + new tokens == full recompute, bit for bit."""
    ref_logits, ref_tokens, ref_seen = _reference(model, ids, chunked=True)
    cache = _clone_cache(model, loaded.cache)
    logits, cache = prefill(model, ids, cache=cache, start=loaded.num_tokens, chunk_size=TPB)
    assert torch.equal(logits, ref_logits), (
        f"max |diff| {(logits.float() - ref_logits.float()).abs().max().item():.3g}"
    )
    tokens, seen = greedy_decode(model, logits, cache, GREEDY_STEPS)
    assert tokens == ref_tokens
    for step, (x, y) in enumerate(zip(seen, ref_seen, strict=True)):
        assert torch.equal(x, y), f"decode step {step} logits differ"


def _check_single_pass(model: Any, ids: Any, loaded: kt.LoadResult, atol: float) -> float:
    """transformers' default single forward: logits within tolerance, same greedy tokens."""
    ref_logits, ref_tokens, _ = _reference(model, ids, chunked=False)
    cache = _clone_cache(model, loaded.cache)
    logits, cache = prefill(model, ids, cache=cache, start=loaded.num_tokens)
    diff = (logits.float() - ref_logits.float()).abs().max().item()
    assert diff <= atol, f"max |logit diff| {diff:.3g} > {atol}"
    tokens, _ = greedy_decode(model, logits, cache, GREEDY_STEPS)
    assert tokens == ref_tokens
    return diff


def _namespace(client: Any, geometry: kt.KVGeometry, **kw: Any) -> Any:
    return client.open_namespace(
        geometry.layout(), model_id="tiny-llama", tenant="proof", tags={"cache_salt": "proof"}, **kw
    )


@pytest.mark.parametrize("tier", ["dram", "flash"])
@pytest.mark.parametrize("encryption", [True, False], ids=["encrypted", "plain"])
def test_shared_prefix_loads_and_matches_recompute(
    service_factory: Any, tiny_model: Any, tier: str, encryption: bool
) -> None:
    svc = service_factory(encryption=encryption)
    model, p = tiny_model, _prompts()
    g = kt.geometry_from_config(model.config, tokens_per_block=TPB)
    with ctxmem.Client(svc.endpoint) as client:
        ns = _namespace(client, g)
        saved = _store_prompt(ns, model, p.a, g)
        assert (saved.num_blocks, saved.stored) == (PROMPT_A // TPB, PROMPT_A // TPB)

        keys_b = ctxmem.chain_hashes(p.b[0].tolist(), TPB)
        if tier == "flash":
            assert ns.evict(ctxmem.chain_hashes(p.a[0].tolist(), TPB), tier="dram") >= 1
        hit = ns.lookup(keys_b)
        assert hit.num_hits == SHARED // TPB  # the block holding the divergence misses
        assert hit.tiers == [tier] * (SHARED // TPB)

        loaded = kt.load_kv(ns, p.b[0], g, config=model.config)
        assert loaded.num_tokens == (SHARED // TPB) * TPB == 192
        assert loaded.tiers == [tier] * (SHARED // TPB)
        _check_loaded_bytes(model, loaded, p.a)
        _check_exact(model, p.b, loaded)
        _check_single_pass(model, p.b, loaded, FP32_ATOL)


@pytest.mark.parametrize("how", ["stored_first_blocks", "deleted_tail"])
def test_partly_stored_prefix_loads_only_stored_blocks(
    service: Any, tiny_model: Any, how: str
) -> None:
    model, p = tiny_model, _prompts(seed=2)
    g = kt.geometry_from_config(model.config, tokens_per_block=TPB)
    stored_blocks = 4
    with ctxmem.Client(service.endpoint) as client:
        ns = _namespace(client, g)
        if how == "stored_first_blocks":
            saved = _store_prompt(ns, model, p.a, g, num_tokens=stored_blocks * TPB)
            assert saved.stored == stored_blocks
        else:
            _store_prompt(ns, model, p.a, g)
            keys_a = ctxmem.chain_hashes(p.a[0].tolist(), TPB)
            assert ns.delete(keys_a[stored_blocks:]) == len(keys_a) - stored_blocks
        assert ns.lookup(ctxmem.chain_hashes(p.b[0].tolist(), TPB)).num_hits == stored_blocks

        loaded = kt.load_kv(ns, p.b[0], g, config=model.config)
        assert loaded.num_blocks == stored_blocks and loaded.num_tokens == stored_blocks * TPB
        _check_loaded_bytes(model, loaded, p.a)
        _check_exact(model, p.b, loaded)  # tokens 128..259 recomputed, still exact
        _check_single_pass(model, p.b, loaded, FP32_ATOL)

        # the request now stores what it computed: the next one finds the whole prefix
        _store_prompt(ns, model, p.b, g)
        again = kt.load_kv(ns, p.b[0], g, config=model.config)
        assert again.num_tokens == (p.b.shape[1] - 1) // TPB * TPB


def test_repeated_prompt_loads_all_but_the_last_block(service: Any, tiny_model: Any) -> None:
    """The same prompt again: every full block but the one holding the last token loads."""
    model, p = tiny_model, _prompts(seed=3)
    g = kt.geometry_from_config(model.config, tokens_per_block=TPB)
    with ctxmem.Client(service.endpoint) as client:
        ns = _namespace(client, g)
        _store_prompt(ns, model, p.a, g)
        loaded = kt.load_kv(ns, p.a[0], g, config=model.config)
        # 320 tokens = 10 blocks, but at least one token must be computed for logits
        assert loaded.num_tokens == 9 * TPB
        _check_exact(model, p.a, loaded)
        _check_single_pass(model, p.a, loaded, FP32_ATOL)


def test_other_salt_or_tenant_sees_nothing(service: Any, tiny_model: Any) -> None:
    model, p = tiny_model, _prompts(seed=4)
    g = kt.geometry_from_config(model.config, tokens_per_block=TPB)
    with ctxmem.Client(service.endpoint) as client:
        _store_prompt(_namespace(client, g), model, p.a, g)
        other_salt = client.open_namespace(
            g.layout(), model_id="tiny-llama", tenant="proof", tags={"cache_salt": "someone-else"}
        )
        other_tenant = client.open_namespace(
            g.layout(), model_id="tiny-llama", tenant="other", tags={"cache_salt": "proof"}
        )
        for ns in (other_salt, other_tenant):
            assert kt.load_kv(ns, p.b[0], g, config=model.config).num_tokens == 0


def test_bfloat16(service: Any, tiny_model_bf16: Any) -> None:
    model, p = tiny_model_bf16, _prompts(seed=5)
    g = kt.geometry_from_config(model.config, tokens_per_block=TPB)
    assert g.dtype == torch.bfloat16 and g.layout().dtype == "bfloat16"
    with ctxmem.Client(service.endpoint) as client:
        ns = _namespace(client, g)
        _store_prompt(ns, model, p.a, g)
        loaded = kt.load_kv(ns, p.b[0], g, config=model.config)
        assert loaded.num_tokens == 192
        _check_loaded_bytes(model, loaded, p.a)
        _check_exact(model, p.b, loaded)
        _check_single_pass(model, p.b, loaded, BF16_ATOL)


@pytest.mark.parametrize("how", ["graceful", "crash"])
def test_after_service_restart(service_factory: Any, tiny_model: Any, how: str) -> None:
    """Committed blocks survive a restart (SIGTERM) and a crash (SIGKILL) of the service."""
    svc = service_factory(write_policy="write_through")
    model, p = tiny_model, _prompts(seed=6)
    g = kt.geometry_from_config(model.config, tokens_per_block=TPB)
    with ctxmem.Client(svc.endpoint) as client:
        _store_prompt(_namespace(client, g), model, p.a, g)
    svc.restart(kill=how == "crash")
    with ctxmem.Client(svc.endpoint) as client:
        ns = _namespace(client, g)
        hit = ns.lookup(ctxmem.chain_hashes(p.b[0].tolist(), TPB))
        assert hit.num_hits == SHARED // TPB
        loaded = kt.load_kv(ns, p.b[0], g, config=model.config)
        assert loaded.num_tokens == 192
        _check_loaded_bytes(model, loaded, p.a)
        _check_exact(model, p.b, loaded)
        _check_single_pass(model, p.b, loaded, FP32_ATOL)
