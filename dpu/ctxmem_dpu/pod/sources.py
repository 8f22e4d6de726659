"""Where a remote block can come from: the base class every fetch source implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from ctxmem_dpu.pod.entries import RemoteEntry


class RemoteSource(ABC):
    """One way to get blocks another node holds (peer fetch, shared flash).

    :meth:`fetch` returns, per entry, the block's bytes or ``None`` (a miss): a source
    never raises for a missing, stale or unreachable block, and never waits past its own
    timeout. The fetch path checks every returned block's length and CRC32C against the
    index entry again, so a source that returns wrong bytes causes a miss, not a wrong
    get.
    """

    #: Short name for Stats and /metrics (``pod_fetch_blocks_<name>``).
    name: str = "source"

    def accepts(self, entry: RemoteEntry) -> bool:
        """Whether this source can try ``entry`` at all (cheap, no I/O)."""
        return True

    @abstractmethod
    async def fetch(self, ns_digest: bytes, entries: Sequence[RemoteEntry]
                    ) -> list[bytes | None]:
        """The bytes of each entry's block, or ``None`` for a miss."""

    async def close(self) -> None:  # noqa: B027 (optional hook: most sources hold nothing)
        """Release connections; idempotent."""
