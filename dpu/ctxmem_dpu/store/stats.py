"""Counter names and the Stats / ``/metrics`` snapshot."""

from __future__ import annotations

import resource
from collections import Counter
from typing import TYPE_CHECKING

from ctxmem_dpu.gctune import gc_stats

if TYPE_CHECKING:
    from ctxmem_dpu.store.context import StoreContext
    from ctxmem_dpu.store.index import BlockIndex
    from ctxmem_dpu.store.quotas import Quotas
    from ctxmem_dpu.store.sessions import SessionRegistry

# Every counter the store keeps; all are reported (as 0 until they move) by Stats and
# /metrics, so dashboards and tests see the same names from the start.
COUNTERS = (
    "lookup_keys", "lookup_hits", "put_blocks", "put_bytes", "put_crc_mismatch",
    "get_blocks", "get_bytes", "hits_dram", "hits_flash", "misses", "prefetch_blocks",
    "promoted_blocks", "promote_no_space", "demoted_blocks", "demoted_bytes",
    "evictions_dram", "evictions_flash", "deleted_blocks", "integrity_failures",
    # Flash records whose authenticator did not verify (also in integrity_failures), and
    # records of format version 1 (no authenticator) a rebuild found and did not serve.
    "flash_auth_failures", "flash_legacy_records",
    "flash_read_errors", "flash_write_errors", "flash_fenced_writes",
    "flash_device_failures", "flash_full",
    "dram_full", "expired_allocations", "expired_leases", "recovered_blocks",
    "recovery_seconds_x1e6", "quarantined_extents", "dirty_dropped", "flash_device_recoveries",
    "flash_device_reopened", "shm_slow_readers", "shm_peers_refused",
    "stale_allocations", "dram_crc_mismatch", "write_through_failures",
    "quota_refusals", "idle_sessions_closed",
    # Puts shed while write-back is behind (flash.shed_backlog_bytes), calls and blocks.
    "puts_shed", "puts_shed_blocks",
    # KV events for routers (events.endpoint).
    "kv_event_batches", "kv_events_dropped",
    # Sessions ended: by Disconnect, as orphans (their client went away), and Connects
    # whose caller had given up (ended as they were made).
    "sessions_disconnected", "orphaned_sessions_closed", "connects_abandoned",
    # The pod tier (docs/pod.md); per source: local DRAM and flash are hits_dram/flash.
    "pod_lookup_keys", "pod_lookup_hits", "pod_index_errors", "pod_published",
    "pod_publish_batches", "pod_publish_dropped", "pod_resyncs", "pod_fetch_blocks_peer",
    "pod_fetch_bytes_peer", "pod_fetch_blocks_shared_flash", "pod_fetch_bytes_shared_flash",
    "pod_fetch_misses", "pod_fetch_bad", "pod_peer_errors", "pod_peer_misses",
    "pod_peer_refused", "pod_served_blocks", "pod_served_bytes", "pod_copies_dropped",
    "pod_published_now",
    # Fetched blocks whose authenticator did not verify, or from a source that does not
    # verify (issue 25): misses, never adopted.
    "pod_fetch_unauthenticated",
    # Fetched bytes copied into their DRAM slot after a source returned them (a source
    # that does not land blocks in place: shared flash); peer fetch lands in the slot: 0.
    "pod_fetch_copied_bytes",
    # Peer fetch over RDMA (a subset of the peer's and served counts above).
    "pod_peer_rdma_blocks", "pod_peer_rdma_bytes", "pod_served_rdma_blocks",
    "pod_served_rdma_bytes", "pod_peer_rdma_fallbacks", "pod_rdma_setup_errors",
    # Block groups: group commits; member blocks a group Acquire held but did not serve
    # because another member of the key was missing or failed its checks; member blocks
    # reclaimed because another member of their key left the index (store.groups).
    "group_commits", "group_partial_misses", "group_members_reclaimed",
    # Flash blocks a get's Acquire promoted ahead of the shim's next Acquire (promotion).
    "read_ahead_blocks",
    # Pod copies served by their first Acquire (the others are DRAM hits): fetched on
    # demand by that get, and pre-staged by a Prefetch (remote→dram; docs/pod.md).
    "hits_remote", "hits_remote_dram",
    # Pre-staging (docs/pod.md): remote blocks a Prefetch admitted to pull in the
    # background, those pulls finished (landed or not: in flight = admitted - done), and
    # remote blocks not pulled because the tenant had pod.prefetch_max_blocks_per_tenant
    # in flight; Prefetch calls refused whole (the tenant at that bound when they came).
    "pod_prefetch_admitted_blocks", "pod_prefetch_done_blocks",
    "pod_prefetch_refused_blocks", "pod_prefetch_refused_calls",
    # Fetched copies another pull adopted while an Acquire's index check was in flight,
    # dropped before that Acquire (its check did not see them; pod/fetch.py).
    "pod_copies_unchecked",
    # A cold get's payload reads (promotion, issue 27 item 4): runs read, runs another I/O
    # thread read while the checking thread decrypted and checked the runs before them,
    # runs handed out but taken back unstarted (the threads were busy), runs the checking
    # thread read itself while another read was in flight.
    "cold_read_runs", "cold_reads_ahead", "cold_reads_taken_back", "cold_reads_helped",
)


def new_counters() -> Counter[str]:
    """Every counter of :data:`COUNTERS` at 0."""
    return Counter(dict.fromkeys(COUNTERS, 0))


def snapshot(ctx: StoreContext, index: BlockIndex, registry: SessionRegistry,
             quotas: Quotas) -> dict[str, float]:
    """Every counter plus the gauges (blocks, bytes, grants, device health), and the
    per-tenant ones (``tenant.NAME.*``, bounded by ``quotas.stats_tenants``)."""
    out: dict[str, float] = {k: float(v) for k, v in ctx.counters.items()}
    out.update(
        blocks=float(index.count()),
        blocks_dram=float(len(index.dram_lru)),
        blocks_flash=float(len(index.flash_lru)),
        dram_used_bytes=float(ctx.dram.used_bytes()),
        dram_capacity_bytes=float(ctx.dram.capacity_bytes()),
        flash_used_bytes=float(ctx.flash.used_bytes()),
        flash_capacity_bytes=float(ctx.flash.capacity_bytes()),
        leases=float(len(registry.leases)),
        allocations=float(len(registry.allocations)),
        sessions=float(len(registry.sessions)),
        sessions_held=float(registry.held_sessions()),
        dirty_blocks=float(len(index.dirty)),
        quarantined_slots=float(registry.quarantined_slots()),
        flash_quarantined_slots=float(sum(len(d.alloc.quarantined)
                                          for d in ctx.flash.devices)),
        flash_devices_healthy=float(sum(d.healthy for d in ctx.flash.devices)),
    )
    out.update(quotas.snapshot())
    out.update(process_cpu())
    out.update(gc_stats())
    return out


def process_cpu() -> dict[str, float]:
    """The service process's own CPU seconds (every thread; user and system), so a bench
    can divide the CPU the service spent in a phase by the bytes it moved: the figure that
    sizes a DPU's Arm cores. ``getrusage`` rather than ``os.times``: microseconds, not
    clock ticks, and it is one system call per Stats, nothing per block."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"process_cpu_user_seconds": ru.ru_utime,
            "process_cpu_system_seconds": ru.ru_stime,
            "process_cpu_seconds": ru.ru_utime + ru.ru_stime}
