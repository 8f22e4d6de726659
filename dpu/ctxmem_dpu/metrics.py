"""Prometheus metrics and the HTTP health endpoints.

The store keeps plain integer counters on its hot paths; this collector turns them into
Prometheus families only when scraped, so metrics cost nothing per block.
``/metrics`` (Prometheus text), ``/healthz`` (the process is alive: 200), ``/readyz``
(200 once serving, 503 while starting or draining), and ``POST /v1/locate``: gRPC
Locate as JSON for routers, authenticated by the session's token
(:mod:`ctxmem_dpu.control.locate_http`).

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
import functools
import io
import logging
import selectors
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from typing import Any, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ctxmem_common.errors import ConfigError, CtxmemError, ErrorCode
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_dpu.control import locate_http
from ctxmem_dpu.lifetime import AsyncResource
from ctxmem_dpu.listenguard import FdReserve, Ticket, Unauthenticated
from ctxmem_dpu.logthrottle import throttled
from ctxmem_dpu.store import BlockStore

log = logging.getLogger(__name__)

T = TypeVar("T")

# The states ``ctxmem_flash_device_state`` reports, one series each per device.
DEVICE_STATES = ("healthy", "failed", "taken_over", "full")

# The pod tier's counters (docs/pod.md), each exported as ``ctxmem_<name>_total``: the
# store keeps them (0 until they move, also on a node without the pod tier), Stats
# reports them under the same names.
POD_COUNTER_HELP: dict[str, str] = {
    "pod_lookup_keys": "Keys this node asked the cluster index for (its local misses)",
    "pod_lookup_hits": "Keys the cluster index named a live holder for",
    "pod_index_errors": "Cluster index requests that failed (unreachable, timed out)",
    "pod_published": "Index entries this node published (its blocks, their locations)",
    "pod_publish_batches": "Batches of index updates this node sent",
    "pod_publish_dropped": "Index updates dropped (the publish queue was full)",
    "pod_published_now": "Index updates a Delete or a re-putting Commit sent itself",
    "pod_resyncs": "Full republishes of this node's blocks (the index lost them)",
    "pod_fetch_blocks_peer": "Blocks fetched from another node by peer fetch",
    "pod_fetch_bytes_peer": "Bytes fetched from another node by peer fetch",
    "pod_fetch_blocks_shared_flash": "Blocks read straight from shared flash",
    "pod_fetch_bytes_shared_flash": "Bytes read straight from shared flash",
    "pod_fetch_copied_bytes": "Fetched bytes copied into their slot after the source "
                              "returned them (shared flash; peer fetch lands in place)",
    "pod_fetch_misses": "Remote entries whose block could not be fetched (misses)",
    "pod_fetch_bad": "Fetched blocks that failed their length or CRC32C check (misses)",
    "pod_fetch_unauthenticated": "Fetched blocks whose authenticator did not verify, or "
                                 "from a source that does not verify (misses)",
    "pod_peer_errors": "Peer fetch calls that failed (connection, protocol, timeout)",
    "pod_peer_misses": "Blocks a peer answered as not held",
    "pod_peer_refused": "Peer fetch requests this node refused (handshake, bounds)",
    "pod_served_blocks": "Blocks this node served to other nodes",
    "pod_served_bytes": "Bytes this node served to other nodes",
    "pod_peer_rdma_blocks": "Blocks fetched from peers over RDMA (also in peer fetch)",
    "pod_peer_rdma_bytes": "Bytes fetched from peers over RDMA (also in peer fetch)",
    "pod_served_rdma_blocks": "Blocks served to peers over RDMA (also in served)",
    "pod_served_rdma_bytes": "Bytes served to peers over RDMA (also in served)",
    "pod_peer_rdma_fallbacks": "Peer fetches that fell back from RDMA to TCP",
    "pod_rdma_setup_errors": "RDMA setups that failed (the peer fetch used TCP)",
    "pod_copies_dropped": "Fetched copies dropped because the index no longer named them",
    "pod_copies_unchecked": "Fetched copies another pull adopted while an Acquire's index "
                            "check was in flight, dropped before that Acquire",
    "pod_prefetch_admitted_blocks": "Remote blocks a Prefetch admitted to pull",
    "pod_prefetch_done_blocks": "Prefetch pulls finished, landed or not (in flight = "
                                "admitted - done)",
    "pod_prefetch_refused_blocks": "Remote blocks a Prefetch did not pull (the tenant at "
                                   "pod.prefetch_max_blocks_per_tenant)",
    "pod_prefetch_refused_calls": "Prefetch calls refused whole (the tenant at its bound)",
}


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
        hits.add_metric(["remote"], c["hits_remote"])  # pod copies' first reads
        hits.add_metric(["remote→dram"], c["hits_remote_dram"])
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
            "Blocks that failed a CRC32C/header/authenticator check on read and were served "
            "as misses", value=c["integrity_failures"])
        yield CounterMetricFamily(
            "ctxmem_flash_auth_failures",
            "Flash records whose authenticator did not verify (written, moved or patched "
            "without the master key, or a wrong master key); also in integrity_failures",
            value=c["flash_auth_failures"])
        yield CounterMetricFamily(
            "ctxmem_flash_legacy_records",
            "Flash records of format version 1 (no authenticator) a rebuild found and did "
            "not serve", value=c["flash_legacy_records"])
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
        fencing = GaugeMetricFamily(
            "ctxmem_flash_shared_fencing", "Each shared flash device's fencing, one-hot: "
            "reservation (NVMe reservations and the slab epochs), epoch_only (the target has "
            "no reservations: the slab epochs alone), preempted (another node preempted this "
            "node's key: it writes nothing more there)", labels=["device", "mode"])
        for dev in self.store.flash.devices:
            if dev.fencing:
                for mode in ("reservation", "epoch_only", "preempted"):
                    fencing.add_metric([dev.name, mode], 1.0 if mode == dev.fencing else 0.0)
        yield fencing
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
        yield CounterMetricFamily("ctxmem_puts_shed", "Puts refused at once because write-"
                                  "back was behind by more than flash.shed_backlog_bytes",
                                  value=c["puts_shed"])
        yield CounterMetricFamily("ctxmem_lookup_keys", "Keys asked for by Lookup",
                                  value=c["lookup_keys"])
        yield CounterMetricFamily("ctxmem_lookup_hits", "Keys Lookup found stored",
                                  value=c["lookup_hits"])
        for name, text in POD_COUNTER_HELP.items():
            yield CounterMetricFamily(f"ctxmem_{name}", text, value=c[name])

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
    HTTP/0.9, would send the error page with no status line). The request head was read
    already (:class:`_BoundedWSGIServer`): the handler parses it from memory, and a body
    (``POST /v1/locate``) is read on from the socket after what came with the head,
    under the request's socket timeout and deadline."""

    default_request_version = "HTTP/1.0"

    def setup(self) -> None:
        super().setup()
        head = self.server.take_head(self.request)  # type: ignore[attr-defined]
        self.rfile = io.BufferedReader(_HeadThenSocket(head, self.request))

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics HTTP %s: " + format, self.address_string(), *args)


