"""Move a transformer's per-layer KV cache into fixed-size ctxmem blocks and back.

This module is the engine-side glue for models that keep their KV cache as one
``[batch, kv_heads, tokens, head_dim]`` key tensor and one value tensor per layer
(Hugging Face ``transformers``' ``DynamicCache``, and any engine that can expose its
cache that way). It imports torch, so ``import ctxmem`` never imports it: engines
write ``from ctxmem import kvtransfer``.

Byte order of one block (what :class:`ctxmem.KVLayout` sizes exactly)::

    MHA/GQA:  [num_layers][2 (K, V)][num_kv_heads][tokens_per_block][head_dim]
    MLA:      [num_layers][tokens_per_block][kv_lora_rank + qk_rope_head_dim]

in the layout's dtype, native byte order, no padding. The geometry (:class:`KVGeometry`,
the dtype names, :func:`geometry_from_config`) lives in :mod:`ctxmem.kvgeometry` and is
re-exported here. Block ``i`` of a sequence holds
tokens ``[i * tokens_per_block, (i + 1) * tokens_per_block)``. Only full blocks are
stored, matching :func:`ctxmem.chain_hashes`, which keys full blocks only.

All blocks of one request are packed with a single gather copy into one contiguous
staging tensor ``[num_blocks, *block_shape]``; each block is then a contiguous view of
exactly ``block_nbytes`` bytes handed to the shim without another copy (invariant 5:
bytes move through C, never a Python loop over bytes). On a GPU the gather runs on
the device and the staging tensor is one pinned host buffer (one D2H / H2D copy).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ctxmem.kvgeometry import KVGeometry, dtype_name, geometry_from_config, kv_layout, torch_dtype

if TYPE_CHECKING:
    from ctxmem.costmodel import CostModel, Decision

__all__ = [
    "BlockSet",
    "KVGeometry",
    "LoadResult",
    "SaveResult",
    "build_cache",
    "cache_layers",
    "dtype_name",
    "empty_blocks",
    "geometry_from_config",
    "kv_layout",
    "load_kv",
    "pack_blocks",
    "pack_latent_blocks",
    "save_kv",
    "torch_dtype",
    "unpack_blocks",
    "unpack_latent_blocks",
]

KVPair = tuple[torch.Tensor, torch.Tensor]

# --------------------------------------------------------------------------- caches


def cache_layers(cache: Any) -> list[KVPair]:
    """Per-layer ``(keys, values)`` of a ``transformers`` cache or a legacy tuple cache.

    Accepts a ``DynamicCache`` (``cache.layers[i].keys`` / ``.values``, transformers
    >= 4.56) or a sequence of ``(keys, values)`` pairs. Tensors are returned as is
    (``[batch, kv_heads, tokens, head_dim]``), not copied.
    """
    layers = getattr(cache, "layers", None)
    if layers is not None:
        out: list[KVPair] = []
        for i, layer in enumerate(layers):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is None or values is None:
                raise ValueError(f"cache layer {i} holds no keys/values (not initialised)")
            out.append((keys, values))
        return out
    return [(pair[0], pair[1]) for pair in cache]


def build_cache(layers: Sequence[KVPair], config: Any | None = None) -> Any:
    """A ``transformers`` ``DynamicCache`` holding ``layers``.

    Plain full-attention layers take the tensors as they are (no copy); any other layer
    type (sliding window, ...) is filled through ``Cache.update``.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    for layer_idx, (keys, values) in enumerate(layers):
        layer = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
        if type(layer) is DynamicLayer and not layer.is_initialized:
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        else:
            cache.update(keys, values, layer_idx)
    return cache


# --------------------------------------------------------------------------- blocks


@dataclass
class BlockSet:
    """``num_blocks`` KV blocks in one contiguous host tensor ``[num_blocks, *block_shape]``.

    ``tensor[i]`` is block ``i``: contiguous, exactly ``block_nbytes`` bytes.
    """

    tensor: torch.Tensor
    geometry: KVGeometry

    @property
    def num_blocks(self) -> int:
        return int(self.tensor.shape[0])

    @property
    def block_nbytes(self) -> int:
        return self.geometry.block_nbytes

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    def buffers(self, start: int = 0, stop: int | None = None) -> list[np.ndarray]:
        """One writable uint8 numpy view per block (shares memory with ``tensor``)."""
        raw = self.tensor.view(torch.uint8).reshape(self.num_blocks, self.block_nbytes).numpy()
        stop = self.num_blocks if stop is None else stop
        return [raw[i] for i in range(start, stop)]

    def block(self, index: int) -> torch.Tensor:
        return self.tensor[index]


