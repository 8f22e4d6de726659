"""The one place where ctxmem's own names meet the protocol's enums and messages.

The service and the shim speak in plain names (tiers ``"dram"``/``"flash"``, transports
``"shm"``/``"tcp"``/``"rdma"``) and :class:`~ctxmem_common.layout.KVLayout`; the wire
speaks ``ctxmem.v1`` enums and ``Layout`` messages. Every conversion between the two lives
here, so adding a tier or a transport is one edit and both sides agree by construction.
"""

from __future__ import annotations

import numpy as np

from ctxmem_common.layout import KVLayout
from ctxmem_common.proto import ctxmem_pb2 as pb

__all__ = [
    "TIER_DRAM",
    "TIER_FLASH",
    "TIER_NONE",
    "TIER_REMOTE",
    "TIER_REMOTE_DRAM",
    "TRANSPORTS",
    "layout_from_pb",
    "layout_to_pb",
    "tier_from_pb",
    "tier_to_pb",
    "tiers_from_codes",
    "transport_from_pb",
    "transport_to_pb",
]

TIER_DRAM = "dram"
TIER_FLASH = "flash"
TIER_REMOTE = "remote"  # pod tier: another node holds it (docs/pod.md)
# An Acquire's source only: a remote block a Prefetch pulled into this node's DRAM before
# the get asked for it (docs/pod.md, "Pre-staging"); an on-demand fetch is TIER_REMOTE.
TIER_REMOTE_DRAM = "remote→dram"
TIER_NONE = ""  # not stored (a miss), or "any tier" where a request names one

# Tier names <-> protocol enum. TIER_UNSPECIFIED means "no tier": a miss in a Lookup
# answer, "every tier" in an Evict request.
_TIER_TO_PB: dict[str, pb.Tier] = {
    TIER_DRAM: pb.TIER_DRAM, TIER_FLASH: pb.TIER_FLASH, TIER_REMOTE: pb.TIER_REMOTE,
    TIER_REMOTE_DRAM: pb.TIER_REMOTE_DRAM, TIER_NONE: pb.TIER_UNSPECIFIED}
_TIER_FROM_PB: dict[int, str] = {v: k for k, v in _TIER_TO_PB.items()}

# Transport names, in the order a client prefers them when several are offered.
_TRANSPORT_TO_PB: dict[str, pb.Transport] = {
    "shm": pb.TRANSPORT_SHM, "tcp": pb.TRANSPORT_TCP, "rdma": pb.TRANSPORT_RDMA}
_TRANSPORT_FROM_PB: dict[int, str] = {v: k for k, v in _TRANSPORT_TO_PB.items()}
TRANSPORTS: tuple[str, ...] = tuple(_TRANSPORT_TO_PB)


def tier_to_pb(name: str) -> pb.Tier:
    """``"dram"``/``"flash"``/``""`` → ``pb.TIER_*``; KeyError for an unknown name."""
    return _TIER_TO_PB[name]


def tier_from_pb(value: int) -> str:
    """``pb.TIER_*`` → ``"dram"``/``"flash"``, or ``""`` for unspecified and unknown values
    (a newer service's tier reads as "no tier" rather than failing an older shim)."""
    return _TIER_FROM_PB.get(value, TIER_NONE)


# Every byte value → its tier name ("" for unknown values, as tier_from_pb): one numpy
# take turns a LookupResponse.tier_codes into names without a Python step per key.
_TIER_NAMES_BY_CODE = np.array([tier_from_pb(v) for v in range(256)], dtype=object)


def tiers_from_codes(codes: bytes) -> list[str]:
    """``LookupResponse.tier_codes`` (one ``pb.Tier`` value per byte) → tier names."""
    names: list[str] = _TIER_NAMES_BY_CODE[np.frombuffer(codes, dtype=np.uint8)].tolist()
    return names


def transport_to_pb(name: str) -> pb.Transport:
    """``"shm"``/``"tcp"``/``"rdma"`` → ``pb.TRANSPORT_*``; KeyError for an unknown name."""
    return _TRANSPORT_TO_PB[name]


def transport_from_pb(value: int) -> str | None:
    """``pb.TRANSPORT_*`` → its name, or None for unspecified or unknown values."""
    return _TRANSPORT_FROM_PB.get(value)


def layout_to_pb(layout: KVLayout) -> pb.Layout:
    """A :class:`KVLayout` as the protocol's ``Layout`` (absent MLA sizes are 0)."""
    return pb.Layout(
        dtype=layout.dtype, num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim, tokens_per_block=layout.tokens_per_block,
        kv_lora_rank=layout.kv_lora_rank or 0, qk_rope_head_dim=layout.qk_rope_head_dim or 0,
        tp_rank=layout.tp_rank, tp_size=layout.tp_size)


def layout_from_pb(msg: pb.Layout) -> KVLayout:
    """The protocol's ``Layout`` as a validated :class:`KVLayout`.

    Raises ``InvalidArgument`` (through ``KVLayout``'s own checks) for a bad layout.
    """
    return KVLayout(
        dtype=msg.dtype, num_layers=msg.num_layers, num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim, tokens_per_block=msg.tokens_per_block,
        kv_lora_rank=msg.kv_lora_rank or None,
        qk_rope_head_dim=msg.qk_rope_head_dim if msg.kv_lora_rank else None,
        tp_rank=msg.tp_rank, tp_size=msg.tp_size or 1)
