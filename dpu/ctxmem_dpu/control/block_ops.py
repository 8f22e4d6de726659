"""The block operations both control paths serve: gRPC (:mod:`.servicer`) and the binary
fast path on the shared-memory socket and the TCP data channel
(:mod:`ctxmem_dpu.transport.shm_fastpath`).

Why one place: the fast path must refuse exactly what gRPC refuses (an unknown session,
a namespace, lease or allocation of another session, a Commit without one CRC per slot,
too many or bad keys) and answer exactly what it answers. Each function takes the
store, the session's id (looked up live on every call, so an ended session is refused
at once) and decoded arguments, and returns plain values; the callers only encode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import numpy as np

from ctxmem_common.errors import InvalidArgument
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.protoconv import (
    TIER_DRAM,
    TIER_FLASH,
    TIER_NONE,
    TIER_REMOTE,
    TIER_REMOTE_DRAM,
    tier_to_pb,
)
from ctxmem_dpu.control.lookup_wire import tier_codes
from ctxmem_dpu.tiers.dram import int_array

if TYPE_CHECKING:
    from ctxmem_dpu.alloc import SlotRef
    from ctxmem_dpu.blocks import Allocation, Lease, Namespace, Session
    from ctxmem_dpu.store import BlockStore

__all__ = ["MAX_GROUP_MEMBERS", "LeaseSlots", "SlotArrays", "acquire", "allocate", "commit",
           "commit_group", "group_members", "group_tiers", "lease_slots", "lookup",
           "open_namespace"]

#: The most member namespaces a block group may have (KV groups and state pools of one
#: model: a handful in practice).
MAX_GROUP_MEMBERS = 64

# Per slot: region, generation, offset, length (and for a lease the committed CRC32C).
SlotArrays = tuple[list[int], list[int], list[int], list[int], list[int]]
# A lease's slots as numpy arrays: uint32 region, uint32 generation, uint64 offset,
# uint64 length, uint32 CRC32C (what encode_acquire_reply and pack_acquire write as is).
LeaseSlots = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
# A leased block's source tier as pb.Tier (a dict lookup per block, not a call).
_SOURCE_PB = {t: tier_to_pb(t) for t in (TIER_DRAM, TIER_FLASH, TIER_REMOTE, TIER_REMOTE_DRAM)}


def open_namespace(store: BlockStore, session_id: bytes, handle: int
                   ) -> tuple[Session, Namespace]:
    """The live session and its namespace ``handle``: UnknownSession, UnknownNamespace."""
    s = store.session(session_id)
    return s, store.namespace(s, handle)


def group_members(store: BlockStore, s: Session, ns: Namespace, handles: Sequence[int]
                  ) -> list[Namespace]:
    """A block group's member namespaces: ``ns`` first, then those of ``handles`` (the
    request's ``group_namespace_handles``), each open in ``s``; a handle named twice, or
    ``ns``'s own, or too many: InvalidArgument."""
    if len(handles) >= MAX_GROUP_MEMBERS:
        raise InvalidArgument(f"a block group has at most {MAX_GROUP_MEMBERS} member "
                              f"namespaces; the request names {len(handles) + 1}")
    members = [ns, *(store.namespace(s, h) for h in handles)]
    if len({m.digest for m in members}) != len(members):
        raise InvalidArgument("group_namespace_handles names a namespace twice (or the "
                              "request's own namespace_handle); name each member once")
    return members


_RANK = {TIER_NONE: 3, TIER_REMOTE: 2, TIER_FLASH: 1, TIER_DRAM: 0}


def group_tiers(per_member: Sequence[Sequence[str]], prefix: bool) -> tuple[int, list[str]]:
    """Combine the members' per-key tier names (one list per member, one name per key)
    into the group's: a key is held only when every member holds it, in the farthest of
    its members' tiers (remote, then flash, then DRAM). ``prefix``: the leading run only.
    Returns (hits, tier names)."""
    names = [max(col, key=_RANK.__getitem__) for col in zip(*per_member, strict=True)]
    if prefix:
        n = names.index(TIER_NONE) if TIER_NONE in names else len(names)
        return n, names[:n]
    return len(names) - names.count(TIER_NONE), names


