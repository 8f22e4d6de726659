"""Bodies of the shared-memory control fast path (frames in :mod:`ctxmem_common.wire`).

Why: on the shared-memory transport a get or a put of one batch is two gRPC round trips
(Acquire + Release, Allocate + Commit) around one memcpy, and those round trips cost as
much as the copy (docs/benchmarks.md, issue 17). The client's Unix socket is already
bound to its session by HELLO, so the same calls go over it as small binary frames: no
protobuf object per key or per slot, no HTTP/2. Both ends use the encoders and decoders
here; every array is one numpy call, never a Python loop over keys or slots.

Bodies (all integers little-endian; ``keys`` are ``n`` keys of ``key_len`` bytes each,
packed as :func:`ctxmem_common.keys.pack_keys` does)::

    ACQUIRE  req  handle u32, key_len u32, keys
             rep  lease_id 16B, n u32, regions u32[n], generations u32[n],
                  offsets u64[n], lengths u64[n], crcs u32[n], source tiers u8[n]
    RELEASE  req  flags u32 (bit 0: send no reply), n u32, lease ids 16B[n]
             rep  valid u8[n]
    LOOKUP   req  handle u32, prefix u32, key_len u32, keys
             rep  num_hits u32, tier codes u8[...] (pb.Tier, as LookupResponse.tier_codes)
    ALLOCATE req  handle u32, key_len u32, keys
             rep  allocation_id 16B, n_keys u32, n_slots u32, exists u8[n_keys],
                  regions u32[m], generations u32[m], offsets u64[m], lengths u64[m]
    COMMIT   req  allocation_id 16B, abort u32, n u32, crcs u32[n]
             rep  committed u32

An error reply (status ``Status.ERROR``) carries the :class:`~ctxmem_common.errors.
ErrorCode` and the message, so the client raises the same class as over gRPC
(:func:`encode_error` / :func:`decode_error`). Decoders trust nothing: a body whose
length disagrees with its counts raises :class:`ValueError` naming what was wrong (the
service answers that BAD_REQUEST and closes the connection; the client treats a
malformed answer as a broken channel).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ctxmem_common.errors import CtxmemError, ErrorCode, InvalidArgument, error_for_code
from ctxmem_common.keys import MAX_KEY_BYTES, MAX_LOOKUP_KEYS, packed_key_array
from ctxmem_common.packed_slots import PackedSlots
from ctxmem_common.wire import ID_BYTES

__all__ = [
    "RELEASE_NO_REPLY",
    "AcquireReply",
    "AllocateReply",
    "KeysRequest",
    "decode_acquire_reply",
    "decode_allocate_reply",
    "decode_commit",
    "decode_commit_reply",
    "decode_error",
    "decode_keys_request",
    "decode_lookup_reply",
    "decode_release",
    "decode_release_reply",
    "encode_acquire_reply",
    "encode_allocate_reply",
    "encode_commit",
    "encode_commit_reply",
    "encode_error",
    "encode_keys_request",
    "encode_lookup_reply",
    "encode_release",
    "encode_release_reply",
    "slot_arrays_nbytes",
]

_U8 = np.dtype("u1")
_U32 = np.dtype("<u4")
_U64 = np.dtype("<u8")
_SLOT_BYTES = 4 + 4 + 8 + 8  # region, generation, offset, length

_KEYS = struct.Struct("<II")  # handle, key_len (ACQUIRE, ALLOCATE)
_LOOKUP = struct.Struct("<III")  # handle, prefix, key_len
_ACQ_REP = struct.Struct(f"<{ID_BYTES}sI")
_RELEASE = struct.Struct("<II")
_ALLOC_REP = struct.Struct(f"<{ID_BYTES}sII")
_COMMIT = struct.Struct(f"<{ID_BYTES}sII")
_U32S = struct.Struct("<I")
_ERR = struct.Struct("<H")

Body = bytes | bytearray  # a request body as the service received it (not copied)

RELEASE_NO_REPLY = 1  # RELEASE flag: the client reads no answer (a verified get's release)


@dataclass(frozen=True)
class KeysRequest:
    """A decoded ACQUIRE, ALLOCATE or LOOKUP request; ``keys`` is the checked numpy array
    of :func:`~ctxmem_common.keys.packed_key_array` (``V{key_len}``)."""

    handle: int
    prefix: bool
    keys: np.ndarray


def slot_arrays_nbytes(n: int) -> int:
    return n * _SLOT_BYTES


def _arr(raw: memoryview | bytes | bytearray, offset: int, dtype: np.dtype, n: int) -> np.ndarray:
    return np.frombuffer(raw, dtype=dtype, count=n, offset=offset)


# -- requests with keys ---------------------------------------------------------------
def encode_keys_request(handle: int, packed: bytes, key_len: int,
                        prefix: bool | None = None) -> list[bytes]:
    """ACQUIRE / ALLOCATE (``prefix`` None) or LOOKUP body, as parts for one sendmsg."""
    head = (_KEYS.pack(handle, key_len) if prefix is None
            else _LOOKUP.pack(handle, int(prefix), key_len))
    return [head, packed]


def decode_keys_request(body: Body, lookup: bool) -> KeysRequest:
    """The handle and the keys, checked by :func:`packed_key_array` (1..64-byte keys, no
    duplicates, at most MAX_LOOKUP_KEYS): InvalidArgument otherwise, ValueError for a
    body too short for its header."""
    st = _LOOKUP if lookup else _KEYS
    if len(body) < st.size:
        raise ValueError(f"body of {len(body)} bytes is shorter than its {st.size}-byte header")
    if lookup:
        handle, prefix, key_len = _LOOKUP.unpack_from(body)
    else:
        (handle, key_len), prefix = _KEYS.unpack_from(body), 0
    if not 1 <= key_len <= MAX_KEY_BYTES:  # every key has this length: name the first
        raise InvalidArgument(
            f"keys[0] is {key_len} bytes; block keys must be 1..{MAX_KEY_BYTES} bytes "
            f"(hash longer engine keys down, e.g. with sha256)")
    # A view, not a copy of up to 16 MiB: the array refers to ``body``, which the caller
    # no longer changes.
    keys = packed_key_array(memoryview(body)[st.size:], key_len, MAX_LOOKUP_KEYS)
    return KeysRequest(handle, bool(prefix), keys)


# -- ACQUIRE --------------------------------------------------------------------------
def encode_acquire_reply(lease_id: bytes, regions: Sequence[int] | np.ndarray,
                         generations: Sequence[int] | np.ndarray,
                         offsets: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray,
                         crcs: Sequence[int] | np.ndarray, tier_codes: Sequence[int]) -> bytes:
    """The answer's body; numpy arrays of the wire's dtypes (what the service's
    ``lease_slots`` returns) are written as they are, with no conversion."""
    n = len(regions)
    return b"".join((
        _ACQ_REP.pack(lease_id, n), np.asarray(regions, _U32).tobytes(),
        np.asarray(generations, _U32).tobytes(), np.asarray(offsets, _U64).tobytes(),
        np.asarray(lengths, _U64).tobytes(), np.asarray(crcs, _U32).tobytes(),
        bytes(tier_codes)))


@dataclass(frozen=True)
class AcquireReply:
    lease_id: bytes
    slots: PackedSlots
    tier_codes: bytes


def decode_acquire_reply(body: bytes, requested: int, block_nbytes: int) -> AcquireReply:
    """Checked as :func:`~ctxmem_common.packed_slots.unpack_acquire` checks a gRPC answer:
    at most ``requested`` blocks, a body exactly that long, every length ``block_nbytes``."""
    if len(body) < _ACQ_REP.size:
        raise ValueError(f"ACQUIRE answer of {len(body)} bytes is shorter than its header")
    lease_id, n = _ACQ_REP.unpack_from(body)
    want = _ACQ_REP.size + n * (_SLOT_BYTES + 4 + 1)
    if n > requested or len(body) != want:
        raise ValueError(f"ACQUIRE answer for lease {lease_id.hex()}: {n} blocks for "
                         f"{requested} keys in {len(body)} bytes (expected {want})")
    off = _ACQ_REP.size
    out = []
    for dtype in (_U32, _U32, _U64, _U64, _U32):
        out.append(_arr(body, off, dtype, n))
        off += n * dtype.itemsize
    lengths = out[3]
    if n and (int(lengths.min()) != block_nbytes or int(lengths.max()) != block_nbytes):
        raise ValueError(f"ACQUIRE answer for lease {lease_id.hex()}: slot lengths differ "
                         f"from the block size {block_nbytes}")
    r, g, o, ln, c = (a.tolist() for a in out)
    return AcquireReply(lease_id, PackedSlots(r, g, o, ln, c, arrays=(
        out[0], out[1], out[2], out[3])), body[off:])


# -- RELEASE --------------------------------------------------------------------------
def encode_release(lease_ids: Sequence[bytes], no_reply: bool) -> bytes:
    return _RELEASE.pack(RELEASE_NO_REPLY if no_reply else 0, len(lease_ids)) + b"".join(
        lease_ids)


def decode_release(body: Body) -> tuple[list[bytes], bool]:
    """(lease ids, whether the client wants an answer); ValueError if the count and the
    length disagree or the flags are unknown."""
    if len(body) < _RELEASE.size:
        raise ValueError(f"RELEASE body of {len(body)} bytes is shorter than its header")
    flags, n = _RELEASE.unpack_from(body)
    if flags & ~RELEASE_NO_REPLY or len(body) != _RELEASE.size + n * ID_BYTES:
        raise ValueError(f"RELEASE of {n} leases (flags {flags:#x}) in {len(body)} bytes")
    ids: list[bytes] = np.frombuffer(body, dtype=f"V{ID_BYTES}", count=n,
                                     offset=_RELEASE.size).tolist()
    return ids, not flags & RELEASE_NO_REPLY


def encode_release_reply(valid: Sequence[bool]) -> bytes:
    return bytes(map(bool, valid))


def decode_release_reply(body: bytes, n: int) -> list[bool]:
    if len(body) != n:
        raise ValueError(f"RELEASE answer of {len(body)} bytes for {n} leases")
    return [b != 0 for b in body]


# -- LOOKUP ---------------------------------------------------------------------------
def encode_lookup_reply(num_hits: int, codes: Sequence[int]) -> bytes:
    return _U32S.pack(num_hits) + bytes(codes)


def decode_lookup_reply(body: bytes, requested: int) -> tuple[int, bytes]:
    """(num_hits, one pb.Tier code per answered key)."""
    if len(body) < _U32S.size or len(body) - _U32S.size > requested:
        raise ValueError(f"LOOKUP answer of {len(body)} bytes for {requested} keys")
    (hits,) = _U32S.unpack_from(body)
    return hits, body[_U32S.size:]


# -- ALLOCATE -------------------------------------------------------------------------
def encode_allocate_reply(allocation_id: bytes, exists: Sequence[bool],
                          regions: Sequence[int], generations: Sequence[int],
                          offsets: Sequence[int], lengths: Sequence[int]) -> bytes:
    return b"".join((
        _ALLOC_REP.pack(allocation_id, len(exists), len(regions)), bytes(map(bool, exists)),
        np.asarray(regions, _U32).tobytes(), np.asarray(generations, _U32).tobytes(),
        np.asarray(offsets, _U64).tobytes(), np.asarray(lengths, _U64).tobytes()))


@dataclass(frozen=True)
class AllocateReply:
    allocation_id: bytes
    exists: list[bool]
    slots: PackedSlots  # crcs empty


def decode_allocate_reply(body: bytes, requested: int, block_nbytes: int) -> AllocateReply:
    """Checked: one ``exists`` per key asked for, one slot per key not stored, a body
    exactly that long, every slot ``block_nbytes`` long."""
    if len(body) < _ALLOC_REP.size:
        raise ValueError(f"ALLOCATE answer of {len(body)} bytes is shorter than its header")
    aid, nk, m = _ALLOC_REP.unpack_from(body)
    want = _ALLOC_REP.size + nk + m * _SLOT_BYTES
    if nk != requested or len(body) != want:
        raise ValueError(f"ALLOCATE answer for allocation {aid.hex()}: {nk} keys and {m} "
                         f"slots for {requested} keys in {len(body)} bytes (expected {want})")
    off = _ALLOC_REP.size
    exists = _arr(body, off, _U8, nk)
    if int(np.count_nonzero(exists == 0)) != m:
        raise ValueError(f"ALLOCATE answer for allocation {aid.hex()}: {m} slots for "
                         f"{int(np.count_nonzero(exists == 0))} keys not stored")
    off += nk
    out = []
    for dtype in (_U32, _U32, _U64, _U64):
        out.append(_arr(body, off, dtype, m))
        off += m * dtype.itemsize
    if m and (int(out[3].min()) != block_nbytes or int(out[3].max()) != block_nbytes):
        raise ValueError(f"ALLOCATE answer for allocation {aid.hex()}: slot lengths differ "
                         f"from the block size {block_nbytes}")
    r, g, o, ln = (a.tolist() for a in out)
    return AllocateReply(aid, (exists != 0).tolist(), PackedSlots(r, g, o, ln, [], arrays=(
        out[0], out[1], out[2], out[3])))


# -- COMMIT ---------------------------------------------------------------------------
def encode_commit(allocation_id: bytes, crcs: Sequence[int], abort: bool) -> bytes:
    return _COMMIT.pack(allocation_id, int(abort), len(crcs)) + np.asarray(
        crcs, _U32).tobytes()


def decode_commit(body: Body) -> tuple[bytes, list[int], bool]:
    """(allocation id, CRCs, abort); ValueError if the count and the length disagree."""
    if len(body) < _COMMIT.size:
        raise ValueError(f"COMMIT body of {len(body)} bytes is shorter than its header")
    aid, abort, n = _COMMIT.unpack_from(body)
    if abort > 1 or len(body) != _COMMIT.size + 4 * n:
        raise ValueError(f"COMMIT of {n} CRCs (abort {abort}) in {len(body)} bytes")
    crcs: list[int] = _arr(body, _COMMIT.size, _U32, n).tolist()
    return aid, crcs, bool(abort)


def encode_commit_reply(committed: int) -> bytes:
    return _U32S.pack(committed)


def decode_commit_reply(body: bytes) -> int:
    if len(body) != _U32S.size:
        raise ValueError(f"COMMIT answer of {len(body)} bytes")
    (n,) = _U32S.unpack(body)
    return int(n)


# -- errors ---------------------------------------------------------------------------
def encode_error(exc: CtxmemError) -> bytes:
    code = exc.code.value.encode()
    return _ERR.pack(len(code)) + code + exc.message.encode(errors="replace")


def decode_error(body: bytes) -> CtxmemError:
    """The exception the service raised (the same class as over gRPC)."""
    if len(body) < _ERR.size:
        return CtxmemError("malformed error answer on the shared-memory fast path")
    (k,) = _ERR.unpack_from(body)
    code = body[_ERR.size:_ERR.size + k].decode(errors="replace")
    message = body[_ERR.size + k:].decode(errors="replace")
    return error_for_code(code or ErrorCode.INTERNAL.value, message)
