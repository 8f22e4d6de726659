"""The SGLang HiCache backend, built by SGLang's own ``StorageBackendFactory``.

Real here (where ``sglang`` imports): ``HiCacheStorage``, ``HiCacheStorageConfig`` and
``StorageBackendFactory.create_backend("dynamic", ...)`` with ``backend_name`` /
``module_path`` / ``class_name`` in ``extra_config`` -- the same call SGLang's
``HiCacheController.attach_storage_backend`` makes -- and a real ctxmem service. The host
memory pool is a stand-in with the page API the backend uses (``get_data_page``,
``set_from_flat_data_page``, ``get_dummy_flat_data_page``), in SGLang's ``page_first``
and ``layer_first`` layouts, because SGLang's ``MHATokenToKVPoolHost`` cannot be imported
without its CUDA stack (its configs import torchvision, whose PyPI build needs CUDA torch).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="SGLang is not installed here: `pip install sglang==0.5.23` brings torch==2.14.1 "
    "(a CUDA build) and CUDA-only packages, an 11 GB venv; test_sglang_real.py runs this "
    "file in the small CPU side venv (deploy/ci/engine-venv.sh sglang-cpu, docs/engines.md)",
)
torch = pytest.importorskip("torch")

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorage,
    HiCacheStorageConfig,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

import ctxmem  # noqa: E402
from ctxmem.integrations.sglang import CtxmemHiCacheStorage, page_key  # noqa: E402

PAGE, LAYERS, HEADS, HEAD, SLOTS = 16, 3, 2, 8, 8 * 16


class HostPool:
    """SGLang-like MHA host pool: ``kv_buffer`` [2, tokens, L, H, D] (page_first) or
    [2, L, tokens, H, D] (layer_first); the same page methods as SGLang's."""

    def __init__(self, layout: str = "page_first", dtype: Any = torch.bfloat16) -> None:
        self.layout, self.dtype, self.page_size = layout, dtype, PAGE
        self.layer_num, self.head_num, self.head_dim = LAYERS, HEADS, HEAD
        shape = (2, SLOTS, LAYERS, HEADS, HEAD) if layout == "page_first" else \
            (2, LAYERS, SLOTS, HEADS, HEAD)
        self.kv_buffer = torch.zeros(shape, dtype=dtype)

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        if self.layout == "page_first":
            page = self.kv_buffer[:, index : index + PAGE]
        else:
            page = self.kv_buffer[:, :, index : index + PAGE]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> Any:
        return torch.zeros(2 * LAYERS * PAGE * HEADS * HEAD, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        if self.layout == "page_first":
            self.kv_buffer[:, index : index + PAGE] = data_page.reshape(2, PAGE, LAYERS,
                                                                         HEADS, HEAD)
        else:
            self.kv_buffer[:, :, index : index + PAGE] = data_page.reshape(2, LAYERS, PAGE,
                                                                            HEADS, HEAD)


def _config(endpoint: str, *, tp_rank: int = 0, tp_size: int = 1, v1: bool = True,
            model: str = "tiny-llama", weights_revision: str = "") -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=True, model_name=model,
        extra_config={"backend_name": "ctxmem", "module_path": "ctxmem.integrations.sglang",
                      "class_name": "CtxmemHiCacheStorage", "interface_v1": int(v1),
                      "ctxmem.endpoint": endpoint, "ctxmem.timeout_s": 5,
                      "ctxmem.weights_revision": weights_revision})


def _backend(endpoint: str, pool: HostPool, **kw: Any) -> HiCacheStorage:
    backend = StorageBackendFactory.create_backend("dynamic", _config(endpoint, **kw), pool)
    backend.register_mem_pool_host(pool)  # what HiCacheController does next
    return backend


def _hashes(n: int, seed: str = "") -> list[str]:
    import hashlib

    out, prev = [], seed.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        out.append(prev.hex())
    return out