def lookup(store: BlockStore, ns: Namespace, keys: Sequence[bytes] | np.ndarray,
           prefix: bool, checked: bool) -> tuple[int, list[pb.Tier]]:
    """(hits, one pb.Tier code per answered key) from this node's index."""
    found = store.lookup_blocks(ns, keys, prefix, checked=checked)
    n = len(found) if prefix else len(found) - found.count(None)
    return n, tier_codes(found)


async def acquire(store: BlockStore, s: Session, ns: Namespace, keys: Sequence[bytes],
                  keys_checked: bool = False) -> tuple[Lease, list[pb.Tier]]:
    """Lease the stored leading run of ``keys``: the lease and each block's source tier
    (pb.Tier codes). ``keys_checked``: see :meth:`BlockStore.acquire`."""
    lease, sources = await store.acquire(s, ns, keys, keys_checked=keys_checked)
    return lease, list(map(_SOURCE_PB.__getitem__, sources))


def lease_slots(store: BlockStore, lease: Lease) -> LeaseSlots:
    """Where each leased block lies in DRAM, with its committed CRC32C, as numpy arrays
    (one list comprehension per field, then :func:`int_array`; the reply is written from
    them with no further conversion)."""
    blocks = lease.blocks
    refs = [b.dram for b in blocks]
    try:
        slabs, gens, offsets = store.dram.slot_ndarrays(cast("list[SlotRef]", refs))
    except TypeError:  # a None among the refs (not checked apart: 9 µs per 1,024)
        raise AssertionError(f"lease {lease.id.hex()} holds a block not in DRAM") from None
    return (slabs, gens, offsets, int_array([b.length for b in blocks], wide=True),
            int_array([b.crc for b in blocks], wide=False))


async def allocate(store: BlockStore, s: Session, ns: Namespace, keys: Sequence[bytes]
                   ) -> tuple[Allocation, list[bool], SlotArrays]:
    """Reserve a slot per key not stored: the allocation, per key whether it exists, and
    the slots (CRCs empty)."""
    a, exists = await store.allocate(s, ns, keys)
    slabs, gens, offsets = store.dram.slot_arrays(a.slots)
    return a, exists, (slabs, gens, offsets, [ns.block_nbytes] * len(a.slots), [])


async def commit_group(store: BlockStore, session_id: bytes, allocation_id: bytes,
                       crcs: Sequence[int], group_ids: Sequence[bytes],
                       group_crcs: Sequence[int]) -> int:
    """Commit a block group's allocations together (``allocation_id`` with its ``crcs``,
    then ``group_ids``, whose CRCs ``group_crcs`` holds back to back); blocks committed."""
    s = store.session(session_id)
    ids = [allocation_id, *group_ids]
    if len(ids) > MAX_GROUP_MEMBERS:
        raise InvalidArgument(f"a block group has at most {MAX_GROUP_MEMBERS} member "
                              f"namespaces; the Commit names {len(ids)} allocations")
    per: list[Sequence[int]] = [crcs]
    at = 0
    for gid in group_ids:
        k = len(store.allocation(s, gid).slots)
        per.append(group_crcs[at : at + k])
        at += k
    if at != len(group_crcs):
        raise InvalidArgument(
            f"group Commit carries {len(group_crcs)} group_crc32c for {at} slots of its "
            f"group allocations; send the CRC32C of every block written, allocation after "
            f"allocation, in slot order")
    return await store.commit_group(s, ids, per)


async def commit(store: BlockStore, session_id: bytes, allocation_id: bytes,
                 crcs: Sequence[int], abort: bool) -> int:
    """Commit (or with ``abort`` give back) an allocation; blocks committed."""
    s = store.session(session_id)
    if not abort:
        # The client's CRC of every slot is required: without it a commit of slots
        # that were never written (stale bytes) would be accepted with a valid CRC.
        a = store.allocation(s, allocation_id)
        if len(crcs) != len(a.slots):
            raise InvalidArgument(
                f"Commit of allocation {a.id.hex()} carries {len(crcs)} CRC32Cs "
                f"for {len(a.slots)} slots; send the CRC32C of every block written, in "
                f"slot order (or abort=true to give the slots back)")
    return await store.commit(s, allocation_id, crcs, abort)
