"""Copies fetched from other nodes are served only while the cluster index still names
the entry they were fetched under (docs/pod.md, "Deletes and re-puts across nodes").

A node adopts a fetched block as a *copy* (``Block.origin`` = the packed entry it was
fetched under). Its own blocks are served from the local index as always; a copy is
checked in the Lookup's (and Acquire's) one index round trip: the keys that are copies
are asked along with the local misses, in the same HMGET. The copy stays a hit when the
index still names the same block of the same holder (holder, sequence number, length,
CRC32C: the holder republishing under a new epoch, or with a new tier or shared-flash
location, is the same block); otherwise it is dropped and the key is what the index now
says: a miss (deleted, or the holder is gone) or the new entry (re-put), fetched anew.
An index that cannot be reached gives no entries: copies are dropped (misses), the
node's own blocks are still served.

With the writer's Delete (and a Commit that re-puts a key whose removal was pending)
waiting for the index to confirm (:mod:`ctxmem_dpu.pod.publisher`), this makes the rule:
once a Delete has returned, no node serves the deleted bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, repeat
from operator import eq, is_, not_

from ctxmem_dpu.blocks import Block
from ctxmem_dpu.pod.entries import unpack_entry


def same_block(now: bytes, then: bytes) -> bool:
    """Whether two packed entries name the same block of the same holder (the epoch,
    tier and shared location may differ: the holder republished or demoted it)."""
    a, b = unpack_entry(now), unpack_entry(then)
    return a is not None and b is not None and (a.node_id, a.seq, a.nbytes, a.crc32c) \
        == (b.node_id, b.seq, b.nbytes, b.crc32c)


def keys_to_ask(keys: Sequence[bytes], local: Sequence[Block | None],
                copies: dict[bytes, Block]) -> tuple[list[bool], list[Block | None]]:
    """Per key, whether the index is asked (a local miss, or a fetched copy: the local
    block *is* the copy, or both are None), and the copy per key (``None``: not one).
    C-level maps: one dict probe and one identity test per key."""
    held = list(map(copies.get, keys))
    return list(map(is_, local, held)), held


def check(keys: Sequence[bytes], local: list[Block | None], ask: Sequence[bool],
          held: Sequence[Block | None], got: Sequence[bytes | None]
          ) -> tuple[list[bytes | None], list[Block]]:
    """Scatter the index's answer ``got`` (for the asked keys, in order) back: per key,
    the remote entry (``None`` for local hits and misses). Copies the index no longer
    names are set to ``None`` in ``local`` and returned (the caller drops them); a copy
    still named under a changed value (new epoch) gets that value as its origin, so the
    next check is one bytes comparison.

    In C for the common cases: each asked key's origin (``None`` for a miss) compared
    with its value in one ``map``; when all are equal (every copy still named, no miss
    has an entry) nothing else is done, else only the keys that differ are looked at."""
    remote: list[bytes | None] = [None] * len(keys)
    asked_held = list(compress(held, ask))
    same = list(map(eq, map(getattr, asked_held, repeat("origin"), repeat(None)), got))
    if all(same):
        return remote, []
    where = list(compress(range(len(keys)), ask))
    stale: list[Block] = []
    for j in compress(range(len(same)), map(not_, same)):
        i, v, b = where[j], got[j], asked_held[j]
        if b is None:
            remote[i] = v
        elif v is not None and b.origin is not None and same_block(v, b.origin):
            b.origin = v
        else:
            stale.append(b)
            local[i] = None
            remote[i] = v
    return remote, stale
