"""Namespaces and block keys.

* A **namespace** is ``(tenant, model id, layout digest, tags[, weights revision])``.
  Tenants never share one; each has its own encryption key. Tags carry what else must
  separate caches (vLLM's ``cache_salt``, LMCache's world size and worker id): two
  requests whose tags differ never see each other's blocks. The weights revision (a
  digest or revision id of the model's weights, issue 25 item 6) keeps KV computed with
  one set of weights from being served to another under the same model id.
* A **block key** is the engine's own block hash: opaque bytes, 1 to 64 long. Engines
  hash token blocks as a chain (a block's hash covers every token before it), so
  "how many leading keys are stored" is the question Lookup answers.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ctxmem_common.errors import InvalidArgument
from ctxmem_common.layout import KVLayout

MAX_KEY_BYTES = 64
MAX_NAME_BYTES = 256
#: Keys in one Lookup: bounds the service's work and memory per request (100,000 keys
#: of 32 bytes is a 3.2 MB message and ~15 ms; the gRPC message limit is 64 MiB).
MAX_LOOKUP_KEYS = 262_144


def namespace_digest(
    tenant: str, model_id: str, layout: KVLayout, tags: Mapping[str, str] | None = None,
    weights_revision: str = "",
) -> bytes:
    """16-byte identity of a namespace; what the flash records carry.

    ``weights_revision`` (optional, at most :data:`MAX_NAME_BYTES` bytes): which weights
    the KV was computed with. Empty leaves the digest exactly as before it existed (blocks
    stored by earlier versions stay readable); a non-empty one is hashed after the tags,
    marked and length-prefixed. The tags' encoding is self-delimiting (a count, then
    length-prefixed fields), so no namespace without a revision shares a digest with one
    that has a revision."""
    for what, value in (("tenant", tenant), ("model_id", model_id)):
        if not value or len(value.encode()) > MAX_NAME_BYTES:
            raise InvalidArgument(f"{what} must be 1..{MAX_NAME_BYTES} bytes, got {value!r}")
    if len(weights_revision.encode()) > MAX_NAME_BYTES:
        raise InvalidArgument(f"weights_revision must be at most {MAX_NAME_BYTES} bytes, got "
                              f"{len(weights_revision.encode())}")
    h = hashlib.sha256(b"ctxmem-ns-v2")
    for part in (tenant, model_id):
        h.update(_field(part.encode()))
    h.update(layout.digest())
    # Tags: a count, then each key and value length-prefixed on its own, sorted by key.
    # (v1 hashed "k=v" joined, so {"a": "b=c"} and {"a=b": "c"} shared a digest.)
    items = sorted((k.encode(), v.encode()) for k, v in (tags or {}).items())
    h.update(len(items).to_bytes(4, "little"))
    for k, v in items:
        h.update(_field(k) + _field(v))
    if weights_revision:
        h.update(b"weights-revision" + _field(weights_revision.encode()))
    return h.digest()[:16]


def _field(data: bytes) -> bytes:
    """``data`` prefixed with its length (u32 little-endian): no two sequences of fields
    concatenate to the same bytes."""
    return len(data).to_bytes(4, "little") + data


def validate_keys(keys: Sequence[bytes]) -> int:
    """Reject a batch with an empty, oversized or duplicate key, naming the index.
    Returns the keys' common length when they are all ``bytes`` of one length (what the
    binary fast path packs, so a get need not measure them again in :func:`pack_keys`),
    else 0.

    The common case (all valid) runs as C-level passes (``map``/``set``/``min``/``max``):
    a 10,000-key Lookup spends well under a millisecond here. Only a bad batch takes the
    slow path that finds and names the culprit.
    """
    if not keys:
        return 0
    if set(map(type, keys)) <= {bytes}:
        lens = set(map(len, keys))
        if min(lens) >= 1 and max(lens) <= MAX_KEY_BYTES and len(set(keys)) == len(keys):
            return lens.pop() if len(lens) == 1 else 0
    _explain_bad_keys(keys)
    return 0  # valid, but not all bytes (bytearray keys)


def _explain_bad_keys(keys: Sequence[bytes]) -> None:
    seen: dict[bytes, int] = {}
    for i, key in enumerate(keys):
        if not isinstance(key, (bytes, bytearray)):
            raise InvalidArgument(f"keys[{i}] must be bytes, got {type(key).__name__}")
        if not 1 <= len(key) <= MAX_KEY_BYTES:
            raise InvalidArgument(
                f"keys[{i}] is {len(key)} bytes; block keys must be 1..{MAX_KEY_BYTES} bytes "
                f"(hash longer engine keys down, e.g. with sha256)"
            )
        first = seen.setdefault(bytes(key), i)
        if first != i:
            raise InvalidArgument(
                f"keys[{i}] duplicates keys[{first}] ({bytes(key).hex()[:16]}...) in one batch; "
                f"send each block once per request"
            )


def pack_keys(keys: Sequence[bytes]) -> tuple[bytes, int] | None:
    """``(concatenation, key length)`` when every key has the same length, else None.

    Two C-level passes: ``join``, and ``countOf`` of the first key's length over the
    lengths (no per-key Python; ``countOf`` compares ints by identity first, so it is
    ~25% cheaper than ``min``, which orders each pair)."""
    if not keys:
        return None
    n, key_len = len(keys), len(keys[0])
    if operator.countOf(map(len, keys), key_len) != n:
        return None
    return b"".join(keys), key_len


def unpack_keys(packed: bytes, key_len: int, max_keys: int = MAX_LOOKUP_KEYS) -> list[bytes]:
    """Split :func:`pack_keys` output back into keys, checked as :func:`validate_keys`
    would (length, no duplicates): :func:`packed_key_array`, then one ``tolist``."""
    keys: list[bytes] = packed_key_array(packed, key_len, max_keys).tolist()
    return keys


def packed_key_array(packed: bytes | memoryview, key_len: int, max_keys: int = MAX_LOOKUP_KEYS
                     ) -> np.ndarray:
    """:func:`pack_keys` output as a read-only numpy array of ``V{key_len}`` (a view of
    ``packed``, no Python object per key), checked as :func:`validate_keys` would.

    Why an array: a prefix Lookup turns only the keys it probes into ``bytes``
    (``arr[a:b].tolist()``, one C call), not all of them. Every input is bounded before
    anything is allocated: ``key_len`` must be 1..MAX_KEY_BYTES, ``packed`` a multiple
    of it, and hold at most ``max_keys`` keys (a 64 MiB message of 1-byte keys would
    otherwise become 64 million objects). Duplicates are ruled out by sorting each key's
    first 8 bytes as one uint64 (numpy); only when two of those are equal does the exact
    check run, and name the duplicate."""
    if not 1 <= key_len <= MAX_KEY_BYTES or len(packed) % key_len:
        raise InvalidArgument(
            f"packed_keys is {len(packed)} bytes, not a multiple of key_len={key_len} "
            f"(which must be 1..{MAX_KEY_BYTES})")
    n = len(packed) // key_len
    check_key_count(n, max_keys)
    arr = np.frombuffer(packed, dtype=f"V{key_len}")
    if n > 1 and _heads_repeat(packed, key_len, n):
        validate_keys(arr.tolist())  # exact: names the duplicate, or passes on a collision
    return arr


def _heads_repeat(packed: bytes | memoryview, key_len: int, n: int) -> bool:
    """Whether two of the ``n`` keys share their first 8 bytes (zero-padded; exact for
    keys of 8 bytes or fewer). One strided copy of 8 bytes per key and one sort, in C."""
    heads: np.ndarray[Any, Any]
    if key_len >= 8:  # the heads read in place: a strided uint64 view of the buffer
        heads = np.ndarray((n,), dtype="<u8", buffer=packed, offset=0, strides=(key_len,))
    else:
        rows = np.frombuffer(packed, dtype=np.uint8).reshape(n, key_len)
        padded = np.zeros((n, 8), dtype=np.uint8)
        padded[:, :key_len] = rows
        heads = padded.view("<u8").ravel()
    ordered = np.sort(heads)
    return bool((ordered[1:] == ordered[:-1]).any())


def check_key_count(n: int, max_keys: int = MAX_LOOKUP_KEYS) -> None:
    """Refuse a request of more than ``max_keys`` keys before any work is done on it."""
    if n > max_keys:
        raise InvalidArgument(
            f"request holds {n} keys; one request takes at most {max_keys} (split the batch)")


def chain_hashes(
    tokens: Sequence[int] | np.ndarray, tokens_per_block: int, *, salt: bytes = b""
) -> list[bytes]:
    """Chained 32-byte keys, one per *full* block of ``tokens``.

    ``key[i] = sha256(key[i-1] || salt || tokens of block i as little-endian int64)``
    with ``key[-1]`` empty, so a key identifies the whole prefix up to its block, and a
    ``salt`` (e.g. a per-user cache salt) separates otherwise equal prefixes.
    Deterministic across processes and restarts (unlike Python's ``hash``).
    """
    if tokens_per_block < 1:
        raise InvalidArgument(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    arr = np.ascontiguousarray(np.asarray(tokens, dtype="<i8"))
    n_full = len(arr) // tokens_per_block
    keys: list[bytes] = []
    prev = b""
    for i in range(n_full):
        block = arr[i * tokens_per_block : (i + 1) * tokens_per_block]
        prev = hashlib.sha256(prev + salt + block.tobytes()).digest()
        keys.append(prev)
    return keys
