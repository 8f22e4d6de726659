"""Blocks for the never-a-wrong-block tests (issue 13): 256 KiB blocks whose bytes are a
function of their key, and a get into sentinel-filled buffers that checks both halves of
the promise: every returned block is exact, and no buffer past the count was written."""

from __future__ import annotations

import hashlib

import numpy as np

import ctxmem
from ctxmem_common.layout import KVLayout

BLOCK = 256 << 10
LAYOUT = KVLayout(dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=BLOCK // 2,
                  tokens_per_block=1)
SENTINEL = 0xA5


def keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


def content(key: bytes) -> bytes:
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


def get_checked(ns: ctxmem.Namespace, ks: list[bytes]) -> int:
    """Get ``ks`` into sentinel-filled buffers; assert the returned blocks are exact and
    the buffers past the count still all sentinel. Returns the count."""
    bufs = [bytearray([SENTINEL]) * BLOCK for _ in ks]
    n = ns.get(ks, bufs)
    for i in range(n):
        assert bytes(bufs[i]) == content(ks[i]), f"block {i} of {n} served with wrong bytes"
    for i in range(n, len(ks)):
        assert bufs[i].count(SENTINEL) == BLOCK, f"buffer {i} past the count {n} was written"
    return n
