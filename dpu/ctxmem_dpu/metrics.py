"""Prometheus metrics and the HTTP health endpoints.

The store keeps plain integer counters on its hot paths; this collector turns them into
Prometheus families only when scraped, so metrics cost nothing per block.
``/metrics`` (Prometheus text), ``/healthz`` (the process is alive: 200), ``/readyz``
(200 once serving, 503 while starting or draining).

The endpoint is served by the standard library's HTTP server (``wsgiref``, the server
prometheus-client's own ``start_http_server`` uses), never a hand-written parser: a
malformed request gets its 4xx from a proven parser. It is bounded (docs/security.md):
at most ``metrics.max_connections`` connections are served at once (one thread each,
more are closed at accept), and each has ``metrics.request_timeout_s`` from accept to
its last byte, after which its socket is shut down, so a slow-loris client holds one
thread for a bounded time and never the service's event loop. The metrics themselves
are rendered on the event loop (the store is not thread-safe); HTTP threads only wait
for them, with the same timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
import socketserver
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ctxmem_common.errors import ConfigError
from ctxmem_dpu.lifetime import AsyncResource
from ctxmem_dpu.logthrottle import throttled
from ctxmem_dpu.store import BlockStore

log = logging.getLogger(__name__)

T = TypeVar("T")

# The states ``ctxmem_flash_device_state`` reports, one series each per device.
DEVICE_STATES = ("healthy", "failed", "taken_over", "full")


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
        yield from self._operator_families(s, c)
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
        yield self._tenant_quotas(s)

    def _operator_families(self, s: dict[str, float], c: Mapping[str, int]
                           ) -> Iterator[Metric]:
        """What ``ctxmem status`` and the alert rules read beyond the counters above:
        grants, each flash device's state, and device events."""
        yield GaugeMetricFamily("ctxmem_sessions", "Open sessions", value=s["sessions"])
        yield GaugeMetricFamily("ctxmem_sessions_held", "Sessions whose client holds a Hold "
                                "call open now", value=s["sessions_held"])
        ended = CounterMetricFamily(
            "ctxmem_sessions_ended", "Sessions ended, by reason: disconnected (the client "
            "closed), orphaned (the client went away), idle, abandoned (the Connect's "
            "caller had given up)", labels=["reason"])
        for reason, key in (("disconnected", "sessions_disconnected"),
                            ("orphaned", "orphaned_sessions_closed"),
                            ("idle", "idle_sessions_closed"),
                            ("abandoned", "connects_abandoned")):
            ended.add_metric([reason], c[key])
        yield ended
        yield GaugeMetricFamily("ctxmem_allocations", "Open allocations (puts not yet "
                                "committed)", value=s["allocations"])
        yield GaugeMetricFamily("ctxmem_dirty_blocks", "Write-back blocks not yet on flash",
                                value=s["dirty_blocks"])
        state = GaugeMetricFamily(
            "ctxmem_flash_device_state", "Each flash device's state, one-hot: healthy, "
            "failed, taken_over (another service owns it), full (its filesystem is full)",
            labels=["device", "state"])
        full = set(self.store.full_devices)
        for dev in self.store.flash.devices:
            now = ("full" if dev.name in full else "healthy") if dev.healthy else \
                ("taken_over" if dev.health_reason == "taken over" else "failed")
            for name in DEVICE_STATES:
                state.add_metric([dev.name, name], 1.0 if name == now else 0.0)
        yield state
        events = CounterMetricFamily(
            "ctxmem_flash_device_events", "Flash device events: failed (taken out of "
            "service), recovered (probed healthy again), reattached (reopened where it "
            "moved)", labels=["event"])
        for event, key in (("failed", "flash_device_failures"),
                           ("recovered", "flash_device_recoveries"),
                           ("reattached", "flash_device_reopened")):
            events.add_metric([event], c[key])
        yield events
        full_ev = CounterMetricFamily("ctxmem_tier_full", "Requests that found a tier full",
                                      labels=["tier"])
        full_ev.add_metric(["dram"], c["dram_full"])
        full_ev.add_metric(["flash"], c["flash_full"])
        yield full_ev
        yield CounterMetricFamily("ctxmem_lookup_keys", "Keys asked for by Lookup",
                                  value=c["lookup_keys"])
        yield CounterMetricFamily("ctxmem_lookup_hits", "Keys Lookup found stored",
                                  value=c["lookup_hits"])

    def _tenant_quotas(self, s: dict[str, float]) -> Metric:
        """Each tenant's ceiling (``quotas.*.dram_max``/``flash_max``) in bytes, for the
        tenants the per-tenant families above name (``_other``: the default quota)."""
        fam = GaugeMetricFamily("ctxmem_tenant_quota_bytes", "A tenant's ceiling per tier "
                                "(quota max fraction times the tier's capacity)",
                                labels=["tenant", "tier"])
        tenants = sorted({k[len("tenant."):].rpartition(".")[0] for k in s
                          if k.startswith("tenant.")})
        quotas = self.store.cfg.quotas
        for t in tenants:
            q = quotas.of(t)
            fam.add_metric([t, "dram"], q.dram_max * s["dram_capacity_bytes"])
            fam.add_metric([t, "flash"], q.flash_max * s["flash_capacity_bytes"])
        return fam


