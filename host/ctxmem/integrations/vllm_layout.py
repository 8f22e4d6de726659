"""vLLM paged KV caches <-> ctxmem blocks (needs torch, not vLLM).

One ctxmem block holds one vLLM block (``block_size`` tokens) of one TP rank for every
layer, in this byte order (``L`` layers of the namespace, in registration order):

* ``"bhnc"`` -- vLLM >= 0.30's standardized per-layer view ``[B, H, N, C]`` (RFC 42082;
  MLA is ``H == 1`` with the latent as ``C``). Whatever the backend packs inside a page
  is kept byte for byte: block = ``[L, H, N, C]``.
* ``"flash_attn"`` -- older vLLM FlashAttention/Triton: ``[2, B, N, H, D]`` per layer.
* ``"flashinfer"`` -- older vLLM FlashInfer: ``[B, 2, N, H, D]`` (``NHD``) or
  ``[B, 2, H, N, D]`` (``HND``).
* ``"mla"`` -- older vLLM MLA: ``[B, N, C]`` (latent + rope per token).

The three legacy formats are brought to one canonical order, ``[L, 2, N, H, D]`` (MLA:
``[L, N, C]``), so FlashAttention and FlashInfer workers of the same model and TP rank
share blocks. ``bhnc`` blocks are tagged with their format and attention backend so
they are never read by a worker that packs pages differently.

Gathers and scatters are torch indexing ops (one copy each way, done on the cache's
device; the CPU side is one contiguous staging tensor), never Python loops over bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ctxmem.integrations._common import torch_dtype_name
from ctxmem_common.errors import InvalidArgument
from ctxmem_common.layout import KVLayout

FORMATS = ("bhnc", "flash_attn", "flashinfer", "mla")


@dataclass(frozen=True)
class PagedFormat:
    """How one layer's paged cache tensor is laid out."""

    kind: str
    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    """``D`` for K/V formats; ``C`` (content per head slot) for ``bhnc`` and ``mla``."""
    dtype: torch.dtype
    hnd: bool = False
    """FlashInfer only: heads before tokens."""

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one layer's slice of one block, in ctxmem byte order."""
        if self.kind == "bhnc":
            return (self.num_heads, self.block_size, self.head_dim)
        if self.kind == "mla":
            return (self.block_size, self.head_dim)
        return (2, self.block_size, self.num_heads, self.head_dim)

    @property
    def layer_block_nbytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * self.dtype.itemsize


def detect_format(tensor: torch.Tensor, *, hint: str | None = None,
                  kv_layout: str = "NHD", num_kv_heads: int | None = None) -> PagedFormat:
    """Recognise a layer's paged cache from its shape (``hint`` settles ambiguity:
    one of :data:`FORMATS`; ``kv_layout`` is vLLM's ``NHD``/``HND`` for FlashInfer)."""
    shape = tuple(tensor.shape)
    kind = hint
    if kind is None:
        if len(shape) == 4:
            kind = "bhnc"
        elif len(shape) == 3:
            kind = "mla"
        elif len(shape) == 5 and shape[0] == 2 and shape[1] != 2:
            kind = "flash_attn"
        elif len(shape) == 5 and shape[1] == 2:
            kind = "flashinfer"
        else:
            raise InvalidArgument(f"unrecognised vLLM KV cache shape {shape}; set "
                                  f"kv_connector_extra_config ctxmem.kv_format to one of "
                                  f"{FORMATS}")
    if kind not in FORMATS:
        raise InvalidArgument(f"ctxmem.kv_format {kind!r} is not one of {FORMATS}")
    expect = {"bhnc": 4, "mla": 3, "flash_attn": 5, "flashinfer": 5}[kind]
    if len(shape) != expect:
        raise InvalidArgument(f"KV cache shape {shape} is not a {kind} cache "
                              f"({expect} dims expected)")
    if kind == "bhnc":
        b, h, n, c = shape
        return PagedFormat(kind, b, n, h, c, tensor.dtype)
    if kind == "mla":
        b, n, c = shape
        return PagedFormat(kind, b, n, 1, c, tensor.dtype)
    if kind == "flash_attn":
        _, b, n, h, d = shape
        return PagedFormat(kind, b, n, h, d, tensor.dtype)
    hnd = kv_layout.upper() == "HND"
    b, _, x, y, d = shape
    n, h = (y, x) if hnd else (x, y)
    if num_kv_heads is not None and h != num_kv_heads and n == num_kv_heads:
        n, h, hnd = h, n, not hnd
    return PagedFormat(kind, b, n, h, d, tensor.dtype, hnd=hnd)


