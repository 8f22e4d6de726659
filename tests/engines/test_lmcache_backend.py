"""LMCache drives ctxmem through LMCache's own storage plugin interface.

Everything here is real: LMCache's ``LMCacheEngine`` (built by ``LMCacheEngineBuilder``
from an ``LMCacheEngineConfig`` whose ``storage_plugins`` + ``extra_config`` select
``ctxmem.integrations.lmcache.CtxmemBackend``), LMCache's token database, storage manager
and allocator, and the ctxmem service as a subprocess. The only stand-in is the GPU
connector: on a CPU-only machine the "paged KV" is a CPU tensor, copied into LMCache's
memory objects and back with plain torch indexing (LMCache's own connectors need CUDA).

Every retrieval runs in a *fresh* engine (a new instance whose LMCache CPU tier is
empty), so the bytes it returns came through ctxmem; they are compared with the stored
KV byte for byte.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

lmcache = pytest.importorskip(
    "lmcache",
    reason="lmcache is not installed in this environment. It installs on CPU next to "
    "ctxmem with: pip install torch==2.13.0 lmcache==0.5.6 (torch==2.13.0 keeps the "
    "CPU build; docs/engines.md)",
)
torch = pytest.importorskip("torch")

from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402

import ctxmem  # noqa: E402
from ctxmem.integrations.lmcache import CtxmemBackend, encode_chunk_key  # noqa: E402

LAYERS, HEADS, HEAD, CHUNK = 2, 2, 8, 16
MLA_LATENT = 24


class CPUPagedConnector(GPUConnectorInterface):
    """The engine side of LMCache on CPU: ``kvcaches`` is the whole sequence's KV,
    ``[layers, 2, tokens, heads, head]`` (MLA: ``[layers, 1, tokens, 1, latent]``)."""

    def __init__(self, kv_shape: tuple[int, int, int, int, int]) -> None:
        self.layers, self.kv, _, self.heads, self.head = kv_shape
        self.kvcaches = None

    def get_shape(self, num_tokens: int) -> Any:
        return torch.Size([self.kv, self.layers, num_tokens, self.heads * self.head])

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        kv = kwargs["kvcaches"][:, :, start:end]
        memory_obj.tensor.copy_(kv.permute(1, 0, 2, 3, 4).reshape(memory_obj.tensor.shape))

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        t = memory_obj.tensor.reshape(self.kv, self.layers, end - start, self.heads, self.head)
        kwargs["kvcaches"][:, :, start:end] = t.permute(1, 0, 2, 3, 4)

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, s, e, **kwargs)

    def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None,
                       **kwargs: Any) -> None:
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, s, e, **kwargs)


EngineFactory = Callable[..., Any]


@pytest.fixture
def make_engine(service: Any) -> Iterator[EngineFactory]:
    names: list[str] = []

    def factory(*, endpoint: str | None = None, worker_id: int = 0, world_size: int = 1,
                mla: bool = False, save_unfull_chunk: bool = False, local_cpu: bool = True,
                timeout_s: float = 10.0, dtype: Any = None, weights_revision: str = ""
                ) -> Any:
        name = f"ctxmem-test-{len(names)}-{os.getpid()}"
        names.append(name)
        cfg = LMCacheEngineConfig.from_dict({
            "chunk_size": CHUNK,
            "local_cpu": local_cpu,
            "max_local_cpu_size": 0.05,
            "save_unfull_chunk": save_unfull_chunk,
            "storage_plugins": ["ctxmem"],
            "extra_config": {
                "storage_plugin.ctxmem.module_path": "ctxmem.integrations.lmcache",
                "storage_plugin.ctxmem.class_name": "CtxmemBackend",
                "ctxmem.endpoint": endpoint or service.endpoint,
                "ctxmem.timeout_s": timeout_s,
                "ctxmem.weights_revision": weights_revision,
            },
        })
        kv_shape = (LAYERS, 1, CHUNK, 1, MLA_LATENT) if mla else (LAYERS, 2, CHUNK, HEADS, HEAD)
        md = LMCacheMetadata(model_name="tiny-llama", world_size=world_size,
                             local_world_size=world_size, worker_id=worker_id,
                             local_worker_id=worker_id, kv_dtype=dtype or torch.bfloat16,
                             kv_shape=kv_shape, use_mla=mla, chunk_size=CHUNK)
        engine = LMCacheEngineBuilder.get_or_create(
            name, cfg, md, CPUPagedConnector(kv_shape), lambda t, r: None, lambda o, r: o)
        engine.post_init()
        return engine

    yield factory
    for name in names:
        LMCacheEngineBuilder.destroy(name)


def _plugin(engine: Any) -> CtxmemBackend:
    backend = engine.storage_manager.storage_backends["ctxmem"]
    assert isinstance(backend, CtxmemBackend)
    return backend


def _flush(engine: Any) -> None:
    """Wait until the plugin's writer thread has committed every queued put."""
    _plugin(engine)._pool.submit(lambda: None).result(timeout=60)


