"""What the cluster index says about one block: :class:`RemoteEntry`, packed compactly.

Redis layout (every key of one namespace shares the hash tag ``{NS}``, so a namespace's
keys sit in one Redis Cluster slot and batch in one command). The index holds no secret
and no oracle: ``NS`` and the fields are keyed hashes under the pod's index key
(:class:`~ctxmem_common.podkeys.PodKeys`), never a namespace digest (guessable from a
tenant name) or a block key (a prompt's chain hash):

* ``ctxmem:{NS}:blocks`` — a hash, NS = :meth:`PodKeys.index_tag` of the namespace
  digest, field = :meth:`PodKeys.index_fields` of the block key (16 bytes), value =
  packed entry;
* ``ctxmem:{nodes}:members`` — a hash, node id → advertised peer-fetch address;
* ``ctxmem:{nodes}:alive:ID`` — present while node ID is alive (a TTL its heartbeat
  refreshes). The node keys share the hash tag ``{nodes}`` (one Redis Cluster slot), so a
  heartbeat's pipeline and a multi-key EXISTS over several nodes never cross slots.

A packed entry: version (1 byte), node id (1-byte length + UTF-8), the holder's publish
epoch (u32), tier (1 byte), seq (u64), nbytes (u64), CRC32C (u32), shared flag (1 byte)
and, when set, the shared location (16-byte device UUID, offset u64, length u64).
28 + len(node id) bytes without a shared location, 60 + len(node id) with one.

The epoch changes each time a node republishes everything (its alive key had vanished):
a peer's lazy cleanup deletes an entry only if its value is still the exact one it saw
while the holder was dead, so a republished entry is never deleted by a cleanup that
raced with the holder's return.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

ENTRY_VERSION = 1
_TIERS = {"dram": 0, "flash": 1}
_TIER_NAMES = {v: k for k, v in _TIERS.items()}
_EPOCH = struct.Struct("!I")
_BODY = struct.Struct("!BQQIB")
_SHARED = struct.Struct("!16sQQ")


@dataclass(frozen=True, slots=True)
class SharedLocation:
    """Where a block lies on a flash namespace every pod member can read (part 3)."""

    device_uuid: str  # 32 hex digits
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class RemoteEntry:
    """One block another node holds. ``key`` is filled when read from the index (the
    peer looks the block up by it); the rest is what the holder published: where to
    look, never a proof (the CRC32C is an accident check; a fetched block is proven by
    its authenticator)."""

    node_id: str
    tier: str  # "dram" | "flash"
    seq: int
    nbytes: int
    crc32c: int
    shared: SharedLocation | None = None
    key: bytes = b""


def blocks_key(tag: str) -> str:
    """The Redis hash of a namespace's blocks, by its keyed tag
    (:meth:`~ctxmem_common.podkeys.PodKeys.index_tag`)."""
    return f"ctxmem:{{{tag}}}:blocks"


NODES_KEY = "ctxmem:{nodes}:members"


def alive_key(node_id: str) -> str:
    return f"ctxmem:{{nodes}}:alive:{node_id}"


def node_prefix(node_id: str) -> bytes:
    """The first bytes of every entry ``node_id`` publishes (the index's conditional
    deletes compare them)."""
    raw = node_id.encode()
    if not 0 < len(raw) < 256:
        raise ValueError(f"node id {node_id!r}: 1-255 bytes of UTF-8")
    return bytes((ENTRY_VERSION, len(raw))) + raw


def pack_entry(e: RemoteEntry, epoch: int = 0) -> bytes:
    """``e`` as the index stores it (``key`` is not packed: it is the hash field), under
    the holder's publish ``epoch``."""
    try:
        tier = _TIERS[e.tier]
    except KeyError:
        raise ValueError(f"entry tier {e.tier!r}: one of {sorted(_TIERS)}") from None
    out = node_prefix(e.node_id) + _EPOCH.pack(epoch & 0xFFFFFFFF) + _BODY.pack(
        tier, e.seq, e.nbytes, e.crc32c, e.shared is not None)
    if e.shared is not None:
        out += _SHARED.pack(bytes.fromhex(e.shared.device_uuid), e.shared.offset,
                            e.shared.length)
    return out


def unpack_entry(raw: bytes, key: bytes = b"") -> RemoteEntry | None:
    """The entry in ``raw``, or ``None`` when it is not one this version reads (a corrupt
    or foreign value is a miss, never an error)."""
    if len(raw) < 2 or raw[0] != ENTRY_VERSION:
        return None
    n = raw[1]
    at = 2 + n + _EPOCH.size
    if len(raw) < at + _BODY.size:
        return None
    try:
        node = raw[2:2 + n].decode()
    except UnicodeDecodeError:
        return None
    tier, seq, nbytes, crc, has_shared = _BODY.unpack_from(raw, at)
    at += _BODY.size
    shared = None
    if has_shared:
        if len(raw) != at + _SHARED.size:
            return None
        uuid, offset, length = _SHARED.unpack_from(raw, at)
        shared = SharedLocation(uuid.hex(), offset, length)
    elif len(raw) != at:
        return None
    if tier not in _TIER_NAMES:
        return None
    return RemoteEntry(node, _TIER_NAMES[tier], seq, nbytes, crc, shared, key)