def ctxmem_layout(fmt: PagedFormat, num_layers: int, *, tp_rank: int = 0, tp_size: int = 1,
                  mla_rope_dim: int | None = None, dtype_name: str | None = None) -> KVLayout:
    """The ctxmem layout whose ``block_nbytes`` is exactly ``num_layers`` layer slices."""
    dtype = dtype_name or torch_dtype_name(fmt.dtype)
    common: dict[str, Any] = {"dtype": dtype, "num_layers": num_layers,
                              "tokens_per_block": fmt.block_size, "tp_rank": tp_rank,
                              "tp_size": tp_size}
    latent = fmt.kind == "bhnc" and fmt.num_heads == 1 and mla_rope_dim is not None
    if fmt.kind == "mla" or latent:
        rope = mla_rope_dim or 0
        if not 0 <= rope < fmt.head_dim:
            rope = 0
        return KVLayout(kv_lora_rank=fmt.head_dim - rope, qk_rope_head_dim=rope, **common)
    if fmt.kind == "bhnc":
        if fmt.head_dim % 2 == 0:
            return KVLayout(num_kv_heads=fmt.num_heads, head_dim=fmt.head_dim // 2, **common)
        # An odd packed page width: describe the page as one latent of H * C per token.
        return KVLayout(kv_lora_rank=fmt.num_heads * fmt.head_dim, qk_rope_head_dim=0,
                        **common)
    return KVLayout(num_kv_heads=fmt.num_heads, head_dim=fmt.head_dim, **common)


def _index(block_ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(block_ids, torch.Tensor):
        return block_ids.to(device=device, dtype=torch.long)
    return torch.tensor(list(block_ids), dtype=torch.long, device=device)


def gather_layer(cache: torch.Tensor, fmt: PagedFormat, idx: torch.Tensor) -> torch.Tensor:
    """``[nb, *fmt.block_shape]`` copy of blocks ``idx`` of one layer (cache's device)."""
    if fmt.kind in ("bhnc", "mla"):
        return cache.index_select(0, idx)
    if fmt.kind == "flash_attn":
        return cache.index_select(1, idx).transpose(0, 1)
    blocks = cache.index_select(0, idx)  # [nb, 2, N|H, H|N, D]
    return blocks.transpose(2, 3) if fmt.hnd else blocks


def scatter_layer(cache: torch.Tensor, fmt: PagedFormat, idx: torch.Tensor,
                  data: torch.Tensor) -> None:
    """Write ``data`` (``[nb, *fmt.block_shape]``) into blocks ``idx`` of one layer."""
    data = data.to(device=cache.device, dtype=cache.dtype)
    if fmt.kind in ("bhnc", "mla"):
        cache.index_copy_(0, idx, data)
    elif fmt.kind == "flash_attn":
        cache.index_copy_(1, idx, data.transpose(0, 1))
    else:
        cache.index_copy_(0, idx, data.transpose(2, 3) if fmt.hnd else data)


def gather_blocks(caches: Sequence[torch.Tensor], fmt: PagedFormat,
                  block_ids: Sequence[int] | torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Blocks ``block_ids`` of every layer as one contiguous CPU tensor
    ``[nb, L, *block_shape]``; row ``i`` is exactly one ctxmem block."""
    nb = len(block_ids)
    shape = (nb, len(caches), *fmt.block_shape)
    if out is None:
        out = torch.empty(shape, dtype=fmt.dtype, device="cpu")
    if nb == 0:
        return out
    idx = _index(block_ids, caches[0].device)
    for layer, cache in enumerate(caches):
        out[:, layer].copy_(gather_layer(cache, fmt, idx))
    return out


def scatter_blocks(caches: Sequence[torch.Tensor], fmt: PagedFormat,
                   block_ids: Sequence[int] | torch.Tensor, data: torch.Tensor,
                   layers: Sequence[int] | None = None) -> None:
    """Inverse of :func:`gather_blocks` (optionally for some layers only)."""
    if len(block_ids) == 0:
        return
    idx = _index(block_ids, caches[0].device)
    for layer in layers if layers is not None else range(len(caches)):
        scatter_layer(caches[layer], fmt, idx, data[:, layer])


def block_views(data: torch.Tensor) -> list[torch.Tensor]:
    """Row views of a gather/scatter staging tensor, one per ctxmem block."""
    return [data[i] for i in range(data.shape[0])]


# -- head-sliced blocks: one ctxmem block per (vLLM block, KV head) -----------------------
# A TP rank holds a contiguous run of the model's KV heads. Stored one head per ctxmem
# block (key: the block hash plus the head's index in the whole model), a block is the
# same bytes whichever TP split wrote it, so an engine of any TP size reads what another
# stored: rank r of tp reads heads [r*H/tp, (r+1)*H/tp).

def head_axis(fmt: PagedFormat) -> int:
    """Axis of the KV heads in ``fmt.block_shape``."""
    if fmt.kind == "bhnc":
        return 0
    if fmt.kind == "mla":
        raise InvalidArgument("MLA caches have no KV heads to slice (ranks hold the same "
                              "latent); leave ctxmem.tp_shared off for MLA models")
    return 2  # (2, N, H, D)


def head_major(blocks: torch.Tensor, fmt: PagedFormat) -> torch.Tensor:
    """``[nb, L, *block_shape]`` -> contiguous ``[nb, H, L, *block_shape without H]``:
    row ``(i, h)`` is exactly one head-sliced ctxmem block."""
    return blocks.movedim(2 + head_axis(fmt), 1).contiguous()


def from_head_major(rows: torch.Tensor, fmt: PagedFormat) -> torch.Tensor:
    """Inverse of :func:`head_major` (a view, for :func:`scatter_blocks`)."""
    return rows.movedim(1, 2 + head_axis(fmt))


def head_keys(keys: Sequence[bytes], heads: Sequence[int]) -> list[bytes]:
    """The ctxmem key of each (block, head), blocks outer: ``key + b"/h" + head``."""
    from ctxmem.integrations._common import fit_key

    return [fit_key(k + b"/h" + h.to_bytes(2, "big")) for k in keys for h in heads]


def head_layout(fmt: PagedFormat, num_layers: int, *, dtype_name: str | None = None
                ) -> KVLayout:
    """The layout of one head-sliced block (TP-free: any split reads it)."""
    one = PagedFormat(fmt.kind, fmt.num_blocks, fmt.block_size, 1, fmt.head_dim, fmt.dtype,
                      fmt.hnd)
    return ctxmem_layout(one, num_layers, dtype_name=dtype_name)
