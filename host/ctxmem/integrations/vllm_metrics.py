"""What ``CtxmemConnector`` shows inside vLLM: stats, Prometheus metrics, KV events.

Workers count blocks loaded, blocks that failed to load (recomputed) and blocks saved;
vLLM aggregates the counts over workers (``KVConnectorStats.aggregate``), logs them
(``reduce``) and, under ``vllm serve``, exports them as Prometheus counters
(``vllm:ctxmem_loaded_blocks`` etc., one child per engine). Hit sources (DRAM, flash,
peer) go through vLLM's own ``get_external_cache_hit_sources`` hook instead: vLLM counts
them in its prefix-cache metrics by source. KV cache events: a ``BlockStored``
(medium ``ctxmem``) for every block the service accepted, published by vLLM's KV event
publisher (``--kv-events-config``) for cache-aware routers (llm-d, Dynamo). ctxmem
evicts on its own, so no ``BlockRemoved`` follows: a router's stale entry costs one
miss (the engine recomputes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import KVConnectorKVEvents, KVEventAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

COUNTERS = ("loaded_blocks", "failed_blocks", "saved_blocks", "shed_blocks")


@dataclass
class CtxmemConnectorStats(KVConnectorStats):
    """Block counts since the last collection (summed over workers)."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in COUNTERS:
            self.data[name] = int(self.data.get(name, 0)) + int(other.data.get(name, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        return {f"ctxmem_{name}": int(self.data.get(name, 0)) for name in COUNTERS}

    def is_empty(self) -> bool:
        return not any(int(self.data.get(name, 0)) for name in COUNTERS)


def stats_delta(now: dict[str, int], last: dict[str, int]) -> CtxmemConnectorStats | None:
    """The counts since ``last`` (updated in place); None when nothing happened."""
    delta = {name: int(now.get(name, 0)) - int(last.get(name, 0)) for name in COUNTERS}
    last.update({name: int(now.get(name, 0)) for name in COUNTERS})
    stats = CtxmemConnectorStats(data=delta)
    return None if stats.is_empty() else stats


class CtxmemPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters ``vllm:ctxmem_{loaded,failed,saved,shed}_blocks``."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                 ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        docs = {"loaded_blocks": "KV blocks loaded from ctxmem",
                "failed_blocks": "KV blocks whose ctxmem load failed (recomputed)",
                "saved_blocks": "KV blocks saved to ctxmem",
                "shed_blocks": "KV blocks whose save ctxmem shed (its write-back was "
                               "behind: flash.shed_backlog_bytes)"}
        self.counters: dict[str, dict[int, Any]] = {}
        for name in COUNTERS:
            metric = self._counter_cls(name=f"vllm:ctxmem_{name}", documentation=docs[name],
                                       labelnames=labelnames)
            self.counters[name] = {idx: metric.labels(*values)
                                   for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name in COUNTERS:
            value = int(transfer_stats_data.get(name, 0))
            child = self.counters[name].get(engine_idx)
            if value > 0 and child is not None:
                child.inc(value)


# -- KV cache events: what ctxmem holds, for cache-aware routers ---------------------------

class CtxmemKVEvents(KVConnectorKVEvents):
    """Workers' ``BlockStored`` events; vLLM keeps those every TP rank emitted (a block
    is in ctxmem only once every rank's part is)."""

    def __init__(self, num_workers: int = 1) -> None:
        self._agg = KVEventAggregator(num_workers)

    def add_events(self, events: list[Any]) -> None:
        self._agg.add_events(events)

    def aggregate(self) -> CtxmemKVEvents:
        common = self._agg.get_common_events()
        self._agg.clear_events()
        self._agg.add_events(common)
        self._agg.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._agg.increment_workers(count)

    def get_all_events(self) -> list[Any]:
        return list(self._agg.get_all_events())

    def get_number_of_workers(self) -> int:
        return int(self._agg.get_number_of_workers())

    def clear_events(self) -> None:
        self._agg.clear_events()
        self._agg.reset_workers()


MEDIUM = "ctxmem"
"""The ``medium`` of ctxmem's events (vLLM's own are ``GPU``/``CPU``/``STORAGE``)."""


def stored_events(saves: list[Any], block_size: int) -> CtxmemKVEvents | None:
    """``BlockStored`` events for saves the service accepted (``TransferSpec``\\ s with
    their token ids), keyed by vLLM's block hashes as the engine's own events are."""
    from vllm.distributed.kv_events import BlockStored

    if not saves:
        return None
    events = CtxmemKVEvents(num_workers=1)
    events.add_events([BlockStored(block_hashes=list(s.keys), parent_block_hash=s.parent,
                                   token_ids=list(s.token_ids), block_size=block_size,
                                   lora_id=None, medium=MEDIUM, lora_name=None)
                       for s in saves])
    return events