class _QuietHandler(WSGIRequestHandler):
    """wsgiref's handler, logging to the service's logger at DEBUG, not to stderr.

    A request line it cannot parse is answered ``HTTP/1.0 400`` (the stdlib default,
    HTTP/0.9, would send the error page with no status line)."""

    default_request_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics HTTP %s: " + format, self.address_string(), *args)


class _BoundedWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    """A threading WSGI server with a cap on connections and a deadline per connection.

    A connection over ``max_connections`` is closed at accept. Each served one gets a
    per-operation socket timeout and a watchdog that shuts its socket down at
    ``request_timeout_s`` (a client trickling bytes resets no timer).
    """

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, host: str, port: int, request_timeout_s: float,
                 max_connections: int) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.request_timeout_s = request_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        handler = type("_Handler", (_QuietHandler,), {"timeout": request_timeout_s})
        super().__init__((host, port), handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            throttled(log, logging.WARNING, "metrics.refused",
                      "metrics HTTP connection from %s refused: %s connections open "
                      "(metrics.max_connections)", client_address, len(self._open))
            self.shutdown_request(request)
            return
        with self._lock:
            self._open.add(request)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        watchdog = threading.Timer(self.request_timeout_s, _shut, (request,))
        watchdog.daemon = True
        watchdog.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            watchdog.cancel()
            self._done(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics HTTP connection from %s ended with an error", client_address)

    def _done(self, request: socket.socket) -> None:
        with self._lock:
            if request not in self._open:
                return
            self._open.discard(request)
        self._slots.release()

    def drop_all(self) -> None:
        """Shut down every connection being served (their threads then end)."""
        with self._lock:
            open_now = list(self._open)
        for r in open_now:
            _shut(r)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class HttpEndpoint(AsyncResource):
    """The HTTP endpoint: /metrics, /healthz, /readyz, on a bounded threading server.

    ``start()`` binds ``host:port`` (port 0: any; the bound one is in :attr:`port`
    after), ``close()`` stops serving and drops open connections; both idempotent, and
    ``async with`` pairs them. Must be started on the service's event loop: metrics are
    rendered there.
    """

    def __init__(self, store: BlockStore, host: str, port: int, ready: Callable[[], bool],
                 *, request_timeout_s: float = 5.0, max_connections: int = 16) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StoreCollector(store))
        # process_cpu_seconds_total and friends: the service's own CPU, beside its bytes.
        ProcessCollector(registry=self.registry)
        self.host = host
        self.port = port
        self.ready = ready
        self.request_timeout_s = request_timeout_s
        self.max_connections = max_connections
        self._server: _BoundedWSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        if self._server is not None:
            return
        self._loop = asyncio.get_running_loop()
        try:
            server = await asyncio.to_thread(_BoundedWSGIServer, self.host, self.port,
                                             self.request_timeout_s, self.max_connections)
        except OSError as exc:
            raise ConfigError(
                f"metrics.listen: cannot bind {self.host}:{self.port}: [errno {exc.errno}] "
                f"{exc.strerror} (address already in use, or not an address of this host); "
                f"pick another port, or set metrics.listen: \"\" to disable the endpoint"
            ) from None
        server.set_app(self._app)
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={
            "poll_interval": 0.2}, name="ctxmem-metrics-http", daemon=True)
        self._thread.start()

    def _on_loop(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on the service's loop (from an HTTP thread), within the request
        timeout; raises if the loop is gone or busy past it."""
        assert self._loop is not None
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # handed to the waiting thread
                    fut.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return fut.result(timeout=self.request_timeout_s)

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]
             ) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        method = environ.get("REQUEST_METHOD", "GET")
        ctype = "text/plain; charset=utf-8"
        if method not in ("GET", "HEAD"):
            code, body = "405 Method Not Allowed", b"only GET and HEAD\n"
        elif path == "/metrics":
            try:
                code, body = "200 OK", self._on_loop(lambda: generate_latest(self.registry))
                ctype = "text/plain; version=0.0.4; charset=utf-8"
            except Exception as exc:  # loop stopping or stalled: say so, keep serving
                log.warning("metrics: rendering /metrics failed: %r", exc)
                code, body = "503 Service Unavailable", b"metrics unavailable\n"
        elif path == "/healthz":
            code, body = "200 OK", b"ok\n"
        elif path == "/readyz":
            ok = self.ready()
            code, body = ("200 OK", b"ready\n") if ok else \
                ("503 Service Unavailable", b"not ready\n")
        else:
            code, body = "404 Not Found", b"not found\n"
        start_response(code, [("Content-Type", ctype), ("Content-Length", str(len(body)))])
        return [b"" if method == "HEAD" else body]

    async def close(self) -> None:
        server, self._server = self._server, None
        thread, self._thread = self._thread, None
        if server is None:
            return
        await asyncio.to_thread(server.shutdown)
        server.drop_all()
        server.server_close()
        if thread is not None:
            await asyncio.to_thread(thread.join, 5.0)
