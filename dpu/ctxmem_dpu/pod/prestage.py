"""Pre-staging: the per-tenant bound on the remote blocks Prefetch pulls in the background
(docs/pod.md, "Pre-staging").

A Prefetch pulls the remote blocks of its request into this node's DRAM ahead of the get
(:meth:`ctxmem_dpu.pod.node.PodNode.prefetch`). Each pull first asks the cluster index
which of the keys are remote, then takes that many blocks from its tenant's budget
(``pod.prefetch_max_blocks_per_tenant`` in flight at once on this node): what does not fit
is not pulled (counted ``pod_prefetch_refused_blocks``; a get fetches those blocks on
demand, as without a Prefetch), so one tenant's prefetches hold at most that many DRAM
slots and peer transfers at a time and never crowd out another tenant's gets. The
budget is given back when the pull ends, whether its blocks landed or not.
"""

from __future__ import annotations

from collections import Counter


class TenantBudget:
    """Remote blocks each tenant's background pulls hold at once, bounded by ``limit``."""

    def __init__(self, limit: int, counters: Counter[str]) -> None:
        self.limit = limit
        self._counters = counters
        self._held: dict[str, int] = {}

    def held(self, tenant: str) -> int:
        """Blocks of ``tenant``'s pulls in flight now."""
        return self._held.get(tenant, 0)

    def take(self, tenant: str, n: int) -> int:
        """Admit up to ``n`` blocks of ``tenant``: how many fit under the limit (the
        leading ones of the pull's run); the rest are refused and counted."""
        held = self._held.get(tenant, 0)
        k = max(0, min(n, self.limit - held))
        if k:
            self._held[tenant] = held + k
            self._counters["pod_prefetch_admitted_blocks"] += k
        if n > k:
            self._counters["pod_prefetch_refused_blocks"] += n - k
        return k

    def give(self, tenant: str, k: int) -> None:
        """The pull that took ``k`` blocks of ``tenant`` ended."""
        if not k:
            return
        left = self._held.get(tenant, 0) - k
        if left > 0:
            self._held[tenant] = left
        else:
            self._held.pop(tenant, None)
        self._counters["pod_prefetch_done_blocks"] += k
