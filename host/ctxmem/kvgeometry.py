"""KV geometry for torch: a :class:`ctxmem.KVLayout` with the torch dtype and the block
tensor shape that packing needs (:class:`KVGeometry`), the KV dtype names <-> torch dtypes,
and the geometry of a ``transformers`` model config.

The dtype names are those of :data:`ctxmem_common.layout.DTYPE_SIZES`, the one list of KV
dtypes ctxmem knows; the geometry holds nothing but a layout, so the byte size of a block
has one definition. It imports torch: engines reach it through :mod:`ctxmem.kvtransfer`,
which re-exports it, never through ``import ctxmem``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ctxmem_common.layout import DTYPE_SIZES, KVLayout

__all__ = ["KVGeometry", "dtype_name", "geometry_from_config", "kv_layout", "torch_dtype"]


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a layout dtype name ("float32", "bfloat16", ...).

    The names are those of :data:`ctxmem_common.layout.DTYPE_SIZES` (the one list of KV
    dtypes ctxmem knows); each is also the name of the torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    key = name.removeprefix("torch.")
    if key not in DTYPE_SIZES:
        raise ValueError(f"unsupported KV dtype {name!r}; supported: {sorted(DTYPE_SIZES)}")
    dtype = getattr(torch, key)
    assert isinstance(dtype, torch.dtype)
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The layout dtype name of a torch dtype (inverse of :func:`torch_dtype`)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ValueError(f"unsupported KV dtype {dtype}; supported: {sorted(DTYPE_SIZES)}")
    return name


class KVGeometry:
    """A :class:`ctxmem.KVLayout` seen from torch: what packing a block needs (the torch
    dtype, the block's tensor shape) derived from the layout, which is all it holds.

    Build it from a layout (``KVGeometry.of(layout)``) or from the fields, as before
    (``KVGeometry(num_layers, num_kv_heads, head_dim, tokens_per_block, dtype, ...)``, the
    dtype a torch dtype or a name): either way the layout validates them, and
    ``block_nbytes`` is the layout's, so the shim and the service can never disagree on it.
    """

    __slots__ = ("kv_layout",)

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        tokens_per_block: int,
        dtype: str | torch.dtype,
        kv_lora_rank: int | None = None,
        qk_rope_head_dim: int | None = None,
    ) -> None:
        self.kv_layout = KVLayout(
            dtype=dtype_name(torch_dtype(dtype)),
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            tokens_per_block=tokens_per_block,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
        )

    @classmethod
    def of(cls, layout: KVLayout) -> KVGeometry:
        """The geometry of ``layout`` (its TP rank and size are kept for :meth:`layout`)."""
        geometry = cls.__new__(cls)
        geometry.kv_layout = layout
        return geometry

    @property
    def num_layers(self) -> int:
        return self.kv_layout.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.kv_layout.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.kv_layout.head_dim

    @property
    def tokens_per_block(self) -> int:
        return self.kv_layout.tokens_per_block

    @property
    def kv_lora_rank(self) -> int | None:
        return self.kv_layout.kv_lora_rank

    @property
    def qk_rope_head_dim(self) -> int | None:
        return self.kv_layout.qk_rope_head_dim

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.kv_layout.dtype)

    @property
    def is_mla(self) -> bool:
        return self.kv_layout.is_mla

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block's tensor (see the module docstring for the byte order)."""
        lay = self.kv_layout
        if lay.is_mla:
            latent = (lay.kv_lora_rank or 0) + (lay.qk_rope_head_dim or 0)
            return (lay.num_layers, lay.tokens_per_block, latent)
        return (lay.num_layers, 2, lay.num_kv_heads, lay.tokens_per_block, lay.head_dim)

    @property
    def block_nbytes(self) -> int:
        return self.kv_layout.block_nbytes

    def layout(self, *, tp_rank: int | None = None, tp_size: int | None = None) -> KVLayout:
        """The :class:`ctxmem.KVLayout`, with ``tp_rank`` / ``tp_size`` replaced if given."""
        lay = self.kv_layout
        if tp_rank is None and tp_size is None:
            return lay
        return dataclasses.replace(
            lay,
            tp_rank=lay.tp_rank if tp_rank is None else tp_rank,
            tp_size=lay.tp_size if tp_size is None else tp_size,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVGeometry) and other.kv_layout == self.kv_layout

    def __hash__(self) -> int:
        return hash(self.kv_layout)

    def __repr__(self) -> str:
        return f"KVGeometry.of({self.kv_layout!r})"


def geometry_from_config(
    config: Any, *, tokens_per_block: int, dtype: str | torch.dtype | None = None
) -> KVGeometry:
    """KV geometry of a ``transformers`` config (Llama-style attention).

    ``dtype`` defaults to the config's dtype (``dtype`` / ``torch_dtype``), else float32.
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    num_heads = int(text.num_attention_heads)
    num_kv_heads = int(getattr(text, "num_key_value_heads", None) or num_heads)
    head_dim = getattr(text, "head_dim", None) or int(text.hidden_size) // num_heads
    if dtype is None:
        # ``torch_dtype`` only where the config has no ``dtype`` (transformers < 4.56):
        # reading it on a newer config logs a deprecation warning.
        dtype = (getattr(text, "dtype", None) if hasattr(text, "dtype")
                 else getattr(text, "torch_dtype", None)) or "float32"
    return KVGeometry(
        num_layers=int(text.num_hidden_layers),
        num_kv_heads=num_kv_heads,
        head_dim=int(head_dim),
        tokens_per_block=tokens_per_block,
        dtype=torch_dtype(dtype if isinstance(dtype, torch.dtype) else str(dtype)),
    )


def kv_layout(
    config: Any,
    *,
    tokens_per_block: int,
    dtype: str | torch.dtype | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> KVLayout:
    """The :class:`ctxmem.KVLayout` for a ``transformers`` model config."""
    geometry = geometry_from_config(config, tokens_per_block=tokens_per_block, dtype=dtype)
    return geometry.layout(tp_rank=tp_rank, tp_size=tp_size)
