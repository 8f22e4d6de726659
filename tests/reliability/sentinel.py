"""Blocks for the never-a-wrong-block tests (issue 13): 256 KiB blocks whose bytes are a
function of their key, and a get into sentinel-filled buffers that checks both halves of
the promise: every returned block is exact, and no buffer past the count holds wrong bytes
(the one at the count may be scrubbed to zeros; the ones after it are not written)."""

from __future__ import annotations

import ctxmem
from tests import kit
from tests.kit import byte_layout

BLOCK = 256 << 10
LAYOUT = byte_layout(BLOCK)
SENTINEL = 0xA5


keys = kit.keys  # the suite's keys: sha256 of "tag/i"


def content(key: bytes) -> bytes:
    """The bytes a block of ``key`` holds here (see :func:`tests.kit.content`)."""
    return kit.content(key, BLOCK)


def get_checked(ns: ctxmem.Namespace, ks: list[bytes], scrubbed: bool | None = None) -> int:
    """Get ``ks`` into sentinel-filled buffers; assert the returned blocks are exact, the
    buffer at the count (where a block that failed its CRC32C stops the run) either
    untouched or scrubbed to zeros, never wrong bytes, and every buffer after it still all
    sentinel. ``scrubbed``: ``True`` when a block must have failed there (zeros), ``False``
    when the run must have ended on a miss (sentinel), ``None`` for either. Returns the
    count."""
    bufs = [bytearray([SENTINEL]) * BLOCK for _ in ks]
    n = ns.get(ks, bufs)
    for i in range(n):
        assert bytes(bufs[i]) == content(ks[i]), f"block {i} of {n} served with wrong bytes"
    if n < len(ks):
        zeros, untouched = bufs[n].count(0) == BLOCK, bufs[n].count(SENTINEL) == BLOCK
        assert zeros or untouched, f"buffer {n} at the count holds bytes of a failed block"
        if scrubbed is not None:
            assert (zeros if scrubbed else untouched), (
                f"buffer {n}: expected {'zeros' if scrubbed else 'the sentinel'}")
    for i in range(n + 1, len(ks)):
        assert bufs[i].count(SENTINEL) == BLOCK, f"buffer {i} past the count {n} was written"
    return n
