"""LMCache models with several KV groups, through LMCache's own engine and storage path.

The groups are LMCache 0.5.6's own: a ``KVLayerGroupsManager`` built from per-layer CPU
KV tensors (LMCache's format detection, ``group_layers_by_identity``), set on the engine
metadata as the vLLM connector does when it registers KV caches. The engine then
allocates one memory object per chunk holding every group's tensor
(``LMCacheMetadata.get_shapes``/``get_dtypes``), its storage manager hands them to
ctxmem's plugin, and a fresh engine (empty LMCache CPU tier) loads them back. The GPU
connector is a CPU stand-in (LMCache's own connectors need CUDA) that copies each
group's layers with ``MemoryObj.get_tensor(group)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
lmcache = pytest.importorskip("lmcache", reason="LMCache 0.5.6 is installed by "
                              "deploy/setup.sh (plain pip) into the main venv")
torch = pytest.importorskip("torch")

from lmcache.utils import EngineType  # noqa: E402
from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface  # noqa: E402
from lmcache.v1.gpu_connector.utils import (  # noqa: E402
    normalize_and_discover_per_layer_formats,
)
from lmcache.v1.kv_layer_groups import KVLayerGroupsManager  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.multiprocess.group_view import EngineGroupInfo  # noqa: E402

from ctxmem.integrations.lmcache import CtxmemBackend, encode_chunk_key  # noqa: E402

CHUNK = 16
# (heads, head size, dtype, engine group) per layer.
MIXED = [(2, 8, torch.bfloat16, 0), (2, 8, torch.bfloat16, 0), (1, 4, torch.float16, 0)]
"""Two groups of different shapes and dtypes: 2 layers of 2x8 bf16, 1 layer of 1x4 fp16."""
TWIN = [(2, 8, torch.bfloat16, 0), (2, 8, torch.bfloat16, 1),
        (2, 8, torch.bfloat16, 0), (2, 8, torch.bfloat16, 1)]
"""Two groups of identical geometry, told apart only by their engine group (as a hybrid
model's full-attention and sliding-window layers are)."""


def layer_tensors(spec: list[tuple[int, int, Any, int]], tokens: int) -> list[Any]:
    """Per-layer paged KV in vLLM's flash layout ``[2, blocks, block, heads, head]``."""
    return [torch.zeros(2, tokens // CHUNK + 1, CHUNK, h, d, dtype=dt)
            for h, d, dt, _ in spec]


def groups_manager(spec: list[tuple[int, int, Any, int]]) -> Any:
    kv = layer_tensors(spec, 4 * CHUNK)
    engine_groups = sorted({g for *_, g in spec})
    layer_groups = [[i for i, s in enumerate(spec) if s[3] == g] for g in engine_groups]
    norm, fmts = normalize_and_discover_per_layer_formats(
        kv, layer_groups, EngineType.VLLM, {"kv_layout": "NHD"})
    infos = [EngineGroupInfo(engine_group_id=g, layer_indices=tuple(idx),
                             tokens_per_block=CHUNK)
             for g, idx in zip(engine_groups, layer_groups, strict=True)]
    return KVLayerGroupsManager(norm, fmts, infos if len(infos) > 1 else (),
                                lmcache_tokens_per_chunk=CHUNK)


class GroupedCPUConnector(GPUConnectorInterface):
    """``kvcaches``: one ``[2, tokens, heads, head]`` tensor per layer (the sequence's KV);
    each group's slice of a memory object is ``[2, layers of the group, tokens, hidden]``."""

    def __init__(self, manager: Any) -> None:
        self.groups = [list(g.layer_indices) for g in manager.kernel_groups]

    def get_shape(self, num_tokens: int) -> Any:
        raise AssertionError("only the layer-wise path asks; not used here")

    def _pairs(self, obj: Any, start: int, end: int, kv: list[Any]) -> Iterator[Any]:
        for g, layers in enumerate(self.groups):
            dst = obj.get_tensor(g)
            for j, layer in enumerate(layers):
                yield dst[:, j], kv[layer][:, start:end].reshape(2, end - start, -1)

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        for dst, src in self._pairs(memory_obj, start, end, kwargs["kvcaches"]):
            dst.copy_(src)

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        for src, dst in self._pairs(memory_obj, start, end, kwargs["kvcaches"]):
            dst.copy_(src)

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, s, e, **kwargs)

    def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None,
                       **kwargs: Any) -> None:
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, s, e, **kwargs)


@pytest.fixture
def make_engine(service: Any) -> Iterator[Callable[..., Any]]:
    names: list[str] = []

    def factory(spec: list[tuple[int, int, Any, int]], *, unfull: bool = False) -> Any:
        name = f"ctxmem-groups-{len(names)}-{os.getpid()}"
        names.append(name)
        cfg = LMCacheEngineConfig.from_dict({
            "chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.05,
            "save_unfull_chunk": unfull, "storage_plugins": ["ctxmem"],
            "extra_config": {
                "storage_plugin.ctxmem.module_path": "ctxmem.integrations.lmcache",
                "storage_plugin.ctxmem.class_name": "CtxmemBackend",
                "ctxmem.endpoint": service.endpoint, "ctxmem.timeout_s": 10.0},
        })
        md = LMCacheMetadata(model_name="tiny-hybrid", world_size=1, local_world_size=1,
                             worker_id=0, local_worker_id=0, kv_dtype=torch.bfloat16,
                             kv_shape=(len(spec), 2, CHUNK, 2, 8), chunk_size=CHUNK)
        manager = groups_manager(spec)
        engine = LMCacheEngineBuilder.get_or_create(
            name, cfg, md, GroupedCPUConnector(manager), lambda t, r: None,
            lambda o, r: o)
        engine.post_init()
        md.kv_layer_groups_manager = manager  # as the vLLM connector does on registration
        return engine

    yield factory
    for name in names:
        LMCacheEngineBuilder.destroy(name)