def _indices(pages: list[int]) -> Any:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_factory_builds_it_and_v1_round_trip_is_exact(service: Any, layout: str) -> None:
    src = HostPool(layout)
    src.kv_buffer.copy_(torch.randn(src.kv_buffer.shape).to(src.dtype))
    writer = _backend(service.endpoint, src)
    inner = getattr(writer, "_backend", writer)
    assert isinstance(inner, CtxmemHiCacheStorage)
    keys = _hashes(4)
    assert writer.batch_exists(keys) == 0
    assert all(writer.batch_set_v1(keys, _indices([0, 1, 2, 3])))
    assert writer.batch_exists(keys) == 4
    assert writer.batch_exists([*keys[:2], _hashes(1, "other")[0], keys[3]]) == 2

    dst = HostPool(layout)
    reader = _backend(service.endpoint, dst)
    got = reader.batch_get_v1([*keys, *_hashes(1, "missing")], _indices([4, 5, 6, 7, 0]))
    assert got == [True, True, True, True, False]
    for s, d in zip([0, 1, 2, 3], [4, 5, 6, 7], strict=True):
        assert torch.equal(src.get_data_page(s * PAGE), dst.get_data_page(d * PAGE))
    assert not dst.get_data_page(0).any()


def test_generic_interface_round_trip(service: Any) -> None:
    pool = HostPool()
    backend = _backend(service.endpoint, pool, v1=False)
    pages = [torch.randn(pool.get_dummy_flat_data_page().shape).to(pool.dtype)
             for _ in range(3)]
    keys = _hashes(3, "generic")
    assert backend.batch_set(keys, pages)
    assert backend.exists(keys[1]) and not backend.exists(_hashes(1, "nope")[0])
    out = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    assert all(torch.equal(a, b) for a, b in zip(out, pages, strict=True))
    single = backend.get(keys[2], pool.get_dummy_flat_data_page())
    assert single is not None and torch.equal(single, pages[2])
    assert backend.get(_hashes(1, "nope")[0], pool.get_dummy_flat_data_page()) is None


def test_tp_rank_and_model_separate_namespaces(service: Any) -> None:
    pool = HostPool()
    pool.kv_buffer.normal_()
    keys = _hashes(2, "tp")
    assert all(_backend(service.endpoint, pool, tp_rank=0, tp_size=2)
               .batch_set_v1(keys, _indices([0, 1])))
    assert _backend(service.endpoint, HostPool(), tp_rank=0, tp_size=2).batch_exists(keys) == 2
    assert _backend(service.endpoint, HostPool(), tp_rank=1, tp_size=2).batch_exists(keys) == 0
    assert _backend(service.endpoint, HostPool(), tp_rank=0, tp_size=1).batch_exists(keys) == 0
    assert _backend(service.endpoint, HostPool(), tp_rank=0, tp_size=2,
                    model="other-model").batch_exists(keys) == 0
    # Issue 25, item 6: the weights' revision is part of the namespace too.
    assert _backend(service.endpoint, HostPool(), tp_rank=0, tp_size=2,
                    weights_revision="ckpt-2").batch_exists(keys) == 0


def test_survives_service_restart_and_degrades_when_down(service: Any) -> None:
    pool = HostPool()
    pool.kv_buffer.normal_()
    backend = _backend(service.endpoint, pool)
    keys = _hashes(2, "restart")
    assert all(backend.batch_set_v1(keys, _indices([0, 1])))
    service.restart()
    dst = HostPool()
    assert _backend(service.endpoint, dst).batch_get_v1(keys, _indices([2, 3])) == [True, True]
    assert torch.equal(dst.get_data_page(2 * PAGE), pool.get_data_page(0))
    service.kill()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, _indices([2, 3])) == [False, False]
    assert backend.batch_set_v1(keys, _indices([0, 1])) == [False, False]


def test_page_keys() -> None:
    h = _hashes(1)[0]
    assert page_key(h) == bytes.fromhex(h)
    assert len(page_key(h + ".mamba")) <= 64 and page_key(h + ".mamba") != page_key(h)
    assert ctxmem.KVLayout  # the shim is importable alongside SGLang


# -- v2: hybrid models' extra pools -------------------------------------------------------

