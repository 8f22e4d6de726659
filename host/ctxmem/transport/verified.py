"""Verified reads: a block reaches the caller's buffer only after its CRC32C matched.

Every channel's :meth:`~ctxmem.transport.base.DataChannel.read_verified` delivers blocks
through :class:`BlockBounce`, a per-channel buffer of one block: the block's bytes are
copied (shared memory), received (TCP) or RDMA-read into it, their CRC32C is computed as
they arrive, chunk by chunk while the chunk is still in cache, and only if it equals the
CRC committed with the block are they copied into the caller's buffer. So

* the bytes in the caller's buffer are exactly the bytes that were checked: a stale or
  hostile writer changing the slot during the copy changes the bounce at worst, and then
  the block fails its check (no check-then-copy race);
* a block that fails is not written at all, and neither is any block after it: a get
  leaves buffers past its returned count untouched.

The bounce stays in L2/L3 (one block), so the common path costs about one copy's DRAM
traffic plus the CRC's compute (see docs/benchmarks.md, ``dram_get_*_verify``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ctxmem_common.codecs import crc32c

__all__ = ["CHUNK_BYTES", "BlockBounce", "ReadProgress"]

CHUNK_BYTES = 512 << 10
"""Copy-and-CRC step of a shared-memory block: small enough to be CRC'd from L2 right
after it was copied, big enough that the per-chunk Python call does not show."""


@dataclass
class ReadProgress:
    """How far a read got, kept up to date block by block so that a read that raises
    midway (lease expired, service gone) still tells which leading blocks are in place.

    ``done``: leading blocks written to their destination (each verified, unless the
    read was unverified). ``bad``: index of the block that failed its CRC32C (the read
    stops there; it and the blocks after it are not written), or ``None``.
    """

    done: int = 0
    bad: int | None = None


class BlockBounce:
    """One block-sized private buffer a channel moves a block through before delivering
    it. Grows to the largest block seen; not thread-safe (channels hold their lock)."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)

    def view(self, nbytes: int) -> memoryview:
        """A writable view of ``nbytes`` of the bounce (reallocated if too small)."""
        if self._buf.nbytes < nbytes:
            self._buf = np.empty(nbytes, dtype=np.uint8)
        return self._buf.data[:nbytes]

    def copy_in(self, src: memoryview) -> int:
        """Copy ``src`` into the bounce in :data:`CHUNK_BYTES` steps, CRC-ing each chunk
        right after copying it; returns the CRC32C of the bytes now in the bounce."""
        n = src.nbytes
        bounce = self.view(n)
        crc = 0
        for off in range(0, n, CHUNK_BYTES):
            end = min(off + CHUNK_BYTES, n)
            bounce[off:end] = src[off:end]
            crc = crc32c(bounce[off:end], crc)
        return crc

    def deliver(self, dst: memoryview, crc: int, want: int) -> bool:
        """Copy the bounce's first ``dst.nbytes`` into ``dst`` if ``crc`` (theirs) equals
        ``want`` (the committed CRC); otherwise leave ``dst`` untouched. Returns whether
        it was delivered."""
        if crc != want:
            return False
        dst[:] = self.view(dst.nbytes)
        return True