def _kv(tokens: int, seed: int, mla: bool = False, dtype: Any = None) -> Any:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, 1, tokens, 1, MLA_LATENT) if mla else (LAYERS, 2, tokens, HEADS, HEAD)
    return torch.randn(shape, generator=g).to(dtype or torch.bfloat16)


def _same_bytes(a: Any, b: Any) -> bool:
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def test_plugin_is_loaded_from_config(make_engine: EngineFactory) -> None:
    engine = make_engine()
    names = list(engine.storage_manager.storage_backends)
    assert "ctxmem" in names, names


def test_store_then_retrieve_in_fresh_engine_is_byte_exact(make_engine: EngineFactory,
                                                           service: Any) -> None:
    tokens = torch.arange(1000, 1000 + 4 * CHUNK + 5)  # 4 full chunks and a partial tail
    kv = _kv(len(tokens), seed=1)
    writer = make_engine()
    writer.store(tokens, kvcaches=kv)
    _flush(writer)
    with ctxmem.Client(service.endpoint) as c:
        assert c.stats(), "service answered"

    reader = make_engine()  # empty LMCache CPU tier: hits can only come from ctxmem
    assert reader.lookup(tokens) == 4 * CHUNK
    out = torch.zeros_like(kv)
    mask = reader.retrieve(tokens, kvcaches=out)
    assert int(mask.sum()) == 4 * CHUNK
    assert _same_bytes(out[:, :, : 4 * CHUNK], kv[:, :, : 4 * CHUNK])
    assert not out[:, :, 4 * CHUNK :].any(), "the partial tail was not stored, so not loaded"


def test_no_l1_every_hit_goes_through_ctxmem(make_engine: EngineFactory) -> None:
    tokens = torch.arange(3 * CHUNK)
    kv = _kv(len(tokens), seed=2)
    engine = make_engine(local_cpu=False)
    engine.store(tokens, kvcaches=kv)
    _flush(engine)
    out = torch.zeros_like(kv)
    assert int(engine.retrieve(tokens, kvcaches=out).sum()) == 3 * CHUNK
    assert _same_bytes(out, kv)


def test_prefix_partly_stored_loads_only_stored_chunks(make_engine: EngineFactory) -> None:
    tokens = torch.arange(5 * CHUNK)
    kv = _kv(len(tokens), seed=3)
    writer = make_engine()
    writer.store(tokens[: 2 * CHUNK], kvcaches=kv[:, :, : 2 * CHUNK])
    _flush(writer)
    reader = make_engine()
    out = torch.zeros_like(kv)
    assert int(reader.retrieve(tokens, kvcaches=out).sum()) == 2 * CHUNK
    assert _same_bytes(out[:, :, : 2 * CHUNK], kv[:, :, : 2 * CHUNK])
    assert not out[:, :, 2 * CHUNK :].any()


def test_cache_salt_tag_and_worker_id_separate_namespaces(make_engine: EngineFactory) -> None:
    tokens = torch.arange(500, 500 + 2 * CHUNK)
    kv = _kv(len(tokens), seed=4)
    alice = {"lmcache.tag.cachesalt": "alice-secret"}
    writer = make_engine()
    writer.store(tokens, kvcaches=kv, request_configs=alice)
    _flush(writer)

    reader = make_engine()
    out = torch.zeros_like(kv)
    bob = {"lmcache.tag.cachesalt": "bob-secret"}
    assert int(reader.retrieve(tokens, kvcaches=out, request_configs=bob).sum()) == 0
    assert int(reader.retrieve(tokens, kvcaches=out).sum()) == 0, "unsalted must not hit"
    assert int(reader.retrieve(tokens, kvcaches=out, request_configs=alice).sum()) == 2 * CHUNK
    assert _same_bytes(out, kv)

    other_rank = make_engine(worker_id=1, world_size=2)
    out2 = torch.zeros_like(kv)
    assert int(other_rank.retrieve(tokens, kvcaches=out2, request_configs=alice).sum()) == 0

    backend = _plugin(writer)
    ns = next(iter(backend._namespaces.values()))
    assert ns.tags["cache_salt"] != "alice-secret", "the raw salt is never sent"
    assert ns.tags["lmcache_worker_id"] == "0" and ns.tags["lmcache_world_size"] == "1"
    assert ns.tags["lmcache_dtype"] == "bfloat16" and ns.model_id == "tiny-llama"