def _stage(shape: tuple[int, ...], dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
    pin = pin_memory and torch.cuda.is_available()
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)


def empty_blocks(num_blocks: int, geometry: KVGeometry, *, pin_memory: bool = False) -> BlockSet:
    """An uninitialised :class:`BlockSet` to receive ``num_blocks`` blocks from a get."""
    tensor = _stage((num_blocks, *geometry.block_shape), geometry.dtype, pin_memory)
    return BlockSet(tensor=tensor, geometry=geometry)


def _check_layers(layers: Sequence[KVPair], geometry: KVGeometry, batch_index: int) -> int:
    if len(layers) != geometry.num_layers:
        raise ValueError(f"cache has {len(layers)} layers, layout says {geometry.num_layers}")
    keys = layers[0][0]
    if keys.dim() != 4:
        raise ValueError(f"expected [batch, kv_heads, tokens, head_dim] tensors, got {keys.shape}")
    _, heads, tokens, head_dim = keys.shape
    if (heads, head_dim) != (geometry.num_kv_heads, geometry.head_dim):
        raise ValueError(
            f"cache has {heads} kv heads x {head_dim} dims, "
            f"layout says {geometry.num_kv_heads} x {geometry.head_dim}"
        )
    if not 0 <= batch_index < keys.shape[0]:
        raise IndexError(f"batch index {batch_index} out of range for batch {keys.shape[0]}")
    return int(tokens)


def pack_blocks(
    layers: Sequence[KVPair] | Any,
    geometry: KVGeometry,
    *,
    start_block: int = 0,
    num_blocks: int | None = None,
    batch_index: int = 0,
    pin_memory: bool = False,
) -> BlockSet:
    """Copy full blocks of one sequence's KV into a host :class:`BlockSet`.

    ``layers`` is a cache (see :func:`cache_layers`) or per-layer ``(keys, values)``.
    Blocks ``[start_block, start_block + num_blocks)`` are packed; ``num_blocks``
    defaults to every full block after ``start_block``. One gather on the cache's
    device, one copy to host. The KV dtype must equal the geometry's dtype.
    """
    if geometry.is_mla:
        raise ValueError("MLA geometry: use pack_latent_blocks")
    pairs = cache_layers(layers) if not isinstance(layers, (list, tuple)) else list(layers)
    tokens = _check_layers(pairs, geometry, batch_index)
    tpb = geometry.tokens_per_block
    full = tokens // tpb
    if num_blocks is None:
        num_blocks = max(0, full - start_block)
    if start_block < 0 or start_block + num_blocks > full:
        raise ValueError(f"blocks [{start_block}, {start_block + num_blocks}) beyond {full} full")
    if pairs[0][0].dtype != geometry.dtype:
        raise ValueError(f"cache dtype {pairs[0][0].dtype} != layout dtype {geometry.dtype}")
    lo, hi = start_block * tpb, (start_block + num_blocks) * tpb
    # [L, 2, H, n*T, D] -> [L, 2, H, n, T, D] -> [n, L, 2, H, T, D]
    stacked = torch.stack(
        [torch.stack((k[batch_index, :, lo:hi], v[batch_index, :, lo:hi])) for k, v in pairs]
    )
    L, _, H, _, D = stacked.shape
    gathered = stacked.view(L, 2, H, num_blocks, tpb, D).permute(3, 0, 1, 2, 4, 5)
    out = empty_blocks(num_blocks, geometry, pin_memory=pin_memory)
    out.tensor.copy_(gathered, non_blocking=False)
    return out


def unpack_blocks(
    blocks: BlockSet,
    num_blocks: int | None = None,
    *,
    device: str | torch.device | None = None,
) -> list[KVPair]:
    """Per-layer ``(keys, values)`` of shape ``[1, H, num_blocks * T, D]`` from blocks.

    Inverse of :func:`pack_blocks`: one host-to-device copy, one gather on the device.
    The returned tensors are contiguous views into one tensor holding all layers.
    """
    geometry = blocks.geometry
    if geometry.is_mla:
        raise ValueError("MLA geometry: use unpack_latent_blocks")
    n = blocks.num_blocks if num_blocks is None else num_blocks
    src = blocks.tensor[:n]
    if device is not None and torch.device(device).type != "cpu":
        src = src.to(device, non_blocking=True)
    L, H = geometry.num_layers, geometry.num_kv_heads
    T, D = geometry.tokens_per_block, geometry.head_dim
    # [n, L, 2, H, T, D] -> [L, 2, H, n, T, D] -> [L, 2, 1, H, n*T, D]
    kv = src.permute(1, 2, 3, 0, 4, 5).contiguous().view(L, 2, 1, H, n * T, D)
    return [(kv[layer, 0], kv[layer, 1]) for layer in range(L)]


