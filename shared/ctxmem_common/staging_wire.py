"""Bodies of the staging ops on the shared-memory socket (issue 27 item 1).

Why: a put through the slabs is two passes over memory (the client's copy into the slot,
then the service's CRC32C of the slot) and needs the client to write the service's slabs.
With *staging regions* the service creates the memory (a sealed memfd, mapped by both),
the engine fills its blocks there (its offload buffer *is* that memory), and one
STAGE_PUT names them: the service copies each block into its slot and computes the
CRC32C in the same pass, so the check and the copy are one pass, the CRC is of the very
bytes stored, and the client never writes a slab.

Bodies (little-endian; keys packed as :func:`ctxmem_common.keys.pack_keys` does)::

    STAGE_CREATE req  nbytes u64 (data bytes wanted)
                 rep  region_id u32, flags u32 (bit 0: huge pages), size u64,
                      data_offset u64   (+ the region's memfd as SCM_RIGHTS)
    STAGE_PUT    req  handle u32, region_id u32, flags u32 (bit 0: crcs present),
                      key_len u32, n u32, keys, offsets u64[n], lengths u64[n],
                      crcs u32[n] (only with bit 0)
                 rep  stored u32, existing u32, refused u32, outcome u8[n]
    STAGE_FREE   req  region_id u32
                 rep  (empty)

A region begins with a :data:`HEADER_BYTES` header the service writes (magic, region id,
size, data offset: the shim checks it names the region it asked for) and never reads
back; every offset a STAGE_PUT names lies in ``[data_offset, size)``. Offsets are from the
region's first byte. ``outcome`` per key: :data:`STORED`, :data:`EXISTING` (already
stored: nothing copied) or :data:`REFUSED_CRC` (the bytes the service copied do not have
the declared CRC32C: not stored).

Decoders trust nothing: a body whose length disagrees with its counts raises
:class:`ValueError` (the service answers BAD_REQUEST and closes the connection).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ctxmem_common.errors import InvalidArgument
from ctxmem_common.keys import MAX_KEY_BYTES, MAX_LOOKUP_KEYS, packed_key_array

__all__ = ["EXISTING", "HEADER", "HEADER_BYTES", "REFUSED_CRC", "STORED", "Created",
           "PutOutcome", "StagePut", "decode_create", "decode_create_reply",
           "decode_free", "decode_put", "decode_put_reply", "encode_create",
           "encode_create_reply", "encode_free", "encode_put", "encode_put_reply",
           "pack_header"]

HEADER_BYTES = 4096
"""The region's first page: the service's header; no block may overlap it."""
HEADER = struct.Struct("<4sIIIQQ")  # magic b"CXSG", version, region_id, flags, size, data_offset
HEADER_MAGIC = b"CXSG"
FLAG_HUGEPAGES = 1
FLAG_CRCS = 1

STORED, EXISTING, REFUSED_CRC = 0, 1, 2

_U32 = np.dtype("<u4")
_U64 = np.dtype("<u8")
_CREATE = struct.Struct("<Q")
_CREATE_REP = struct.Struct("<IIQQ")
_PUT = struct.Struct("<IIIII")
_PUT_REP = struct.Struct("<III")
_FREE = struct.Struct("<I")

Body = bytes | bytearray


def pack_header(region_id: int, flags: int, size: int) -> bytes:
    return HEADER.pack(HEADER_MAGIC, 1, region_id, flags, size, HEADER_BYTES)


# -- STAGE_CREATE ---------------------------------------------------------------------
def encode_create(nbytes: int) -> bytes:
    return _CREATE.pack(nbytes)


def decode_create(body: Body) -> int:
    if len(body) != _CREATE.size:
        raise ValueError(f"STAGE_CREATE body of {len(body)} bytes (expected {_CREATE.size})")
    return int(_CREATE.unpack(body)[0])


@dataclass(frozen=True)
class Created:
    region_id: int
    hugepages: bool
    size: int
    data_offset: int


def encode_create_reply(c: Created) -> bytes:
    return _CREATE_REP.pack(c.region_id, FLAG_HUGEPAGES if c.hugepages else 0, c.size,
                            c.data_offset)


def decode_create_reply(body: bytes) -> Created:
    if len(body) != _CREATE_REP.size:
        raise ValueError(f"STAGE_CREATE answer of {len(body)} bytes")
    rid, flags, size, data_offset = _CREATE_REP.unpack(body)
    if not HEADER_BYTES <= data_offset <= size:
        raise ValueError(f"STAGE_CREATE answer: data offset {data_offset} outside the "
                         f"{size}-byte region {rid}")
    return Created(rid, bool(flags & FLAG_HUGEPAGES), size, data_offset)


# -- STAGE_PUT ------------------------------------------------------------------------
@dataclass(frozen=True)
class StagePut:
    """A decoded STAGE_PUT: ``keys`` as :func:`packed_key_array` checked them; offsets,
    lengths (uint64) and crcs (uint32, or None when the client declared none) as numpy
    arrays over the body."""

    handle: int
    region_id: int
    keys: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    crcs: np.ndarray | None


def encode_put(handle: int, region_id: int, packed: bytes, key_len: int,
               offsets: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray,
               crcs: Sequence[int] | np.ndarray | None) -> list[bytes]:
    n = len(offsets)
    parts = [_PUT.pack(handle, region_id, FLAG_CRCS if crcs is not None else 0, key_len, n),
             packed, np.asarray(offsets, _U64).tobytes(), np.asarray(lengths, _U64).tobytes()]
    if crcs is not None:
        parts.append(np.asarray(crcs, _U32).tobytes())
    return parts


def decode_put(body: Body) -> StagePut:
    """ValueError when the lengths disagree; InvalidArgument for bad keys (as gRPC)."""
    if len(body) < _PUT.size:
        raise ValueError(f"STAGE_PUT body of {len(body)} bytes is shorter than its header")
    handle, region_id, flags, key_len, n = _PUT.unpack_from(body)
    if flags & ~FLAG_CRCS:
        raise ValueError(f"STAGE_PUT flags {flags:#x} unknown")
    if not 1 <= key_len <= MAX_KEY_BYTES:
        raise InvalidArgument(
            f"keys[0] is {key_len} bytes; block keys must be 1..{MAX_KEY_BYTES} bytes "
            f"(hash longer engine keys down, e.g. with sha256)")
    if n > MAX_LOOKUP_KEYS:
        raise InvalidArgument(f"STAGE_PUT of {n} blocks; at most {MAX_LOOKUP_KEYS} per call")
    with_crcs = bool(flags & FLAG_CRCS)
    want = _PUT.size + n * (key_len + 16 + (4 if with_crcs else 0))
    if len(body) != want:
        raise ValueError(f"STAGE_PUT of {n} blocks in {len(body)} bytes (expected {want})")
    view = memoryview(body)
    off = _PUT.size
    keys = packed_key_array(view[off:off + n * key_len], key_len, MAX_LOOKUP_KEYS)
    off += n * key_len
    offsets = np.frombuffer(body, _U64, n, off)
    lengths = np.frombuffer(body, _U64, n, off + 8 * n)
    crcs = np.frombuffer(body, _U32, n, off + 16 * n) if with_crcs else None
    return StagePut(handle, region_id, keys, offsets, lengths, crcs)


@dataclass(frozen=True)
class PutOutcome:
    stored: int
    existing: int
    refused: int
    outcome: bytes
    """One of :data:`STORED`, :data:`EXISTING`, :data:`REFUSED_CRC` per key."""


def encode_put_reply(outcome: np.ndarray) -> bytes:
    counts = np.bincount(outcome, minlength=3)
    return _PUT_REP.pack(int(counts[STORED]), int(counts[EXISTING]),
                         int(counts[REFUSED_CRC])) + outcome.astype(np.uint8).tobytes()


def decode_put_reply(body: bytes, n: int) -> PutOutcome:
    if len(body) != _PUT_REP.size + n:
        raise ValueError(f"STAGE_PUT answer of {len(body)} bytes for {n} blocks")
    stored, existing, refused = _PUT_REP.unpack_from(body)
    return PutOutcome(stored, existing, refused, body[_PUT_REP.size:])


# -- STAGE_FREE -----------------------------------------------------------------------
def encode_free(region_id: int) -> bytes:
    return _FREE.pack(region_id)


def decode_free(body: Body) -> int:
    if len(body) != _FREE.size:
        raise ValueError(f"STAGE_FREE body of {len(body)} bytes (expected {_FREE.size})")
    return int(_FREE.unpack(body)[0])