class _HeadThenSocket(io.RawIOBase):
    """Reads the bytes already received with the head, then the socket. The head ends in
    memory, so parsing it never waits on the socket; only a body read does."""

    def __init__(self, head: bytes, sock: socket.socket) -> None:
        self._head = memoryview(head)
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self._head:
            n = min(len(b), len(self._head))
            b[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        return self._sock.recv_into(b)


_MAX_HEAD = 16 << 10  # a request head larger than this is closed unanswered
_BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
         b"Content-Length: 15\r\n\r\nmetrics busy\r\n\r\n")
_PROBES = (b"/healthz", b"/readyz")


class _Pending:
    __slots__ = ("accepted", "addr", "buf", "deadline", "ticket")

    def __init__(self, addr: Any, deadline: float, accepted: float) -> None:
        self.addr = addr
        self.buf = bytearray()
        self.deadline = deadline
        self.accepted = accepted
        self.ticket: Ticket | None = None


class _BoundedWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    """A WSGI server that holds no thread for a connection until its request head is in.

    One thread accepts and reads request heads for every connection, non-blocking
    (:meth:`serve_forever`): a head must be complete within ``head_timeout_s`` of accept
    however it trickles in, and the connections waiting for theirs are capped by
    :class:`~ctxmem_dpu.listenguard.Unauthenticated` (``max_connections`` in total,
    ``max_per_source`` per peer IP; over a cap the oldest waiting one is closed, so a
    slow-loris flood churns among itself while a probe that sends its head at once is
    answered). A complete head is answered on a thread by wsgiref: ``/healthz`` and
    ``/readyz`` at once (tiny answers), ``/metrics`` by at most ``metrics_workers``
    threads (503 over it; ``POST /v1/locate`` shares them). Each answering thread has a
    watchdog that shuts its socket at ``request_timeout_s`` from accept.
    """

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, host: str, port: int, request_timeout_s: float,
                 max_connections: int, head_timeout_s: float = 2.0,
                 max_per_source: int = 64, fd_reserve: FdReserve | None = None,
                 metrics_workers: int = 8) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.request_timeout_s = request_timeout_s
        self.head_timeout_s = head_timeout_s
        # A quarter of the fd reserve: probes are still admitted after the data
        # listeners stopped admitting new unauthenticated connections.
        self._unauth = Unauthenticated("metrics HTTP", max_connections, max_per_source,
                                       fd_reserve, reserve_share=0.25)
        self._workers = threading.BoundedSemaphore(metrics_workers)
        self._pending: dict[socket.socket, _Pending] = {}
        self._heads: dict[socket.socket, bytes] = {}
        self._open: dict[socket.socket, bool] = {}  # answering now: holds a worker slot?
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stopped = threading.Event()
        handler = type("_Handler", (_QuietHandler,), {"timeout": request_timeout_s})
        super().__init__((host, port), handler)

    # -- the accept and head-reading thread ------------------------------------------

    def serve_forever(self, poll_interval: float = 0.2) -> None:
        self._stopped.clear()
        sel = selectors.DefaultSelector()
        self.socket.setblocking(False)
        sel.register(self.socket, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                wait = min([poll_interval] + [max(0.0, p.deadline - now)
                                              for p in self._pending.values()])
                for key, _ in sel.select(wait):
                    if key.fileobj is self.socket:
                        self._accept_some(sel)
                    else:
                        self._read_head(sel, key.fileobj)  # type: ignore[arg-type]
                now = time.monotonic()
                for conn in [c for c, p in self._pending.items() if p.deadline <= now]:
                    throttled(log, logging.WARNING, "metrics.head_timeout",
                              "metrics HTTP connection from %s closed: no complete request "
                              "head within %g s of accept (metrics.head_timeout_s)",
                              self._pending[conn].addr, self.head_timeout_s)
                    self._forget(sel, conn)
        finally:
            for conn in list(self._pending):
                self._forget(sel, conn)
            sel.close()
            self._stopped.set()

    def shutdown(self) -> None:
        self._stop.set()
        self._stopped.wait(5.0)

    def _accept_some(self, sel: selectors.BaseSelector) -> None:
        for _ in range(64):  # then serve heads before accepting more
            try:
                conn, addr = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: try again on the next round
                throttled(log, logging.WARNING, "metrics.accept",
                          "metrics HTTP accept failed (%s)", exc)
                return
            conn.setblocking(False)
            now = time.monotonic()
            p = _Pending(addr, now + self.head_timeout_s, now)
            ticket = self._unauth.admit(str(addr[0]), functools.partial(
                self._evict, sel, conn))
            if ticket is None:
                conn.close()
                continue
            p.ticket = ticket
            self._pending[conn] = p
            sel.register(conn, selectors.EVENT_READ)

    def _evict(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        self._forget(sel, conn)

    def _forget(self, sel: selectors.BaseSelector, conn: socket.socket,
                close: bool = True) -> _Pending | None:
        p = self._pending.pop(conn, None)
        if p is None:
            return None
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn)
        if p.ticket is not None:
            p.ticket.done()
        if close:
            conn.close()
        return p

    def _read_head(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        p = self._pending.get(conn)
        if p is None:
            return
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._forget(sel, conn)
            return
        p.buf += data
        end = p.buf.find(b"\r\n\r\n")
        if end < 0:
            end = p.buf.find(b"\n\n")
        if end < 0:
            if len(p.buf) > _MAX_HEAD:
                throttled(log, logging.WARNING, "metrics.head_size",
                          "metrics HTTP connection from %s closed: a request head over "
                          "%d bytes", p.addr, _MAX_HEAD)
                self._forget(sel, conn)
            return
        self._forget(sel, conn, close=False)
        self._dispatch(conn, p)

    def _dispatch(self, conn: socket.socket, p: _Pending) -> None:
        head = bytes(p.buf)
        parts = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0].split()
        probe = len(parts) >= 2 and parts[1].split(b"?", 1)[0] in _PROBES
        if not probe and not self._workers.acquire(blocking=False):
            with contextlib.suppress(OSError):
                conn.send(_BUSY)
            conn.close()
            throttled(log, logging.WARNING, "metrics.busy",
                      "metrics HTTP request from %s answered 503: every /metrics worker is "
                      "busy", p.addr)
            return
        conn.setblocking(True)
        with self._lock:
            self._heads[conn] = head
            self._open[conn] = not probe
        left = max(0.001, p.accepted + self.request_timeout_s - time.monotonic())
        try:
            t = threading.Thread(target=self._answer, args=(conn, p.addr, left),
                                 daemon=True, name="ctxmem-metrics-answer")
            t.start()
        except BaseException:
            self._done(conn)
            conn.close()
            raise

    # -- the answering threads -------------------------------------------------------

    def take_head(self, conn: socket.socket) -> bytes:
        with self._lock:
            return self._heads.pop(conn, b"")

    def _answer(self, conn: socket.socket, addr: Any, left: float) -> None:
        watchdog = threading.Timer(left, _shut, (conn,))
        watchdog.daemon = True
        watchdog.start()
        try:
            self.finish_request(conn, addr)
        except Exception:
            self.handle_error(conn, addr)
        finally:
            watchdog.cancel()
            self._done(conn)
            self.shutdown_request(conn)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics HTTP connection from %s ended with an error", client_address)

    def _done(self, conn: socket.socket) -> None:
        with self._lock:
            self._heads.pop(conn, None)
            worker = self._open.pop(conn, None)
        if worker:
            self._workers.release()

    def drop_all(self) -> None:
        """Shut down every connection being answered (their threads then end)."""
        with self._lock:
            open_now = list(self._open)
        for r in open_now:
            _shut(r)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


Locator = Callable[[pb.LookupRequest, bytes], Coroutine[Any, Any, pb.LocateResponse]]


class HttpEndpoint(AsyncResource):
    """The HTTP endpoint: /metrics, /healthz, /readyz and /v1/locate, on a bounded
    threading server.

    ``start()`` binds ``host:port`` (port 0: any; the bound one is in :attr:`port`
    after), ``close()`` stops serving and drops open connections; both idempotent, and
    ``async with`` pairs them. Must be started on the service's event loop: metrics are
    rendered there. ``locate`` (a request and the token its caller sent → the answer;
    :func:`ctxmem_dpu.control.locate_http.authenticated_locate`) serves ``POST
    /v1/locate`` on that loop; without it the path answers 404. ``locate_refusal``, when
    set, is why this endpoint refuses session tokens (403 with it).
    """

    def __init__(self, store: BlockStore, host: str, port: int, ready: Callable[[], bool],
                 *, request_timeout_s: float = 5.0, max_connections: int = 128,
                 head_timeout_s: float = 2.0, max_per_source: int = 64,
                 fd_reserve: FdReserve | None = None, locate: Locator | None = None,
                 locate_refusal: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StoreCollector(store))
        # process_cpu_seconds_total and friends: the service's own CPU, beside its bytes.
        ProcessCollector(registry=self.registry)
        self.host = host
        self.port = port
        self.ready = ready
        self.request_timeout_s = request_timeout_s
        self.max_connections = max_connections
        self.head_timeout_s = head_timeout_s
        self.max_per_source = max_per_source
        self.fd_reserve = fd_reserve
        self.locate = locate
        self.locate_refusal = locate_refusal
        self._server: _BoundedWSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        if self._server is not None:
            return
        self._loop = asyncio.get_running_loop()
        try:
            server = await asyncio.to_thread(
                _BoundedWSGIServer, self.host, self.port, self.request_timeout_s,
                self.max_connections, self.head_timeout_s, self.max_per_source,
                self.fd_reserve)
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
        if path == locate_http.LOCATE_PATH:
            code, body = self._locate(environ, method)
            headers = [("Content-Type", "application/json"),
                       ("Content-Length", str(len(body)))]
            if code.startswith("405"):
                headers.append(("Allow", "POST"))
            start_response(code, headers)
            return [b"" if method == "HEAD" else body]
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

    def _locate(self, environ: dict[str, Any], method: str) -> tuple[str, bytes]:
        """``POST /v1/locate`` (on an HTTP thread): the status line and JSON body. The
        body is refused from its header when over the cap, else read (the socket's
        timeout and the request's watchdog bound the wait) and parsed here; the query
        runs on the service's loop, within the request timeout."""
        def refuse(code: str, err: ErrorCode | str, message: str) -> tuple[str, bytes]:
            log.debug("metrics HTTP %s refused %s: %s", locate_http.LOCATE_PATH, code,
                      message)
            return code, locate_http.error_body(err, message)

        if self.locate is None:
            return refuse("404 Not Found", "NOT_FOUND", "Locate is not served here")
        if method != "POST":
            return refuse("405 Method Not Allowed", "METHOD_NOT_ALLOWED",
                          f"{locate_http.LOCATE_PATH} takes POST with a JSON body")
        if self.locate_refusal:
            return refuse("403 Forbidden", ErrorCode.PERMISSION_DENIED, self.locate_refusal)
        token = locate_http.token_of(
            environ.get("HTTP_" + locate_http.TOKEN_HEADER.upper().replace("-", "_")))
        if token is None:
            return refuse("401 Unauthorized", ErrorCode.PERMISSION_DENIED,
                          f"no session token; send the session_token from Connect, hex, as "
                          f"the header {locate_http.TOKEN_HEADER!r}")
        length = environ.get("CONTENT_LENGTH") or ""
        if not length.isdigit():
            return refuse("411 Length Required", ErrorCode.INVALID_ARGUMENT,
                          f"{locate_http.LOCATE_PATH}: send the body with a Content-Length "
                          f"(got {length[:32]!r})")
        n = int(length)
        if n > locate_http.MAX_BODY_BYTES:
            return refuse("413 Content Too Large", ErrorCode.INVALID_ARGUMENT,
                          f"{locate_http.LOCATE_PATH}: a body of {n} bytes is over "
                          f"{locate_http.MAX_BODY_BYTES}; ask fewer keys, or gRPC Locate "
                          f"with packed keys")
        try:
            data = environ["wsgi.input"].read(n)
        except OSError as exc:  # the socket timed out or was shut at the deadline
            return refuse("408 Request Timeout", ErrorCode.INVALID_ARGUMENT,
                          f"{locate_http.LOCATE_PATH}: the body did not arrive within "
                          f"metrics.request_timeout_s ({exc!r})")
        if len(data) != n:
            return refuse("400 Bad Request", ErrorCode.INVALID_ARGUMENT,
                          f"{locate_http.LOCATE_PATH}: the body ended after {len(data)} of "
                          f"its {n} bytes (Content-Length)")
        try:
            request = locate_http.parse_request(data)
            del data
            resp = self._on_loop_async(self.locate(request, token))
        except CtxmemError as exc:
            return refuse(locate_http.error_status(exc), exc.code, exc.message)
        except (concurrent.futures.TimeoutError, RuntimeError) as exc:
            return refuse("503 Service Unavailable", ErrorCode.UNAVAILABLE,
                          f"{locate_http.LOCATE_PATH}: the service did not answer within "
                          f"metrics.request_timeout_s ({exc!r}); retry")
        except Exception as exc:
            log.warning("metrics: %s failed: %r", locate_http.LOCATE_PATH, exc)
            return refuse("500 Internal Server Error", ErrorCode.INTERNAL,
                          f"{locate_http.LOCATE_PATH}: internal error ({type(exc).__name__})"
                          f"; see the service's log")
        return "200 OK", locate_http.response_body(resp)

    def _on_loop_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """``coro`` run on the service's loop (from an HTTP thread), within the request
        timeout (then cancelled there)."""
        assert self._loop is not None
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # the loop is closed
            coro.close()
            raise
        try:
            return fut.result(timeout=self.request_timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

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