def pack_latent_blocks(
    latents: Sequence[torch.Tensor],
    geometry: KVGeometry,
    *,
    start_block: int = 0,
    num_blocks: int | None = None,
    batch_index: int = 0,
    pin_memory: bool = False,
) -> BlockSet:
    """MLA: pack per-layer latent caches ``[batch, tokens, kv_lora_rank + rope_dim]``."""
    if not geometry.is_mla:
        raise ValueError("not an MLA geometry: use pack_blocks")
    if len(latents) != geometry.num_layers:
        raise ValueError(f"{len(latents)} layers, layout says {geometry.num_layers}")
    latent_dim = geometry.block_shape[-1]
    if latents[0].dim() != 3 or latents[0].shape[-1] != latent_dim:
        raise ValueError(f"expected [batch, tokens, {latent_dim}], got {latents[0].shape}")
    tpb = geometry.tokens_per_block
    full = int(latents[0].shape[1]) // tpb
    if num_blocks is None:
        num_blocks = max(0, full - start_block)
    if start_block < 0 or start_block + num_blocks > full:
        raise ValueError(f"blocks [{start_block}, {start_block + num_blocks}) beyond {full} full")
    lo, hi = start_block * tpb, (start_block + num_blocks) * tpb
    stacked = torch.stack([x[batch_index, lo:hi] for x in latents])  # [L, n*T, C]
    gathered = stacked.view(geometry.num_layers, num_blocks, tpb, latent_dim).permute(1, 0, 2, 3)
    out = empty_blocks(num_blocks, geometry, pin_memory=pin_memory)
    out.tensor.copy_(gathered)
    return out


def unpack_latent_blocks(
    blocks: BlockSet, num_blocks: int | None = None, *, device: str | torch.device | None = None
) -> list[torch.Tensor]:
    """MLA: per-layer latents ``[1, num_blocks * T, C]`` (inverse of pack_latent_blocks)."""
    geometry = blocks.geometry
    if not geometry.is_mla:
        raise ValueError("not an MLA geometry: use unpack_blocks")
    n = blocks.num_blocks if num_blocks is None else num_blocks
    src = blocks.tensor[:n]
    if device is not None and torch.device(device).type != "cpu":
        src = src.to(device, non_blocking=True)
    L, T, C = geometry.block_shape
    flat = src.permute(1, 0, 2, 3).contiguous().view(L, 1, n * T, C)
    return [flat[layer] for layer in range(L)]


# --------------------------------------------------------------------------- service


