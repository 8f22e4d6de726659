"""Wiring: config → storage backends → block store → control plane and data servers.

Start order: attach flash devices (each backend idempotent), open the store (rebuilds
the index from flash), start the data servers, then the gRPC server, then report ready.
Stop order is the reverse; the store flushes write-back blocks before closing devices.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc

from ctxmem_common import safepaths
from ctxmem_common.codecs import CRC32C_IMPLEMENTATION, XTS_IMPLEMENTATION
from ctxmem_common.config import Config
from ctxmem_common.cpuset import format_cpulist, pin_process
from ctxmem_common.errors import ConfigError
from ctxmem_common.identity import check_identity_mode, is_local_listen, network_listens
from ctxmem_common.keyfile import load_service_key
from ctxmem_common.netaddr import split_hostport
from ctxmem_common.proto import ctxmem_pb2_grpc as pb_grpc
from ctxmem_dpu import grpclog, sdnotify
from ctxmem_dpu.control.auth import SessionAuthInterceptor, end_untrusted_sessions
from ctxmem_dpu.control.localpeer import LocalUsers
from ctxmem_dpu.control.locate_http import authenticated_locate
from ctxmem_dpu.control.servicer import ContextMemoryServicer
from ctxmem_dpu.gctune import tune_gc
from ctxmem_dpu.listenguard import FdReserve, raise_nofile_limit
from ctxmem_dpu.metrics import HttpEndpoint
from ctxmem_dpu.pod.node import PodNode, pod_master_key
from ctxmem_dpu.pod.sources import RemoteSource
from ctxmem_dpu.storage import DeviceSpec, StorageBackend, open_backend
from ctxmem_dpu.store import BlockStore
from ctxmem_dpu.tls import ServerTls
from ctxmem_dpu.transport.rdma import RdmaServer
from ctxmem_dpu.transport.shm import ShmServer
from ctxmem_dpu.transport.tcp import TcpDataServer

if TYPE_CHECKING:
    from ctxmem_dpu import kv_events
    from ctxmem_dpu.s3.server import S3Door

log = logging.getLogger(__name__)

# Set to "1" by `ctxmem bench security` to measure the service without the per-call
# session check; honoured only in insecure mode (loopback only), ignored otherwise.
BENCH_NO_AUTH_ENV = "CTXMEM_BENCH_NO_SESSION_AUTH"


class Service:
    """The whole service in one process: storage backends, block store, data servers,
    the gRPC control plane and the metrics endpoint, started and stopped in order.

    Use ``async with Service(cfg) as svc:`` to guarantee :meth:`stop` (which is safe after
    a start that failed half way: it stops what did start).

    Lifetime: each resource registers its closer the moment it exists (:meth:`_on_stop`),
    on one exit stack; :meth:`stop` first ends the calls that would hold the gRPC server's
    grace (``_DRAIN``: the TLS watch, the RDMA server's RdmaAttach calls, the pod, the
    Hold calls, the KV events, then the server itself), then unwinds the stack: everything
    else closes in the reverse of its start, the block store and the devices last. Each
    closer runs once; one that fails does not keep the others from running.
    """

    # What stop() closes first, in this order, before the rest in reverse of start.
    _DRAIN = ("tls_watch", "rdma", "pod", "holds", "events", "grpc")

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.instance_id = uuid.uuid4().hex
        self.backends: list[StorageBackend] = []
        self.store: BlockStore | None = None
        self.server: grpc.aio.Server | None = None
        self.servicer: ContextMemoryServicer | None = None
        self.shm: ShmServer | None = None
        self.tcp: TcpDataServer | None = None
        self.rdma: RdmaServer | None = None
        self.http: HttpEndpoint | None = None
        self.s3: S3Door | None = None
        self.tls: ServerTls | None = None
        self._tls_watch: asyncio.Task[None] | None = None
        self.pod: PodNode | None = None
        self.events: kv_events.KvEventPublisher | None = None
        self._lease_redis: Any = None  # redis.asyncio.Redis of the slab leases (shared flash)
        self.ready = False
        self.grpc_port = 0
        self._stopped = False
        self._stack = AsyncExitStack()
        self._closers: dict[str, Callable[[], Awaitable[None]]] = {}
        self._grace_s = 5.0
        # Free fds below which every listener refuses new unauthenticated connections.
        self.fd_reserve = FdReserve(cfg.service.fd_reserve)

    def _on_stop(self, name: str, close: Callable[[], Awaitable[None]]) -> None:
        """Register ``close`` for what was just made: run once, by :meth:`stop`'s drain
        (names in ``_DRAIN``) or by the exit stack, in the reverse of start order."""
        done = False

        async def once() -> None:
            nonlocal done
            if not done:
                done = True
                await close()

        self._closers[name] = once
        self._stack.push_async_callback(once)

    def _device_specs(self) -> list[DeviceSpec]:
        # Typed and validated when the config loaded: no round trip through dicts.
        return [dev.device_spec(f"flash.devices[{i}]")
                for i, dev in enumerate(self.cfg.flash.devices)]

    async def start(self) -> None:
        cfg = self.cfg
        # Nothing listens without an identity rule; insecure mode only on loopback.
        mode = check_identity_mode(cfg)
        if cfg.tls.enabled:  # read and check the files before anything else starts
            self.tls = ServerTls(cfg.tls)
        elif mode == "tokens" and any(
                not is_local_listen(addr) for _key, addr in network_listens(cfg)):
            log.warning(
                "tenant tokens, session tokens and block bytes cross the network in clear "
                "(no tls: section) on %s; set tls.cert_file/key_file (and client_ca_file "
                "for mutual TLS) unless this network is trusted",
                ", ".join(addr for _key, addr in network_listens(cfg)))
        if mode == "insecure":
            log.warning(
                "service.insecure: true: the tenant name clients send is trusted (no "
                "tenant tokens) within each local user (service.local_users: %s); "
                "acceptable only with every client on this host (listening on %s). Set "
                "service.tenant_tokens for anything else.", cfg.service.local_users,
                ", ".join(addr for _key, addr in network_listens(cfg)))
        soft, _hard = raise_nofile_limit()
        held = (cfg.service.grpc_max_connections + cfg.metrics.max_connections
                + cfg.service.fd_reserve + 2 * cfg.data_plane.max_connections
                + (cfg.s3.max_connections if cfg.s3.listen else 0))
        if soft < held:
            log.warning("open-files limit %d is below what the listeners' caps may hold "
                        "with the fd reserve (%d: service.grpc_max_connections, "
                        "metrics.max_connections, 2 x data_plane.max_connections, "
                        "s3.max_connections, service.fd_reserve); a flood can then reach "
                        "the reserve, and new unauthenticated connections are refused until "
                        "it ends: raise LimitNOFILE", soft, held)
        master_key = load_service_key(cfg.encryption, create=True)
        specs = self._device_specs()
        flash_paths: list[tuple[str, str]] = []
        crypto_off: list[str] = []
        loop = asyncio.get_running_loop()
        for spec in specs:
            backend = open_backend(spec)
            path = await loop.run_in_executor(None, backend.attach)
            self.backends.append(backend)
            self._on_stop(f"backend {spec.name}", functools.partial(_detach, backend))
            flash_paths.append((backend.spec.name, path))
            if backend.offloads_encryption:
                crypto_off.append(backend.spec.name)
        # Shared flash (docs/pod.md): slabs of a device several services attach are leased
        # in the pod's index; nothing of it loads for a device that is not shared.
        shared = {d.name for d in cfg.flash.devices if d.shared}
        slab_leases = None
        if shared and not cfg.pod.enabled:
            raise ConfigError(f"flash devices {sorted(shared)} are shared "
                              f"(flash.devices[].shared): their slabs are leased in the pod's "
                              f"index; set pod.enabled with pod.index_url and pod.node_id, or "
                              f"make them non-shared")
        if shared:
            from ctxmem_dpu.pod.redis_conn import connect
            from ctxmem_dpu.pod.slab_leases import SlabLeases

            self._lease_redis = connect(cfg.pod)
            self._on_stop("lease_redis", self._close_lease_redis)
            slab_leases = SlabLeases(self._lease_redis, cfg.pod.node_id, cfg.pod.slab_lease_s)
        self.store = BlockStore(cfg, flash_paths, master_key, crypto_off,
                                slab_leases=slab_leases)
        for backend in self.backends:  # where a failed device is now (see _usable_again)
            self.store.locators[backend.spec.name] = backend.locate
        self._on_stop("store", self.store.close)
        await self.store.start()

        data_endpoint = ""
        if "tcp" in cfg.service.transports:
            host, port = split_hostport(cfg.service.data_listen, "service.data_listen")
            self.tcp = TcpDataServer(self.store, host, port, cfg.data_plane)
            self.tcp.tls = self.tls
            self.tcp.fd_reserve = self.fd_reserve
            self._on_stop("tcp", self.tcp.close)
            await self.tcp.start()
            data_endpoint = self.tcp.address
        shm_path = ""
        if "shm" in cfg.service.transports:
            self.shm = ShmServer(self.store, cfg.service.shm_socket)
            self.shm.limits = cfg.data_plane  # deadlines and caps (SocketDataServer)
            self.shm.fd_reserve = self.fd_reserve
            self._on_stop("shm", self.shm.close)
            await self.shm.start()
            shm_path = self.shm.address
        if "rdma" in cfg.service.transports:  # RDMA (issue 3): opens the verbs device
            self.rdma = RdmaServer(self.store, cfg.service.rdma_listen, cfg.service.rdma_device,
                                   cfg.service.rdma_gid_index, cfg.service.rdma_access)
            self._on_stop("rdma", self.rdma.close)
            await self.rdma.start()

        interceptors = [SessionAuthInterceptor(self.store.live_session,
                                               tls=self.tls is not None, server_tls=self.tls)]
        if self.tls is not None and self.tls.mutual:  # a rotated CA ends what it refuses
            tls, store = self.tls, self.store
            tls.on_ca_change.append(functools.partial(end_untrusted_sessions, store, tls))
            self._tls_watch = asyncio.create_task(tls.watch(), name="ctxmem-tls-watch")
            self._on_stop("tls_watch", self._cancel_tls_watch)
        if os.environ.get(BENCH_NO_AUTH_ENV) == "1" and mode == "insecure":
            # `ctxmem bench security` only: the cost of the per-call check, measured on
            # loopback in insecure mode (ignored in any other mode).
            log.warning("%s=1: per-call session tokens are NOT checked (benchmark only)",
                        BENCH_NO_AUTH_ENV)
            interceptors = []
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.so_reuseport", 0),
            # Before authentication (docs/security.md, "Listeners"): the TLS handshake
            # and the HTTP/2 preface within the deadline (grpc core's default is 120 s),
            # and a cap on the connections open at once (grpc core counts them all: it
            # has no unauthenticated-only or per-source cap).
            ("grpc.server_handshake_timeout_ms",
             max(1, int(cfg.service.grpc_handshake_timeout_s * 1000))),
            ("grpc.max_allowed_incoming_connections", cfg.service.grpc_max_connections),
        ]
        if cfg.service.keepalive_s > 0:
            # Ping a connection with calls open (every shim keeps a Hold per session) after
            # keepalive_s without traffic; no answer within keepalive_s drops it, which ends
            # its Hold calls: a client gone without closing its connection is noticed.
            ms = int(cfg.service.keepalive_s * 1000)
            options += [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", ms),
                        ("grpc.http2.max_pings_without_data", 0)]
        grpclog.install()  # an answer to a call that just ended: one line, no traceback
        self.server = grpc.aio.server(interceptors=interceptors, options=options)
        self._on_stop("grpc", self._stop_grpc)
        servicer = ContextMemoryServicer(self.store, self.instance_id, shm_path, data_endpoint,
                                         self.health)
        self.servicer = servicer
        self._on_stop("holds", self._close_holds)  # Hold calls end now, not after the grace
        if mode == "insecure" and cfg.service.local_users != "shared":
            servicer.local_users = LocalUsers(cfg.service.local_users, cfg.service.listen)
        pb_grpc.add_ContextMemoryServicer_to_server(servicer, self.server)
        servicer.rdma = self.rdma  # RdmaInfo/RdmaAttach answer UNAVAILABLE without it
        if cfg.pod.enabled:  # the pod tier (docs/pod.md): index, heartbeat, peer fetch
            # Fetch sources tried before the peer, in order: shared flash (part 3) is
            # appended here when a flash device is marked shared.
            sources: list[RemoteSource] = []
            # A pod node has a real master key (never the public fallback): what peers and
            # shared devices hand over verifies under it or is a miss.
            pod_key = pod_master_key(cfg, master_key)
            if shared:
                from ctxmem_dpu.pod.shared_flash import SharedFlashSource

                sources.append(SharedFlashSource(
                    [path for name, path in flash_paths if name in shared], pod_key,
                    encrypt=cfg.encryption.enabled))
            self.pod = PodNode(cfg, self.store, pod_key, sources,
                               shared_location=self.store.shared_location)
            self._on_stop("pod", self.pod.close)  # leave the pod first: peers stop asking
            await self.pod.start()
            servicer.pod = self.pod
            if self.shm is not None:  # Lookup/Acquire need the cluster: over gRPC
                self.shm.pod = True
            if self.tcp is not None:
                self.tcp.pod = True
        if cfg.events.endpoint:  # KV events for routers (docs/operations.md, "Routers")
            # Imported only when configured: pyzmq and msgpack are not needed otherwise
            # (the engines' side environments run the service without them).
            from ctxmem_dpu.kv_events import KvEventPublisher

            self.events = KvEventPublisher(cfg.events, cfg.pod.node_id if cfg.pod.enabled
                                           else "", self.store.namespaces.get,
                                           self.store.counters)
            self.store.block_listeners.append(self.events.note)
            self._on_stop("events", self._close_events)
            self.events.start()
            log.info("KV events on %s (topic %s@...)", self.events.endpoint, cfg.events.topic)
        listen = cfg.service.listen
        if self.tls is not None:
            self.grpc_port = self.server.add_secure_port(listen, self.tls.grpc_credentials())
        elif servicer.local_users is not None and servicer.local_users.unix:
            # A Unix socket's caller is this service's user: the file is made 0600 before
            # any other user could connect (umask around the bind, at start-up).
            old_mask = os.umask(0o177)
            try:
                self.grpc_port = self.server.add_insecure_port(listen)
            finally:
                os.umask(old_mask)
        else:
            self.grpc_port = self.server.add_insecure_port(listen)
        if self.grpc_port == 0:
            raise ConfigError(f"service.listen: cannot bind {listen!r} (in use, or bad address)")
        await self.server.start()
        if servicer.local_users is not None:
            servicer.local_users.port = self.grpc_port
        if cfg.metrics.listen:
            host, port = split_hostport(cfg.metrics.listen, "metrics.listen")
            self.http = HttpEndpoint(self.store, host, port, lambda: self.ready,
                                     request_timeout_s=cfg.metrics.request_timeout_s,
                                     max_connections=cfg.metrics.max_connections,
                                     head_timeout_s=cfg.metrics.head_timeout_s,
                                     max_per_source=cfg.metrics.max_connections_per_source,
                                     fd_reserve=self.fd_reserve,
                                     locate=functools.partial(authenticated_locate, self.store,
                                                              self.pod),
                                     locate_refusal=_locate_refusal(cfg.metrics.listen,
                                                                   self.tls is not None))
            self._on_stop("http", self.http.close)
            await self.http.start()
        if cfg.s3.listen:  # the S3 door (docs/s3.md); botocore only when configured
            try:
                from ctxmem_dpu.s3.server import S3Door
            except ImportError as exc:
                raise ConfigError(f"s3.listen is set but the S3 endpoint's packages are "
                                  f"missing ({exc}); install them with pip install "
                                  f"'ctxmem-kv[s3]' (aiohttp, botocore), or set "
                                  f"s3.listen: \"\"") from None

            if self.tls is None and not is_local_listen(cfg.s3.listen):
                log.warning("s3.listen %s: object bytes cross the network in clear (no tls: "
                            "section; SigV4 signs requests, it does not encrypt them); set "
                            "tls.cert_file/key_file unless this network is trusted",
                            cfg.s3.listen)

            self.s3 = S3Door(self.store, cfg, self.tls, self.fd_reserve)
            if self.pod is not None:  # GETs read what other nodes hold; deletes reach them
                self.s3.objects.pull = self.pod.fetch.pull
                self.s3.objects.confirm_delete = self.pod.confirm_delete
            self._on_stop("s3", self.s3.close)
            await self.s3.start()
        self.ready = True
        log.info("ctxmem serving (%s mode): grpc %s, transports %s, %d flash device(s), "
                 "identity %s, TLS %s, AES-XTS %s, CRC32C %s", cfg.mode, listen,
                 ",".join(cfg.service.transports), len(flash_paths), mode,
                 "off" if self.tls is None else "mutual" if self.tls.mutual else "server-only",
                 XTS_IMPLEMENTATION, CRC32C_IMPLEMENTATION)

    async def __aenter__(self) -> Service:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()

    def health(self) -> str:
        if self.store is None:
            return "starting"
        bad = [d.name for d in self.store.flash.devices if not d.healthy]
        full = self.store.full_devices
        parts = ([f"flash device(s) {', '.join(bad)} failed"] if bad else []) + (
            [f"flash device(s) {', '.join(full)} full"] if full else [])
        return f"degraded: {'; '.join(parts)}" if parts else "serving"

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop what started: first the drain (``_DRAIN``, in order: the long calls end,
        then the gRPC server with ``grace_s``), then the rest in the reverse of start's
        order (the block store, the slab leases' connection and the devices last).
        Idempotent, and safe after a failed start (it stops what did start)."""
        if self._stopped:
            return
        self._stopped = True
        self.ready = False
        self._grace_s = grace_s
        async with self._stack:  # unwinds whatever the drain leaves, even if it raises
            for name in self._DRAIN:
                close = self._closers.get(name)
                if close is not None:
                    await close()

    # -- closers (each registered by _on_stop once its resource exists) --------------------
    async def _cancel_tls_watch(self) -> None:
        if self._tls_watch is not None:
            self._tls_watch.cancel()

    async def _close_holds(self) -> None:
        if self.servicer is not None:
            self.servicer.close_holds()

    async def _close_events(self) -> None:
        if self.events is not None:
            if self.store is not None:
                self.store.block_listeners.remove(self.events.note)
            await self.events.close()

    async def _stop_grpc(self) -> None:
        if self.server is not None:
            await self.server.stop(self._grace_s)

    async def _close_lease_redis(self) -> None:
        # Unwound after the store (registered before it): the store released its slab
        # leases through this connection.
        if self._lease_redis is not None:
            await self._lease_redis.aclose()
            self._lease_redis = None