def plugin(engine: Any) -> CtxmemBackend:
    backend = engine.storage_manager.storage_backends["ctxmem"]
    assert isinstance(backend, CtxmemBackend)
    return backend


def flush(engine: Any) -> None:
    plugin(engine)._pool.submit(lambda: None).result(timeout=60)


def kv_of(spec: list[tuple[int, int, Any, int]], tokens: int, seed: int) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, tokens, h, d, generator=g).to(dt) for h, d, dt, _ in spec]


def zeros_like(kv: list[Any]) -> list[Any]:
    return [torch.zeros_like(t) for t in kv]


def same(a: list[Any], b: list[Any], upto: int | None = None) -> bool:
    return all(torch.equal(x[:, :upto].contiguous().view(torch.uint8),
                           y[:, :upto].contiguous().view(torch.uint8))
               for x, y in zip(a, b, strict=True))


def group_namespaces(engine: Any, key: Any) -> list[Any]:
    return plugin(engine)._namespaces_of(key)


def test_two_groups_of_different_shapes_round_trip_byte_exact(make_engine: Any) -> None:
    tokens = torch.arange(100, 100 + 3 * CHUNK)
    kv = kv_of(MIXED, len(tokens), seed=1)
    writer = make_engine(MIXED)
    assert writer.metadata.get_num_groups() == 2
    writer.store(tokens, kvcaches=kv)
    flush(writer)

    key = next(k for *_, k in writer.token_database.process_tokens(tokens))
    g0, g1 = group_namespaces(writer, key)
    assert (g0.layout.num_layers, g0.layout.num_kv_heads, g0.layout.head_dim,
            g0.layout.dtype) == (2, 2, 8, "bfloat16")
    assert (g1.layout.num_layers, g1.layout.num_kv_heads, g1.layout.head_dim,
            g1.layout.dtype) == (1, 1, 4, "float16")
    assert g0.block_nbytes == 2 * 2 * CHUNK * 16 * 2 and g1.block_nbytes == 2 * CHUNK * 4 * 2
    assert (g0.tags["lmcache_kv_group"], g1.tags["lmcache_kv_group"]) == ("0/2", "1/2")

    # The groups' blocks were committed as one block group (ctxmem.group), once per run.
    assert plugin(writer)._namespaces_of(key)[0].client.stats()["group_commits"] >= 1

    reader = make_engine(MIXED)  # empty LMCache CPU tier: hits can only come from ctxmem
    assert reader.lookup(tokens) == 3 * CHUNK
    out = zeros_like(kv)
    assert int(reader.retrieve(tokens, kvcaches=out).sum()) == 3 * CHUNK
    assert same(out, kv)


def test_a_group_1_key_never_hits_group_0_bytes(make_engine: Any) -> None:
    tokens = torch.arange(7, 7 + 3 * CHUNK)
    kv = kv_of(TWIN, len(tokens), seed=2)
    writer = make_engine(TWIN)
    assert writer.metadata.get_num_groups() == 2
    writer.store(tokens, kvcaches=kv)
    flush(writer)

    keys = [k for *_, k in writer.token_database.process_tokens(tokens)]
    g0, g1 = group_namespaces(writer, keys[0])
    assert g0.layout == g1.layout, "same geometry: only the group tag separates them"
    assert g0.digest != g1.digest, "two namespaces in the service"
    # Each group's block holds that group's layers (0, 2 vs 1, 3), never the other's.
    names = [encode_chunk_key(k) for k in keys]
    for ns, layers in ((g0, (0, 2)), (g1, (1, 3))):
        blocks = [torch.zeros(ns.block_nbytes, dtype=torch.uint8) for _ in names]
        assert ns.get(names, [b.numpy() for b in blocks]) == 3
        for c, block in enumerate(blocks):
            want = torch.stack([kv[layer][:, c * CHUNK:(c + 1) * CHUNK].reshape(2, CHUNK, -1)
                                for layer in layers], dim=1)
            assert torch.equal(block, want.contiguous().view(torch.uint8).reshape(-1))

    # Drop group 1's copy of the 2nd chunk: group 0's bytes alone are not a hit.
    assert g1.delete(names[1:2]) == 1
    reader = make_engine(TWIN)
    assert reader.lookup(tokens) == CHUNK
    out = zeros_like(kv)
    assert int(reader.retrieve(tokens, kvcaches=out).sum()) == CHUNK
    assert same(out, kv, upto=CHUNK)
    assert not any(t[:, CHUNK:].any() for t in out)


def test_partial_chunk_of_two_groups_round_trips(make_engine: Any) -> None:
    tokens = torch.arange(2 * CHUNK + 5)
    kv = kv_of(MIXED, len(tokens), seed=3)
    writer = make_engine(MIXED, unfull=True)
    writer.store(tokens, kvcaches=kv)
    flush(writer)
    reader = make_engine(MIXED, unfull=True)
    assert reader.lookup(tokens) == len(tokens)
    out = zeros_like(kv)
    assert int(reader.retrieve(tokens, kvcaches=out).sum()) == len(tokens)
    assert same(out, kv)
