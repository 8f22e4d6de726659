"""Deletes: a key's block leaves the index now, and its flash record dies before the
Delete returns.

Why a module of its own (issue 31 item 1): two callers delete, the facade (a client's
Delete) and :class:`~ctxmem_dpu.store.groups.GroupSiblings` (a group member's siblings,
reclaimed once one member left). Both call down into this; before, the group reclaim was
handed the facade's own method, a call back up into the object that built it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ctxmem_dpu import faults
from ctxmem_dpu.store.context import StoreContext
from ctxmem_dpu.store.index import BlockIndex, wait_io
from ctxmem_dpu.store.invalidation import Invalidator


class Deletes:
    """Removes keys of one namespace: out of the index at once, then (whatever happens to
    the request) each block's flash header zeroed and synced, and the block unpinned so
    that its last unpin frees the storage."""

    def __init__(self, ctx: StoreContext, index: BlockIndex, invalidator: Invalidator
                 ) -> None:
        self._ctx = ctx
        self._index = index
        self._invalidator = invalidator

    async def delete(self, digest: bytes, keys: Sequence[bytes]) -> int:
        """Remove ``keys`` (validated by the caller) of namespace ``digest``; returns how
        many were stored. When this returns, the deleted blocks' flash headers are zeroed
        and synced: a restart cannot bring them back."""
        # Pinned once each: ours until the header is dead; the last unpin frees the storage.
        gone = self._index.deleted(digest, keys)
        invalidator = self._invalidator

        async def invalidate() -> None:
            try:
                faults.point("delete.after_index")
                await wait_io(gone)  # a demotion in flight finishes (and sets b.flash)
                dead = [b.flash for b in gone if b.flash is not None]
                for b in gone:
                    b.flash = None
                if dead:
                    await invalidator.invalidate(dead, stage="delete")
            finally:
                for b in gone:
                    invalidator.unpin(b)

        # Out of the index now: the rest runs to its end even if this request is
        # cancelled, or the extents would be neither freed nor parked (leaked, their
        # headers still valid).
        await self._ctx.io.uncancellable(invalidate())
        self._ctx.counters["deleted_blocks"] += len(gone)
        return len(gone)
