"""Verified reads: a get never leaves a block's buffer holding bytes that failed its CRC32C.

Every channel's :meth:`~ctxmem.transport.base.DataChannel.read_verified` moves each block
straight into the caller's buffer and checks it in the same pass:

* shared memory: :func:`copy_checked` copies the block out of the mapped slot with
  :func:`~ctxmem_common.codecs.copy_crc32c`, which CRCs each word from the register it
  stores (native: SSE4.2 / ARMv8 CRC, one pass over memory), so the CRC is of exactly the
  bytes now in the buffer: a stale or hostile writer changing the slot during the copy
  makes the block fail its check, never pass with bytes that were not checked;
* TCP: each received piece is CRC'd as it lands in the buffer, while it is in cache;
* RDMA keeps its own landing buffer (:mod:`ctxmem.transport.rdma_buffers`): a failed
  block is never copied out of it.

A block whose CRC differs from the one committed with it is scrubbed (:func:`scrub`: its
buffer is zeroed) and the read stops there. So after a get that returned ``n``:
buffers ``0..n-1`` hold exactly their committed blocks; buffer ``n``, if a block failed
there, holds zeros (shared memory, TCP) or its previous content (RDMA), never wrong bytes;
every buffer after it is untouched.

Why not a private bounce (copy + CRC into it, deliver only on a match, as before): the
second copy (bounce -> buffer) cost a third of a 2 MiB get's time; fused into the caller's
buffer, a verified get moves each byte once (docs/benchmarks.md, ``dram_get_*_verify``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ctxmem_common.codecs import copy_crc32c

__all__ = ["ReadProgress", "check_landed", "copy_checked", "scrub"]


@dataclass
class ReadProgress:
    """How far a read got, kept up to date block by block so that a read that raises
    midway (lease expired, service gone) still tells which leading blocks are in place.

    ``done``: leading blocks written to their destination (each verified, unless the
    read was unverified). ``bad``: index of the block that failed its CRC32C (the read
    stops there; its buffer is scrubbed, the buffers after it are not written), or
    ``None``.
    """

    done: int = 0
    bad: int | None = None


def scrub(dst: memoryview) -> None:
    """Zero ``dst``: a block that failed its check leaves no byte of it behind."""
    np.frombuffer(dst, dtype=np.uint8)[:] = 0


def copy_checked(src: memoryview, dst: memoryview, want: int) -> bool:
    """Copy ``src`` into ``dst`` and CRC it in one pass; if the CRC of the bytes stored
    differs from ``want`` (the committed CRC), scrub ``dst``. Returns whether it matched."""
    return check_landed(dst, copy_crc32c(src, dst), want)


def check_landed(dst: memoryview, crc: int, want: int) -> bool:
    """``crc`` (of the bytes now in ``dst``) against ``want``; scrubs ``dst`` if they
    differ. Returns whether they matched."""
    if crc == want:
        return True
    scrub(dst)
    return False
