"""The Tier contract: what a storage tier (DRAM, flash) offers the block store.

A tier hands out *slots*: fixed-size places for one block each, of a slot size the store
chooses per namespace (the block size rounded up to 4 KiB). What a slot is depends on the
tier (a :class:`~ctxmem_dpu.alloc.SlotRef` in a DRAM slab, an
:class:`~ctxmem_dpu.tiers.flash.Extent` on one of several flash devices), so the contract
is generic in it; how bytes get into a slot is the tier's own API (DRAM views, flash
record I/O), not part of the contract.

Every implementation runs the shared conformance suite in
``tests/dpu/tiers/tier_conformance.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from types import TracebackType
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from typing_extensions import Self

SlotT = TypeVar("SlotT", bound=Hashable)


class Tier(ABC, Generic[SlotT]):
    """A tier of fixed-size slots: allocate and free them, report capacity and usage.

    A context manager: leaving it closes the tier (its memory, its devices)."""

    @abstractmethod
    def allocate(self, slot_size: int, n: int, owner: str | None = None
                 ) -> list[SlotT] | None:
        """``n`` slots of ``slot_size`` bytes, all or nothing: ``None`` (and nothing taken)
        when they do not fit. ``owner`` is the tenant the slots are for: a tier whose
        memory clients map (DRAM) never puts two owners' slots in one slab; a tier only
        the service reads (flash) may ignore it."""

    @abstractmethod
    def free(self, slot: SlotT) -> None:
        """Give back one slot from :meth:`allocate`; it may be handed out again."""

    @abstractmethod
    def capacity_bytes(self) -> int:
        """Bytes the tier can hold in all (fixed for its lifetime)."""

    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes of the slots in use (allocated or claimed, and not freed), at their
        slot sizes."""

    @abstractmethod
    def close(self) -> None:
        """Release the tier's memory or devices; calling it again does nothing."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
