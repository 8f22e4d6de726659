"""Prometheus metrics and the HTTP health endpoints.

The store keeps plain integer counters on its hot paths; this collector turns them into
Prometheus families only when scraped, so metrics cost nothing per block.
``/metrics`` (Prometheus text), ``/healthz`` (the process is alive: 200), ``/readyz``
(200 once serving, 503 while starting or draining).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ctxmem_dpu.lifetime import AsyncResource
from ctxmem_dpu.store import BlockStore

log = logging.getLogger(__name__)


class StoreCollector:
    def __init__(self, store: BlockStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        s = self.store.stats()
        c = self.store.counters
        hits = CounterMetricFamily("ctxmem_hits", "Blocks served, by tier they were found in",
                                   labels=["tier"])
        hits.add_metric(["dram"], c["hits_dram"])
        hits.add_metric(["flash"], c["hits_flash"])
        yield hits
        yield CounterMetricFamily("ctxmem_misses", "Keys asked for by Acquire and not served",
                                  value=c["misses"])
        moved = CounterMetricFamily("ctxmem_bytes", "Bytes moved, by operation",
                                    labels=["op"])
        for op, key in (("put", "put_bytes"), ("get", "get_bytes"), ("demote", "demoted_bytes")):
            moved.add_metric([op], c[key])
        yield moved
        ev = CounterMetricFamily("ctxmem_evictions", "Blocks evicted, by tier", labels=["tier"])
        ev.add_metric(["dram"], c["evictions_dram"])
        ev.add_metric(["flash"], c["evictions_flash"])
        yield ev
        yield CounterMetricFamily(
            "ctxmem_integrity_failures",
            "Blocks that failed a CRC32C/header check on read and were served as misses",
            value=c["integrity_failures"])
        yield CounterMetricFamily("ctxmem_put_crc_mismatch",
                                  "Committed blocks whose client CRC32C did not match",
                                  value=c["put_crc_mismatch"])
        yield CounterMetricFamily(
            "ctxmem_dram_crc_mismatch",
            "Blocks dropped at demotion: their DRAM bytes changed after commit",
            value=c["dram_crc_mismatch"])
        yield CounterMetricFamily(
            "ctxmem_stale_allocations",
            "Allocations that expired while their client mapped shared memory",
            value=c["stale_allocations"])
        yield GaugeMetricFamily(
            "ctxmem_quarantined_slots",
            "DRAM slots held back from stale shared-memory writers until their session "
            "ends", value=s["quarantined_slots"])
        yield CounterMetricFamily(
            "ctxmem_write_through_failures",
            "Write-through blocks refused because they could not be made durable",
            value=c["write_through_failures"])
        io_err = CounterMetricFamily("ctxmem_flash_io_errors", "Flash I/O errors", labels=["op"])
        io_err.add_metric(["read"], c["flash_read_errors"])
        io_err.add_metric(["write"], c["flash_write_errors"])
        yield io_err
        yield GaugeMetricFamily("ctxmem_leases", "Open read leases", value=s["leases"])
        occ = GaugeMetricFamily("ctxmem_tier_used_bytes", "Bytes in use per tier",
                                labels=["tier"])
        occ.add_metric(["dram"], s["dram_used_bytes"])
        occ.add_metric(["flash"], s["flash_used_bytes"])
        yield occ
        cap = GaugeMetricFamily("ctxmem_tier_capacity_bytes", "Capacity per tier",
                                labels=["tier"])
        cap.add_metric(["dram"], s["dram_capacity_bytes"])
        cap.add_metric(["flash"], s["flash_capacity_bytes"])
        yield cap
        blocks = GaugeMetricFamily("ctxmem_blocks", "Blocks held per tier", labels=["tier"])
        blocks.add_metric(["dram"], s["blocks_dram"])
        blocks.add_metric(["flash"], s["blocks_flash"])
        yield blocks
        yield GaugeMetricFamily("ctxmem_flash_devices_healthy", "Flash devices in service",
                                value=s["flash_devices_healthy"])
        # Per tenant (issue 12): bounded by quotas.stats_tenants (the rest is "_other").
        t_bytes = GaugeMetricFamily("ctxmem_tenant_used_bytes", "Bytes in use per tenant "
                                    "and tier", labels=["tenant", "tier"])
        t_ev = CounterMetricFamily("ctxmem_tenant_evictions", "Blocks of a tenant evicted, "
                                   "by tier", labels=["tenant", "tier"])
        t_ref = CounterMetricFamily("ctxmem_tenant_refusals", "Requests of a tenant refused "
                                    "for a quota or a full tier", labels=["tenant"])
        for key, v in s.items():
            if not key.startswith("tenant."):
                continue
            tenant, _, name = key[len("tenant."):].rpartition(".")
            if name in ("dram_bytes", "flash_bytes"):
                t_bytes.add_metric([tenant, name[:-len("_bytes")]], v)
            elif name in ("evictions_dram", "evictions_flash"):
                t_ev.add_metric([tenant, name[len("evictions_"):]], v)
            elif name == "refusals":
                t_ref.add_metric([tenant], v)
        yield t_bytes
        yield t_ev
        yield t_ref


class HttpEndpoint(AsyncResource):
    """A minimal HTTP/1.0 server on the service's loop: /metrics, /healthz, /readyz.

    ``start()`` binds ``host:port`` (port 0: any; the bound one is in :attr:`port`
    after), ``close()`` stops serving; both idempotent, and ``async with`` pairs them.
    """

    def __init__(self, store: BlockStore, host: str, port: int, ready: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StoreCollector(store))
        self.host = host
        self.port = port
        self.ready = ready
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        if self._server is not None:
            return
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), timeout=5)
            parts = line.decode("latin-1").split()
            path = parts[1] if len(parts) > 1 else "/"
            while (await asyncio.wait_for(reader.readline(), timeout=5)) not in (b"\r\n", b""):
                pass
            if path.startswith("/metrics"):
                code, body, ctype = 200, generate_latest(self.registry), "text/plain; version=0.0.4"
            elif path == "/healthz":
                code, body, ctype = 200, b"ok\n", "text/plain"
            elif path == "/readyz":
                ok = self.ready()
                code, body, ctype = (200 if ok else 503), (b"ready\n" if ok else b"not ready\n"), \
                    "text/plain"
            else:
                code, body, ctype = 404, b"not found\n", "text/plain"
            reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[code]
            writer.write(f"HTTP/1.0 {code} {reason}\r\nContent-Type: {ctype}\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()
