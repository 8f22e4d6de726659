"""Where a remote block can come from: the base class every fetch source implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from ctxmem_dpu.pod.entries import RemoteEntry


class RemoteSource(ABC):
    """One way to get blocks another node holds (peer fetch, shared flash).

    :meth:`fetch` returns, per entry, the block's bytes or ``None`` (a miss): a source
    never raises for a missing, stale or unreachable block, and never waits past its own
    timeout. **A source returns only bytes it verified**: their authenticator checked
    under this node's own key of the namespace
    (:class:`~ctxmem_common.codecs.blockauth.BlockAuthenticator`), never against anything
    the index or a peer supplied; it says so with :attr:`verifies`. The fetch path adopts
    nothing from a source that does not (``pod_fetch_unauthenticated``), and checks every
    returned block's length and CRC32C against the index entry again (an accident
    check: the index proves nothing).
    """

    #: Short name for Stats and /metrics (``pod_fetch_blocks_<name>``).
    name: str = "source"
    #: Every block :meth:`fetch` returns was verified under the namespace's
    #: authenticator key (docs/security.md, "The pod's keys").
    verifies: bool = False
    #: :meth:`fetch_into` lands each block in the caller's buffer itself (no buffer of
    #: its own, no copy) and checks it there, in the same pass as its authenticator:
    #: length and CRC32C against the entry. The fetch path then reads it no more; for
    #: the others it copies what :meth:`fetch` returned and checks the copy.
    lands: bool = False

    def accepts(self, entry: RemoteEntry) -> bool:
        """Whether this source can try ``entry`` at all (cheap, no I/O)."""
        return True

    @abstractmethod
    async def fetch(self, ns_digest: bytes, entries: Sequence[RemoteEntry]
                    ) -> list[bytes | None]:
        """The bytes of each entry's block, or ``None`` for a miss."""

    async def fetch_into(self, ns_digest: bytes, entries: Sequence[RemoteEntry],
                         views: Sequence[memoryview]) -> list[bool]:
        """With :attr:`lands`: per entry, whether its block, verified, now lies in
        ``views[i]`` (``len(views[i]) == entries[i].nbytes``; a miss may leave anything
        there)."""
        raise NotImplementedError(f"source {self.name} does not land blocks in place")

    async def close(self) -> None:  # noqa: B027 (optional hook: most sources hold nothing)
        """Release connections; idempotent."""