async def _detach(backend: StorageBackend) -> None:
    try:
        backend.detach()
    except Exception:
        log.exception("detaching flash device %s failed", backend.spec.name)


def _locate_refusal(metrics_listen: str, tls: bool) -> str:
    """Why the metrics port must refuse session tokens (``POST /v1/locate``), or "": when
    gRPC has TLS, a token must not cross the network in the metrics port's plaintext, so
    there it is served on loopback only."""
    if not tls or is_local_listen(metrics_listen):
        return ""
    return (f"session tokens are not accepted on the metrics port beyond loopback "
            f"(metrics.listen {metrics_listen!r} is plaintext HTTP while the gRPC port has "
            f"TLS); ask gRPC Locate, or bind metrics.listen to loopback and ask there")


def apply_cpu_affinity(cfg: Config) -> None:
    """Pin the whole process to ``service.cpu_affinity`` (every thread now; threads
    started later, the gRPC, executor and I/O threads, inherit it). Called by
    :func:`serve`, the process's entry, before the service starts any thread; not by
    :class:`Service`, which tests also run inside their own process."""
    cpus = cfg.service.cpu_affinity
    if not cpus:
        log.info("CPU affinity: not pinned (service.cpu_affinity empty); may run on CPUs %s",
                 format_cpulist(os.sched_getaffinity(0)))
        return
    tids = pin_process(cpus)
    log.info("CPU affinity: pinned to CPUs %s (service.cpu_affinity; %d thread(s) now, "
             "later ones inherit it)", format_cpulist(cpus), len(tids))


async def serve(cfg: Config, ready_file: str | None = None) -> None:
    apply_cpu_affinity(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with Service(cfg) as svc:
        tune_gc()  # start-up's objects out of the collector's reach (ctxmem_dpu.gctune)
        if ready_file:
            # No link followed, no other user's file truncated (ctxmem_common.safepaths).
            safepaths.write_ready_file(ready_file, f"{svc.grpc_port}\n")
        # systemd Type=notify: started only now, once every listener is bound.
        sdnotify.notify("READY=1", f"STATUS={svc.health()}", f"MAINPID={os.getpid()}")
        await stop.wait()
        log.info("shutting down")
        sdnotify.notify("STOPPING=1", "STATUS=shutting down")
