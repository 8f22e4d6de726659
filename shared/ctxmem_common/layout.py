"""The KV layout descriptor: what one block of KV cache holds and how many bytes it is.

A block is ``tokens_per_block`` tokens of one TP rank's KV for every layer. The byte
order inside a block is the shim's business (engines slice their paged caches into it);
the service only needs the exact size, which this module fixes:

* standard attention:
  ``2 (K, V) * num_layers * tokens_per_block * num_kv_heads * head_dim * itemsize``
* MLA (DeepSeek-style latent cache):
  ``num_layers * tokens_per_block * (kv_lora_rank + qk_rope_head_dim) * itemsize``

The layout digest goes into the namespace identity, so two engines whose layouts differ in
any field (dtype, TP rank, block size...) never read each other's blocks.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

from ctxmem_common.errors import InvalidArgument

# Bytes per element. fp8 variants are 1 byte; engines that pack scales with fp8 data
# (e.g. vLLM's fp8_ds_mla) describe the packed width through head_dim.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}

MAX_BLOCK_NBYTES = 1 << 30


@dataclass(frozen=True, kw_only=True)
class KVLayout:
    """Shape of one KV block. Immutable; ``block_nbytes`` and ``digest`` derive from it."""

    dtype: str
    num_layers: int
    num_kv_heads: int = 1
    head_dim: int = 0
    tokens_per_block: int = 16
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise InvalidArgument(
                f"layout.dtype {self.dtype!r} is not supported; use one of {sorted(DTYPE_SIZES)}"
            )
        for name in ("num_layers", "tokens_per_block", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"layout.{name} must be an integer >= 1, got {value!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgument(
                f"layout.tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank}"
            )
        if self.is_mla:
            if not self.kv_lora_rank or self.kv_lora_rank < 1:
                raise InvalidArgument("layout.kv_lora_rank must be >= 1 for an MLA layout")
            if self.qk_rope_head_dim is None or self.qk_rope_head_dim < 0:
                raise InvalidArgument("layout.qk_rope_head_dim must be >= 0 for an MLA layout")
        else:
            for name in ("num_kv_heads", "head_dim"):
                value = getattr(self, name)
                if not isinstance(value, int) or value < 1:
                    raise InvalidArgument(f"layout.{name} must be an integer >= 1, got {value!r}")
        if self.block_nbytes > MAX_BLOCK_NBYTES:
            raise InvalidArgument(
                f"layout gives {self.block_nbytes} bytes per block, more than the "
                f"{MAX_BLOCK_NBYTES} supported; use fewer tokens_per_block"
            )

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None and self.kv_lora_rank > 0

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def token_nbytes_per_layer(self) -> int:
        """Bytes one token occupies in one layer (K and V together; or the MLA latent)."""
        if self.is_mla:
            assert self.kv_lora_rank is not None
            return (self.kv_lora_rank + (self.qk_rope_head_dim or 0)) * self.itemsize
        return 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def block_nbytes(self) -> int:
        return self.num_layers * self.tokens_per_block * self.token_nbytes_per_layer

    def digest(self) -> bytes:
        """16-byte digest of every field; part of the namespace identity."""
        canon = "|".join(f"{k}={v}" for k, v in sorted(asdict(self).items()))
        return hashlib.sha256(b"ctxmem-layout-v1|" + canon.encode()).digest()[:16]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> KVLayout:
        return cls(**data)  # type: ignore[arg-type]
