"""Where a node fetches blocks another node of the pod holds."""

from __future__ import annotations

from collections.abc import Sequence

from ctxmem_dpu.pod.entries import RemoteEntry


class RemoteSource:
    """Fetches blocks named by the cluster index; ``None`` for each block it cannot
    return exactly (a miss)."""

    async def fetch(self, ns_digest: bytes, entries: Sequence[RemoteEntry]
                    ) -> list[bytes | None]:
        raise NotImplementedError
