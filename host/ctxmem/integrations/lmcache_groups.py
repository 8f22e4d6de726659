"""The KV groups of an LMCache engine, as ctxmem's LMCache storage plugin sees them.

LMCache 0.5.6 describes a model's KV caches by ``LMCacheMetadata.kv_layer_groups_manager``
(one kernel group per set of layers sharing a geometry, a dtype and an engine block
group) once the engine registered its caches, else by the legacy ``kv_shape``/``kv_dtype``.
A chunk's memory object holds every group's tensor back to back
(``MemoryObjMetadata.shapes``/``dtypes``; ``TensorMemoryObj.get_tensor(i)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from ctxmem.integrations._common import config_get, torch_dtype_name
from ctxmem_common.layout import KVLayout


@dataclass(frozen=True)
class KVGroup:
    """The geometry of one LMCache KV group, as its memory objects carry it."""

    index: int
    count: int
    dtype: torch.dtype
    kv_size: int  # 2 (K and V) or 1 (MLA)
    num_layers: int
    num_heads: int
    head_size: int


def kv_groups(metadata: Any) -> list[KVGroup]:
    """Every KV group of LMCache's engine metadata, in the order its memory objects hold
    them: the kernel groups of ``kv_layer_groups_manager`` once the engine registered its
    KV caches, else the legacy single ``kv_shape``/``kv_dtype``."""
    manager = getattr(metadata, "kv_layer_groups_manager", None)
    kernel = list(getattr(manager, "kernel_groups", None) or ())
    if not kernel:
        layers, kv, _, heads, head = metadata.kv_shape
        return [KVGroup(0, 1, metadata.kv_dtype, int(kv), int(layers), int(heads),
                        int(head))]
    return [KVGroup(i, len(kernel), g.dtype, int(g.shape_desc.kv_size), int(g.num_layers),
                    int(g.shape_desc.nh), int(g.shape_desc.hs))
            for i, g in enumerate(kernel)]


def group_bytes(obj: MemoryObj, group: int) -> np.ndarray:
    """One group's bytes of an LMCache memory object, as a flat uint8 view (zero copy)."""
    meta = obj.meta
    if meta.shapes is not None and meta.dtypes is not None:
        tensor = obj.get_tensor(group)
    else:
        if group:
            raise ValueError(f"memory object has one group; group {group} asked for")
        tensor = obj.tensor
    assert tensor is not None
    return tensor.reshape(-1).view(torch.uint8).numpy()


def group_layout(group: KVGroup, key: Any, *, chunk_size: int, layerwise: bool,
                 use_mla: bool, extra: Mapping[str, Any]) -> KVLayout:
    """The ctxmem layout of one group's chunk for an LMCache key (its TP rank/size)."""
    layers = 1 if layerwise else group.num_layers
    dtype = torch_dtype_name(group.dtype if group.count > 1 else key.dtype)
    tp = {"tp_rank": int(key.worker_id), "tp_size": max(1, int(key.world_size))}
    hidden = group.num_heads * group.head_size
    if group.kv_size == 1 or (use_mla and group.count == 1):
        rank = int(config_get(extra, "kv_lora_rank", hidden))
        rope = int(config_get(extra, "qk_rope_head_dim", 0))
        if rank + rope != hidden:
            rank, rope = hidden, 0
        return KVLayout(dtype=dtype, num_layers=layers, tokens_per_block=chunk_size,
                        kv_lora_rank=rank, qk_rope_head_dim=rope, **tp)
    return KVLayout(dtype=dtype, num_layers=layers, num_kv_heads=group.num_heads,
                    head_dim=group.head_size, tokens_per_block=chunk_size, **tp)


def expected_format(config: Any, *, layerwise: bool, use_mla: bool) -> MemoryFormat:
    """The memory format LMCache's engine allocates chunks in (mirrors its rules)."""
    if layerwise:
        if use_mla:
            return MemoryFormat.KV_MLA_FMT
        if getattr(config, "enable_blending", False):
            return MemoryFormat.KV_2TD
        return MemoryFormat.KV_T2D
    return MemoryFormat.KV_MLA_FMT if use_mla else MemoryFormat.KV_2LTD
