"""Block groups as a unit when a member leaves: its siblings are reclaimed.

A block group (docs/architecture.md, "Block groups") is the same key in several member
namespaces; a group load needs every member. So once one member's block of a key leaves
the index (evicted from the last tier that held it, dropped after failing its checks,
deleted), the other members' blocks of that key can never be part of a group hit again
until the missing member is put back: they are dead weight. :class:`GroupSiblings`
removes them, as a Delete would (flash headers zeroed, so a restart does not bring them
back either), off the path that removed the first member.

Which namespaces are members of which groups is learned from the requests (every group
Commit, Lookup and Acquire declares its members) and kept in memory only: after a restart
a group is known again from its first group call. Stragglers a crash left behind (members
durable without their siblings) are not removed by this (nothing left the index): they are
misses for the group and age out of the LRU. At most :data:`MAX_GROUPS` groups are
remembered; beyond that, new groups are not (their stragglers age out the same way).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

from ctxmem_dpu.blocks import Block
from ctxmem_dpu.store.context import StoreContext
from ctxmem_dpu.store.index import BlockIndex

log = logging.getLogger("ctxmem_dpu.store")

#: The most groups (distinct member sets) remembered.
MAX_GROUPS = 4096


class GroupSiblings:
    """Reclaims a group's other members of a key once one member's block of it left the
    index. ``drop(digest, keys)`` deletes keys of one namespace (the store's delete)."""

    def __init__(self, ctx: StoreContext, index: BlockIndex,
                 drop: Callable[[bytes, Sequence[bytes]], Awaitable[int]]) -> None:
        self._ctx = ctx
        self._index = index
        self._drop = drop
        self._groups: set[tuple[bytes, ...]] = set()
        self._of: dict[bytes, set[tuple[bytes, ...]]] = {}
        # Namespace digest → keys that left it, waiting for their siblings' reclaim.
        self._pending: dict[bytes, set[bytes]] = {}
        self._draining = False
        index.listeners.append(self._on_block)

    def declare(self, digests: Sequence[bytes]) -> None:
        """``digests`` (two or more member namespaces) are a group."""
        g = tuple(digests)
        if len(g) < 2 or g in self._groups or len(self._groups) >= MAX_GROUPS:
            return
        self._groups.add(g)
        for d in g:
            self._of.setdefault(d, set()).add(g)

    def _on_block(self, b: Block, present: bool) -> None:
        if present or b.origin is not None or b.ns not in self._of or self._ctx.closed:
            return
        self._pending.setdefault(b.ns, set()).add(b.key)
        if not self._draining:
            self._draining = True
            self._ctx.io.spawn(self._drain())

    async def _drain(self) -> None:
        try:
            while self._pending and not self._ctx.closed:
                digest, keys = self._pending.popitem()
                lost = self._index.get(digest)
                # Put back meanwhile (a group put wrote the missing member): keep the rest.
                gone = [k for k in keys if k not in lost]
                siblings = {d for g in self._of.get(digest, ()) for d in g if d != digest}
                for sib in siblings:
                    held = self._index.get(sib)
                    ks = [k for k in gone if k in held]
                    if ks:
                        n = await self._drop(sib, ks)
                        self._ctx.counters["group_members_reclaimed"] += n
        except Exception:
            log.exception("reclaiming block-group members failed (they age out instead)")
        finally:
            self._draining = False
            if self._pending and not self._ctx.closed:
                self._draining = True
                self._ctx.io.spawn(self._drain())