class StatePool:
    """A sidecar pool like SGLang's Mamba/SWA state pools: one opaque float32 state per
    page slot (``page_size`` indices per page, as the v2 transfers give them)."""

    def __init__(self, width: int = 24) -> None:
        self.dtype, self.page_size, self.layer_num, self.width = torch.float32, PAGE, 1, width
        self.buf = torch.zeros((SLOTS, width), dtype=self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        return self.buf[index // PAGE * PAGE]

    def get_dummy_flat_data_page(self) -> Any:
        return torch.zeros(self.width, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        self.buf[index // PAGE * PAGE] = data_page.reshape(self.width)


def _v2_backend(endpoint: str) -> tuple[Any, HostPool, StatePool]:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    kv, state = HostPool(), StatePool()
    backend = _backend(endpoint, kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)  # as HybridCacheController does
    backend.register_mem_host_pool_v2(state, PoolName.MAMBA)
    backend.on_host_pools_registered()
    return backend, kv, state


def test_v2_hybrid_pools_round_trip_and_hit_policies(service: Any) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    a, kv, state = _v2_backend(service.endpoint)
    kv.kv_buffer.copy_(torch.randn(kv.kv_buffer.shape).to(kv.dtype))
    state.buf.copy_(torch.randn(state.buf.shape))
    keys = _hashes(4, "hybrid")
    # KV for 4 pages; the Mamba state only where a node ended (pages 1 and 3).
    res = a.batch_set_v2([
        PoolTransfer(name=PoolName.KV, host_indices=_indices([0, 1, 2, 3]), keys=keys),
        PoolTransfer(name=PoolName.MAMBA, host_indices=_indices([1, 3]),
                     keys=[keys[1], keys[3]])])
    assert res == {"kv": [True] * 4, "mamba": [True, True]}

    b, kv2, state2 = _v2_backend(service.endpoint)
    trailing = b.batch_exists_v2(keys, [PoolTransfer(
        name=PoolName.MAMBA, keys=[keys[-1]], hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert (trailing.kv_hit_pages, trailing.restorable_prefix_pages) == (4, [2, 4])
    assert trailing.extra_pool_hit_pages == {"kv": 4, "mamba": 4}
    every = b.batch_exists_v2(keys, [PoolTransfer(
        name=PoolName.MAMBA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)])
    assert every.kv_hit_pages == 0, "page 0 has no state: no prefix is restorable"
    got = b.batch_get_v2([
        PoolTransfer(name=PoolName.KV, host_indices=_indices([4, 5, 6, 7]), keys=keys),
        PoolTransfer(name=PoolName.MAMBA, host_indices=_indices([7]), keys=[keys[3]])])
    assert got == {"kv": [True] * 4, "mamba": [True]}
    for s, d in zip([0, 1, 2, 3], [4, 5, 6, 7], strict=True):
        assert torch.equal(kv.get_data_page(s * PAGE).view(torch.int16),
                           kv2.get_data_page(d * PAGE).view(torch.int16))
    assert torch.equal(state.get_data_page(3 * PAGE), state2.get_data_page(7 * PAGE))
    # The KV pages are the v1 pages: a v1 reader sees them too.
    assert b.batch_exists(keys) == 4
    # A pool nobody registered fails its transfer, never the others.
    bad = b.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=_indices([0]),
                                       keys=[keys[0]])])
    assert bad == {"swa": [False]}


def test_v2_pools_moved_page_for_page_are_one_block_group(service: Any) -> None:
    """Transfers of the same pages in the KV and a state pool (an ALL_PAGES pool) are
    committed as one block group, and load only whole: a page whose state block is gone
    is a miss in both pools, from there on."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    a, kv, state = _v2_backend(service.endpoint)
    kv.kv_buffer.copy_(torch.randn(kv.kv_buffer.shape).to(kv.dtype))
    state.buf.copy_(torch.randn(state.buf.shape))
    keys = _hashes(4, "grouped")
    res = a.batch_set_v2([
        PoolTransfer(name=PoolName.KV, host_indices=_indices([0, 1, 2, 3]), keys=keys),
        PoolTransfer(name=PoolName.MAMBA, host_indices=_indices([0, 1, 2, 3]), keys=keys)])
    assert res == {"kv": [True] * 4, "mamba": [True] * 4}
    state_ns = a.pools["mamba"][1]
    assert state_ns.client.stats()["group_commits"] >= 1
    assert state_ns.delete([page_key(keys[2])]) == 1  # one member of page 2 gone
    b, kv2, state2 = _v2_backend(service.endpoint)
    got = b.batch_get_v2([
        PoolTransfer(name=PoolName.KV, host_indices=_indices([4, 5, 6, 7]), keys=keys),
        PoolTransfer(name=PoolName.MAMBA, host_indices=_indices([4, 5, 6, 7]), keys=keys)])
    assert got == {"kv": [True, True, False, False], "mamba": [True, True, False, False]}
    for s, d in ((0, 4), (1, 5)):
        assert torch.equal(kv.get_data_page(s * PAGE).view(torch.int16),
                           kv2.get_data_page(d * PAGE).view(torch.int16))
        assert torch.equal(state.get_data_page(s * PAGE), state2.get_data_page(d * PAGE))
    assert not kv2.get_data_page(6 * PAGE).view(torch.int16).any(), "a partial group loaded"


# -- the copy-paste commands of docs/deploy.md and docs/engines.md ----------------------
def documented_sglang_commands() -> list[tuple[str, list[str]]]:
    """(where, words) of every fenced shell block of the two docs that starts SGLang,
    split as the shell splits it (continuation lines, quotes)."""
    import re
    import shlex
    from pathlib import Path

    out = []
    for doc in ("deploy.md", "engines.md"):
        text = (Path(__file__).resolve().parents[2] / "docs" / doc).read_text()
        for block in re.findall(r"^```(?:bash|sh)\n(.*?)^```", text, flags=re.S | re.M):
            if "sglang" in block:
                out.append((f"docs/{doc}", shlex.split(block.replace("\\\n", " "),
                                                       comments=True)))
    return out


def test_documented_sglang_commands(service: Any) -> None:
    """Each documented SGLang command through SGLang's own server argument parser
    (``ServerArgs.add_cli_args``, what ``sglang.launch_server`` parses with); its
    ``--hicache-storage-backend-extra-config`` JSON (parsed with ``json.loads``, as SGLang
    does for an inline value), endpoint pointed at the test's service, builds
    ``CtxmemHiCacheStorage`` through ``StorageBackendFactory`` and round-trips a page."""
    import argparse
    import json

    from sglang.srt.server_args import ServerArgs

    commands = documented_sglang_commands()
    assert len(commands) >= 2, f"the docs lost their SGLang commands ({commands})"
    for where, words in commands:
        assert words[:3] == ["python", "-m", "sglang.launch_server"], (where, words[:3])
        parser = argparse.ArgumentParser(prog="sglang serve", exit_on_error=False)
        ServerArgs.add_cli_args(parser)
        args = parser.parse_args(words[3:])
        assert args.model_path == "MODEL" and args.enable_hierarchical_cache, where
        assert args.hicache_storage_backend == "dynamic", where
        extra = json.loads(args.hicache_storage_backend_extra_config)
        extra["ctxmem.endpoint"] = service.endpoint
        cfg = _config(service.endpoint)
        cfg.extra_config = extra
        assert cfg.is_page_first_layout == (args.hicache_mem_layout == "page_first"), where
        pool = HostPool(args.hicache_mem_layout)
        pool.kv_buffer.normal_()
        backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
        backend.register_mem_pool_host(pool)
        assert isinstance(getattr(backend, "_backend", backend), CtxmemHiCacheStorage), where
        keys = _hashes(1, where)
        assert backend.batch_set_v1(keys, _indices([0])) == [True], where
        assert backend.batch_get_v1(keys, _indices([1])) == [True], where
        assert torch.equal(pool.get_data_page(0), pool.get_data_page(PAGE)), where
