"""kvtransfer: slicing a transformer's per-layer KV into ctxmem blocks and back.

No service here: these check the byte layout and the round trips on their own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ctxmem  # noqa: E402
from ctxmem import kvtransfer as kt  # noqa: E402
from ctxmem_tools.models import prefill  # noqa: E402


def _geometry(dtype: Any = torch.float32, tpb: int = 16) -> kt.KVGeometry:
    return kt.KVGeometry(
        num_layers=3, num_kv_heads=2, head_dim=8, tokens_per_block=tpb, dtype=dtype
    )


def _random_kv(geometry: kt.KVGeometry, tokens: int, batch: int = 1, seed: int = 0) -> list[Any]:
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, geometry.num_kv_heads, tokens, geometry.head_dim)
    return [
        (
            torch.randn(shape, generator=gen).to(geometry.dtype),
            torch.randn(shape, generator=gen).to(geometry.dtype),
        )
        for _ in range(geometry.num_layers)
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_block_nbytes_matches_layout(dtype: str) -> None:
    g = _geometry(kt.torch_dtype(dtype))
    layout = g.layout()
    assert isinstance(layout, ctxmem.KVLayout)
    assert layout.block_nbytes == g.block_nbytes
    assert layout.dtype == dtype


def test_block_byte_order_is_documented_layout() -> None:
    """Block i = for each layer: K then V, each [heads][tokens of block i][head_dim]."""
    g = _geometry()
    kv = _random_kv(g, tokens=3 * g.tokens_per_block + 5)  # 3 full blocks + a partial one
    blocks = kt.pack_blocks(kv, g)
    assert blocks.num_blocks == 3  # the partial block is not stored
    bufs = blocks.buffers()
    tpb = g.tokens_per_block
    for i, buf in enumerate(bufs):
        assert buf.dtype == np.uint8 and buf.nbytes == g.block_nbytes
        expected = b"".join(
            t[0, :, i * tpb : (i + 1) * tpb, :].contiguous().numpy().tobytes()
            for k, v in kv
            for t in (k, v)
        )
        assert buf.tobytes() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_unpack_round_trip(dtype: Any) -> None:
    g = _geometry(dtype)
    kv = _random_kv(g, tokens=5 * g.tokens_per_block)
    blocks = kt.pack_blocks(kv, g)
    # through raw bytes, as the service would hand them back
    back = kt.empty_blocks(blocks.num_blocks, g)
    for src, dst in zip(blocks.buffers(), back.buffers(), strict=True):
        dst[:] = src
    pairs = kt.unpack_blocks(back)
    for (k, v), (k2, v2) in zip(kv, pairs, strict=True):
        assert k2.shape == k.shape and k2.dtype == dtype
        assert torch.equal(k, k2) and torch.equal(v, v2)
    # fewer blocks than allocated (a get that returned a shorter run)
    pairs = kt.unpack_blocks(back, 2)
    assert pairs[0][0].shape[2] == 2 * g.tokens_per_block
    assert torch.equal(pairs[1][1], kv[1][1][:, :, : 2 * g.tokens_per_block])


def test_pack_a_range_of_blocks_and_batch_index() -> None:
    g = _geometry()
    kv = _random_kv(g, tokens=4 * g.tokens_per_block, batch=2)
    tail = kt.pack_blocks(kv, g, start_block=1, num_blocks=2, batch_index=1)
    whole = kt.pack_blocks(kv, g, batch_index=1)
    assert torch.equal(tail.tensor, whole.tensor[1:3])
    with pytest.raises(ValueError, match="beyond"):
        kt.pack_blocks(kv, g, start_block=3, num_blocks=2)
    with pytest.raises(IndexError):
        kt.pack_blocks(kv, g, batch_index=2)


def test_buffers_share_memory_with_the_staging_tensor() -> None:
    g = _geometry()
    blocks = kt.empty_blocks(2, g)
    blocks.tensor.zero_()
    blocks.buffers()[1][:] = 0xFF
    assert torch.all(blocks.tensor[0] == 0)
    assert torch.isnan(blocks.tensor[1]).all()  # 0xFFFFFFFF is a NaN pattern


def test_rejects_mismatched_cache() -> None:
    g = _geometry()
    kv = _random_kv(g, tokens=32)
    with pytest.raises(ValueError, match="dtype"):
        kt.pack_blocks([(k.half(), v.half()) for k, v in kv], g)
    with pytest.raises(ValueError, match="layers"):
        kt.pack_blocks(kv[:2], g)
    with pytest.raises(ValueError, match="kv heads"):
        kt.pack_blocks(kv, kt.KVGeometry(3, 4, 8, 16, torch.float32))


def test_mla_latent_round_trip() -> None:
    g = kt.KVGeometry(
        num_layers=2,
        num_kv_heads=1,
        head_dim=0,
        tokens_per_block=8,
        dtype=torch.bfloat16,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
    )
    layout = g.layout()
    assert layout.is_mla and layout.block_nbytes == g.block_nbytes == 2 * 8 * 20 * 2
    gen = torch.Generator().manual_seed(3)
    latents = [torch.randn(1, 29, 20, generator=gen).bfloat16() for _ in range(2)]
    blocks = kt.pack_latent_blocks(latents, g)
    assert blocks.num_blocks == 3
    back = kt.unpack_latent_blocks(blocks)
    for a, b in zip(latents, back, strict=True):
        assert torch.equal(a[:, :24], b)


def test_transformers_cache_round_trip(tiny_model: Any) -> None:
    """A real DynamicCache: geometry from the config, blocks, and a rebuilt cache."""
    g = kt.geometry_from_config(tiny_model.config, tokens_per_block=16)
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.dtype) == (4, 2, 32, torch.float32)
    ids = torch.randint(0, 1000, (1, 70), generator=torch.Generator().manual_seed(0))
    _, cache = prefill(tiny_model, ids)
    layers = kt.cache_layers(cache)
    assert layers[0][0].shape == (1, 2, 70, 32)
    blocks = kt.pack_blocks(cache, g)
    assert blocks.num_blocks == 4
    rebuilt = kt.build_cache(kt.unpack_blocks(blocks), tiny_model.config)
    assert rebuilt.get_seq_length() == 64
    for (k, v), (k2, v2) in zip(layers, kt.cache_layers(rebuilt), strict=True):
        assert torch.equal(k[:, :, :64], k2) and torch.equal(v[:, :, :64], v2)
    layout = kt.kv_layout(tiny_model.config, tokens_per_block=16)
    assert layout.block_nbytes == g.block_nbytes == 2 * 4 * 16 * 2 * 32 * 4