def test_weights_revision_is_part_of_the_namespace(make_engine: EngineFactory) -> None:
    """Issue 25, item 6: ``ctxmem.weights_revision`` separates KV of other weights."""
    tokens = torch.arange(900, 900 + 2 * CHUNK)
    kv = _kv(len(tokens), seed=8)
    writer = make_engine(weights_revision="ckpt-1")
    writer.store(tokens, kvcaches=kv)
    _flush(writer)
    assert make_engine(weights_revision="ckpt-2").lookup(tokens) == 0
    assert make_engine().lookup(tokens) == 0
    reader = make_engine(weights_revision="ckpt-1")
    out = torch.zeros_like(kv)
    assert int(reader.retrieve(tokens, kvcaches=out).sum()) == 2 * CHUNK
    assert _same_bytes(out, kv)


def test_dtype_is_part_of_the_namespace(make_engine: EngineFactory) -> None:
    tokens = torch.arange(2 * CHUNK)
    writer = make_engine(dtype=torch.float16)
    writer.store(tokens, kvcaches=_kv(len(tokens), seed=5, dtype=torch.float16))
    _flush(writer)
    reader = make_engine(dtype=torch.bfloat16)
    assert reader.lookup(tokens) == 0


def test_unfull_chunk_round_trips(make_engine: EngineFactory) -> None:
    tokens = torch.arange(7, 7 + 2 * CHUNK + 9)
    kv = _kv(len(tokens), seed=6)
    writer = make_engine(save_unfull_chunk=True)
    writer.store(tokens, kvcaches=kv)
    _flush(writer)
    reader = make_engine(save_unfull_chunk=True)
    assert reader.lookup(tokens) == len(tokens)
    out = torch.zeros_like(kv)
    assert int(reader.retrieve(tokens, kvcaches=out).sum()) == len(tokens)
    assert _same_bytes(out, kv)


def test_mla_chunks_round_trip(make_engine: EngineFactory) -> None:
    tokens = torch.arange(3 * CHUNK)
    kv = _kv(len(tokens), seed=7, mla=True)
    writer = make_engine(mla=True)
    writer.store(tokens, kvcaches=kv)
    _flush(writer)
    ns = next(iter(_plugin(writer)._namespaces.values()))
    assert ns.layout.is_mla and ns.block_nbytes == LAYERS * CHUNK * MLA_LATENT * 2
    reader = make_engine(mla=True)
    out = torch.zeros_like(kv)
    assert int(reader.retrieve(tokens, kvcaches=out).sum()) == 3 * CHUNK
    assert _same_bytes(out, kv)


def test_blocks_survive_service_restart(make_engine: EngineFactory, service: Any) -> None:
    tokens = torch.arange(300, 300 + 3 * CHUNK)
    kv = _kv(len(tokens), seed=8)
    writer = make_engine()
    writer.store(tokens, kvcaches=kv)
    _flush(writer)
    service.restart()
    reader = make_engine()
    out = torch.zeros_like(kv)
    assert int(reader.retrieve(tokens, kvcaches=out).sum()) == 3 * CHUNK
    assert _same_bytes(out, kv)


def test_service_down_degrades_to_misses(make_engine: EngineFactory, service: Any) -> None:
    tokens = torch.arange(2 * CHUNK)
    kv = _kv(len(tokens), seed=9)
    engine = make_engine(local_cpu=False, timeout_s=2.0)
    service.kill()
    engine.store(tokens, kvcaches=kv)  # must not raise
    _flush(engine)
    out = torch.zeros_like(kv)
    assert int(engine.retrieve(tokens, kvcaches=out).sum()) == 0
    assert engine.lookup(tokens) == 0


def test_chunk_keys_are_stable_and_distinct() -> None:
    from lmcache.utils import CacheEngineKey, LayerCacheEngineKey

    k = CacheEngineKey("m", 1, 0, 0x1234, torch.bfloat16)
    assert encode_chunk_key(k) == encode_chunk_key(CacheEngineKey("m", 1, 0, 0x1234,
                                                                  torch.bfloat16))
    assert encode_chunk_key(k) != encode_chunk_key(CacheEngineKey("m", 1, 0, -0x1234,
                                                                  torch.bfloat16))
    assert encode_chunk_key(k) != encode_chunk_key(CacheEngineKey("m", 1, 0, b"\x12\x34",
                                                                  torch.bfloat16))
    layer_keys = {encode_chunk_key(LayerCacheEngineKey("m", 1, 0, 0x1234, torch.bfloat16,
                                                       layer_id=i)) for i in range(3)}
    assert len(layer_keys) == 3 and all(len(x) <= 64 for x in layer_keys)