def _token_list(token_ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        return [int(t) for t in token_ids.reshape(-1).tolist()]
    return [int(t) for t in token_ids]


@dataclass
class SaveResult:
    """What :func:`save_kv` stored."""

    num_blocks: int  # full blocks the cache covers
    already_stored: int  # leading blocks Lookup found, not sent again
    stored: int
    existing: int
    nbytes: int
    seconds: float


@dataclass
class LoadResult:
    """What :func:`load_kv` loaded: ``num_tokens`` leading tokens, as a cache."""

    num_tokens: int
    num_blocks: int
    cache: Any | None  # DynamicCache (or per-layer pairs with as_cache=False); None: nothing
    tiers: list[str] = field(default_factory=list)
    nbytes: int = 0
    lookup_s: float = 0.0
    get_s: float = 0.0
    unpack_s: float = 0.0
    decision: Decision | None = None

    @property
    def seconds(self) -> float:
        return self.lookup_s + self.get_s + self.unpack_s


def save_kv(
    ns: Any,
    token_ids: Sequence[int] | torch.Tensor,
    cache: Any,
    geometry: KVGeometry,
    *,
    salt: bytes = b"",
    skip_stored: bool = True,
    batch_index: int = 0,
) -> SaveResult:
    """Store every full block of ``cache`` (the KV of ``token_ids``) in namespace ``ns``.

    Keys are ``ctxmem.chain_hashes(token_ids, tokens_per_block, salt=salt)``. With
    ``skip_stored`` one Lookup finds the leading blocks already stored and only the rest
    is packed and sent; the put is one batched call.
    """
    import ctxmem

    t0 = time.perf_counter()
    tokens = _token_list(token_ids)
    pairs = cache_layers(cache) if not isinstance(cache, (list, tuple)) else list(cache)
    cached_tokens = int(pairs[0][0].shape[2]) if pairs else 0
    usable = min(len(tokens), cached_tokens)
    keys = list(ctxmem.chain_hashes(tokens[:usable], geometry.tokens_per_block, salt=salt))
    start = ns.lookup(keys).num_hits if (skip_stored and keys) else 0
    stored = existing = nbytes = 0
    if start < len(keys):
        blocks = pack_blocks(
            pairs,
            geometry,
            start_block=start,
            num_blocks=len(keys) - start,
            batch_index=batch_index,
        )
        res = ns.put(keys[start:], blocks.buffers())
        stored, existing, nbytes = int(res.stored), int(res.existing), blocks.nbytes
    return SaveResult(
        num_blocks=len(keys),
        already_stored=start,
        stored=stored,
        existing=existing,
        nbytes=nbytes,
        seconds=time.perf_counter() - t0,
    )


def load_kv(
    ns: Any,
    token_ids: Sequence[int] | torch.Tensor,
    geometry: KVGeometry,
    *,
    salt: bytes = b"",
    max_tokens: int | None = None,
    device: str | torch.device | None = None,
    config: Any | None = None,
    cost_model: CostModel | None = None,
    as_cache: bool = True,
    pin_memory: bool = False,
) -> LoadResult:
    """Load the longest stored prefix of ``token_ids`` from ``ns`` as a KV cache.

    At most ``max_tokens`` tokens are loaded (default ``len(token_ids) - 1``: the engine
    must compute at least one token to get next-token logits). Tokens after the
    returned ``num_tokens`` must be computed by the engine. With a ``cost_model``, the
    hit is declined (``num_tokens == 0``, ``decision.load`` False) when recomputing is
    estimated to be faster, and the measured transfer is fed back into the model.
    A block that the service reports missing or corrupt ends the loaded run there.
    """
    import ctxmem

    tokens = _token_list(token_ids)
    limit = len(tokens) - 1 if max_tokens is None else min(max_tokens, len(tokens))
    tpb = geometry.tokens_per_block
    usable_blocks = max(0, limit) // tpb
    keys = list(ctxmem.chain_hashes(tokens[: usable_blocks * tpb], tpb, salt=salt))
    t0 = time.perf_counter()
    hit = ns.lookup(keys) if keys else None
    lookup_s = time.perf_counter() - t0
    hits = int(hit.num_hits) if hit is not None else 0
    tiers = [str(t) for t in hit.tiers][:hits] if hit is not None else []
    if hits == 0:
        return LoadResult(0, 0, None, tiers, lookup_s=lookup_s)
    decision = None
    nbytes = hits * geometry.block_nbytes
    if cost_model is not None:
        decision = cost_model.decide(hits * tpb, nbytes, tiers)
        if not decision.load:
            return LoadResult(0, 0, None, tiers, lookup_s=lookup_s, decision=decision)
    blocks = empty_blocks(hits, geometry, pin_memory=pin_memory)
    t1 = time.perf_counter()
    got = int(ns.get(keys[:hits], blocks.buffers()))
    get_s = time.perf_counter() - t1
    if cost_model is not None and got > 0:
        cost_model.observe_transfer(tiers[:got], got * geometry.block_nbytes, get_s)
    if got == 0:
        return LoadResult(0, 0, None, tiers, lookup_s=lookup_s, get_s=get_s, decision=decision)
    t2 = time.perf_counter()
    pairs = unpack_blocks(blocks, got, device=device)
    cache = build_cache(pairs, config) if as_cache else pairs
    unpack_s = time.perf_counter() - t2
    return LoadResult(
        num_tokens=got * tpb,
        num_blocks=got,
        cache=cache,
        tiers=tiers[:got],
        nbytes=got * geometry.block_nbytes,
        lookup_s=lookup_s,
        get_s=get_s,
        unpack_s=unpack_s,
        decision=decision,
    )
