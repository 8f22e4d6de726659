"""The service's YAML configuration: one schema, validated strictly.

Every key is declared here as a dataclass field; an unknown key, a wrong type or an
invalid value raises :class:`ConfigError` naming the full key path and what is allowed,
e.g. ``flash.write_policy: 'write-back' is not one of ['write_back', 'write_through']``.
Sizes accept ``"64MiB"``-style strings. :func:`default_config_yaml` is the embedded default
(fallback mode) that ``ctxmem serve`` uses without ``--config``: its paths are resolved
when it is loaded, for the user loading it (:mod:`ctxmem_common.safepaths`): the socket
under ``/run/ctxmem`` and the flash file and key under ``/var/lib/ctxmem`` as root, the
user's XDG runtime and state directories otherwise; never ``/tmp`` or ``/var/tmp``, where
another local user could prepare them.

Flash devices' backend sections (``kernel:``, ``spdk:``) are typed too: they are built
into :mod:`ctxmem_common.device_settings` dataclasses while the config loads, so a bad
backend key fails here (``flash.devices[0].kernel.bogus: unknown key; ...``), not at
service start, and the storage backends take the same objects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ctxmem_common.config_defaults import (
    default_config_yaml,
    default_shm_socket,
)
from ctxmem_common.config_env import env_rows
from ctxmem_common.config_pod import PodConfig, check_pod
from ctxmem_common.config_s3 import S3AccessKey, S3Config, check_s3
from ctxmem_common.config_schema import Size, build, reference_rows
from ctxmem_common.cpuset import CpuList, check_cpus
from ctxmem_common.device_settings import (
    DeviceSpec,
    KernelOptions,
    SpdkOptions,
    device_spec,
)
from ctxmem_common.errors import ConfigError

Transport = Literal["shm", "tcp", "rdma"]
RdmaAccess = Literal["auto", "mw", "mr"]
LocalUsers = Literal["separate", "owner", "shared"]


@dataclass(frozen=True)
class ServiceConfig:
    listen: str = "127.0.0.1:50051"
    data_listen: str = "127.0.0.1:50052"
    # Unset: data.sock in the user's runtime directory (/run/ctxmem as root), resolved
    # when the config loads; never a shared temp directory.
    shm_socket: str = field(default_factory=lambda: default_shm_socket(),
                            metadata={"doc_default": "RUNTIME_DIR/data.sock"})
    transports: list[Transport] = field(default_factory=lambda: ["shm", "tcp"])
    lease_ttl_s: float = 30.0
    allocation_ttl_s: float = 30.0
    io_threads: int = 2
    # The most bytes one I/O-thread job moves before the I/O queue may start another in
    # its place (store/ioqueue.py, "Pieces"): a demotion's payloads go in parts of at
    # most this (one block at least), a cold get's checks yield between runs after this
    # many bytes. A running job is never interrupted, so a get waits at most about one
    # piece of the work running when it arrives. 0: no bound (a part per I/O thread).
    io_piece_bytes: Size = Size(1 << 20)
    # The gRPC port before authentication (docs/security.md, "Listeners"): a connection
    # must finish its TLS handshake and HTTP/2 preface within grpc_handshake_timeout_s,
    # and at most grpc_max_connections are open at once (grpc core counts every
    # connection: it has no per-source or unauthenticated-only cap).
    grpc_handshake_timeout_s: float = 5.0
    grpc_max_connections: int = 2048
    # File descriptors kept free for authenticated clients and health probes: every
    # listener refuses new unauthenticated connections while fewer are free (the soft
    # open-files limit is raised to the hard one at start).
    fd_reserve: int = 64
    # Threads that check a Commit's batch (the CRC32C of every slot the client wrote) in
    # parallel: the client waits on the Commit, so its core is idle meanwhile. 0: min(4,
    # CPUs the service may run on); 1: the whole batch in one call on one thread.
    commit_crc_threads: int = 0
    # RDMA transport: an IP address of the RDMA device (the BlueField SF's, the RNIC's,
    # rxe0's netdev); it picks the device and its RoCE v2 GID. No port: queue pairs are
    # connected over the gRPC control plane. The device can be named explicitly.
    rdma_listen: str = ""
    rdma_device: str = ""
    rdma_gid_index: int = -1  # -1: pick the RoCE v2 GID of the listen address
    # How a client's rkeys are scoped to its own slots and end with its lease or
    # allocation: "mw" binds a type-2 memory window per granted run of slots, "mr"
    # registers a memory region per run; "auto" picks "mw" where the device has type-2
    # windows and checks their bounds (not Soft-RoCE), else "mr".
    rdma_access: RdmaAccess = "auto"
    # Identity (ctxmem_common.identity, docs/security.md): tenants and their tokens
    # (Connect must present the tenant's, at least 16 characters), or, on one host only,
    # insecure: true (trust the tenant name a client sends; refused unless every listen
    # address is loopback or a Unix socket). The service refuses to start with neither.
    tenant_tokens: dict[str, str] = field(default_factory=dict)
    insecure: bool = False
    # Insecure mode only: tenant names with an open session at once. The names are not
    # authenticated and every cap is per name, so without this one client could open
    # sessions under thousands of names and shrink every tenant's fair share to nothing
    # (issue 25); a Connect under a new name past it is refused (RESOURCE_EXHAUSTED).
    insecure_max_tenants: int = 64
    # Insecure mode only: how local users are told apart (issue 25). The kernel names the
    # user behind each loopback connection (ctxmem_dpu.control.localpeer). "separate":
    # a user other than the service's own acts under its own tenants, NAME@uidN (it can
    # neither read nor delete nor replace the service user's NAME), and the tenant-name cap
    # counts per user; "owner": only the service's own user may connect; "shared": any
    # local user may act as any tenant (one trust domain: a single-user machine).
    local_users: LocalUsers = "separate"
    # Shared-memory socket (issue 12). MAP replies (each carries a slab fd) queued per
    # connection while the client is not reading; a connection whose queue overflows, or
    # that reads none of it for shm_reply_deadline_s, is disconnected so it can never
    # block the service.
    shm_reply_queue: int = 64
    shm_reply_deadline_s: float = 5.0
    # The control fast path on the shared-memory socket and the TCP data channel
    # (ACQUIRE/RELEASE, LOOKUP, ALLOCATE/COMMIT without gRPC; ctxmem_common.shm_ops): the
    # largest request body it reads. The default fits the largest legal Lookup or
    # Allocate (262,144 keys of 64 bytes = 16 MiB) plus its header; a larger one is
    # refused and the connection closed. 0 turns the fast path off on both (clients then
    # use gRPC).
    shm_op_max_bytes: int = (16 << 20) + 4096
    # Peer credentials (SO_PEERCRED) allowed on the shared-memory socket: a peer whose uid
    # is in shm_allowed_uids or whose gid is in shm_allowed_gids. Both empty: any process
    # that can open the socket file (its mode, 0660, is then the only gate).
    shm_allowed_uids: list[int] = field(default_factory=list)
    shm_allowed_gids: list[int] = field(default_factory=list)
    # Staging memory owned by the service (issue 27 item 1; docs/architecture.md,
    # "Staged puts"): sealed memfds a same-host client maps and fills, then puts with one
    # STAGE_PUT that the service copies into slots with the CRC32C fused. The most bytes
    # of staging regions all tenants together may hold (each tenant is capped by
    # quotas.*.staging_max_bytes); 0 turns staging off.
    staging_max_bytes: Size = Size(1 << 30)
    # Back staging regions with huge pages (MFD_HUGETLB, 2 MiB) when the kernel's pool has
    # them, else normal pages. Off by default: a client can punch a hole in a hugetlb
    # region (fallocate), and if the pool is empty when the service next touches that
    # page the service gets SIGBUS; turn it on where the pool has headroom for every
    # region (vm.nr_hugepages) and the clients are trusted not to punch holes.
    staging_hugepages: bool = False
    # A session with no control-plane call and no data-plane request (and no shared-memory
    # connection open) for this long is closed with its allocations and leases, so a
    # client that vanished cannot hold slots, pins or a session slot forever (issue 12).
    session_idle_s: float = 600.0
    # A session whose client keeps a Hold call open (the shim does, since Connect's
    # ``hold``) is ended this long after its last Hold call ended (the client process died,
    # its connection dropped) or after Connect if no Hold ever came (the client gave up on
    # the Connect), unless another Hold for it opens first. Sessions of older clients keep
    # the idle rule alone (docs/security.md, "Session lifetime").
    session_orphan_s: float = 5.0
    # The gRPC listener pings a client connection that has calls open (every shim holds
    # one per session) after this long without traffic and drops the connection when the
    # ping is not answered within it: how a client that vanished without closing its
    # connection (host down, network cut) is noticed. 0: no pings (only closed connections
    # are noticed).
    keepalive_s: float = 10.0
    # The CPUs the whole service process (every thread) runs on, set with
    # sched_setaffinity at start: a list of CPU ids or a cpulist string ("1", "2-3,6").
    # In the fallback mode it keeps the service off the engine's cores (as SPDK's core
    # mask does); CPUs that do not exist or are outside the process's allowed set are
    # refused at load. Empty: no pinning (the scheduler's choice).
    cpu_affinity: CpuList = field(default_factory=lambda: CpuList([]))


@dataclass(frozen=True)
class DataPlaneConfig:
    """Bounds on the socket data servers (TCP, shared memory's Unix socket): a slow, buggy
    or hostile client holds at most these, for at most this long (docs/security.md)."""

    # Seconds a new connection has, from accept, to finish its TLS handshake (if any) and
    # send its HELLO (one deadline for both) before it is closed.
    hello_timeout_s: float = 5.0
    # Seconds to receive the rest of a request once its first byte arrived (header and
    # WRITE payload); a write that stalls past it is closed and its allocation expires.
    read_timeout_s: float = 10.0
    # Seconds an authenticated connection may sit between requests before it is closed.
    idle_timeout_s: float = 300.0
    # Data connections open at once, per server, in total and per tenant; over a cap a new
    # connection is answered "too many connections" and closed.
    max_connections: int = 1024
    max_connections_per_tenant: int = 64
    # Connections accepted and not yet authenticated by their HELLO, in total and per
    # source (peer IP; every Unix-socket client is one source): over a cap the OLDEST
    # such connection is closed to admit the new one.
    max_unauthenticated: int = 128
    max_unauthenticated_per_source: int = 32


@dataclass(frozen=True)
class MetricsConfig:
    listen: str = "127.0.0.1:9464"  # "" disables the HTTP endpoint (/metrics, /healthz, /readyz)
    # Seconds one HTTP request may take from accept to the last byte of the answer.
    request_timeout_s: float = 5.0
    # Seconds from accept for the whole request head (request line and headers) to
    # arrive, however it trickles in; a connection waiting for its head holds no thread.
    head_timeout_s: float = 2.0
    # HTTP connections open at once (waiting for their head or being answered); over it,
    # or over max_connections_per_source from one peer IP, the oldest connection still
    # waiting for its head is closed to admit the new one.
    max_connections: int = 128
    max_connections_per_source: int = 64


@dataclass(frozen=True)
class DramConfig:
    size: Size = Size(1 << 30)
    slab_size: Size = Size(64 << 20)
    # Allocate and fault in the whole tier at start (no page faults on the data path).
    prefault: bool = True


@dataclass(frozen=True)
class FlashDeviceConfig:
    name: str
    backend: Literal["local", "kernel", "spdk"] = "local"
    path: str = ""
    size: Size = Size(0)
    create: bool = False
    kernel: KernelOptions | None = None  # backend 'kernel' only (docs/storage.md)
    spdk: SpdkOptions | None = None  # backend 'spdk' only (docs/storage.md)
    # Attached by several services of a pod (its flash enclosure): each writes only the
    # slabs it leases in the pod's index, any reads any record (docs/pod.md).
    shared: bool = False

    def device_spec(self, where: str) -> DeviceSpec:
        """This device as the storage layer takes it (``where``: its key path, which
        prefixes any error). The loader has run the same rules, so only an entry built by
        hand that breaks them raises.

        Raises:
            ConfigError: naming the key path.
        """
        try:
            return device_spec(where, name=self.name, backend=self.backend,
                               size_bytes=int(self.size) or None, path=self.path or None,
                               create=self.create, kernel=self.kernel, spdk=self.spdk)
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class FlashConfig:
    write_policy: Literal["write_back", "write_through"] = "write_back"
    slab_size: Size = Size(256 << 20)
    o_direct: bool = True
    devices: list[FlashDeviceConfig] = field(default_factory=list)
    # Background demotion: how many committed DRAM blocks to batch per flash write round
    # (at least; see demote_batch_bytes).
    demote_batch: int = 32
    # ...and a batch also fills up to this many bytes (slot sizes), whichever bound
    # takes more blocks, up to 256 blocks (the demoter's per-block event-loop work):
    # every batch costs two fdatasyncs and four I/O-thread hand-offs, which 32 blocks of
    # 2 MiB amortise and 32 of 64 KiB (2 MiB) do not. 0: by count only (as before this
    # key existed).
    demote_batch_bytes: Size = Size(64 << 20)
    # Shed puts (refuse them at once, ErrorCode SHED) instead of waiting for write-back
    # when making room would mean demoting inline while more than this many bytes of
    # committed blocks already wait for flash. 0: never shed (a put waits, as before).
    shed_backlog_bytes: Size = Size(0)
    # A single device call (read, write, fdatasync) slower than this many seconds marks
    # the device slow: the store serves around it (DRAM only) until a probe is fast again
    # (docs/reliability.md). The chaos campaign and the reliability tests lower it.
    slow_io_s: float = 2.0
    # How often (seconds) failed or slow flash devices are probed to bring them back.
    probe_interval_s: float = 2.0
    # A get whose run holds more than this many bytes of flash-only blocks is served in
    # pieces: each Acquire promotes one piece and reads the next ahead (issue 17). 0 (the
    # default): off, a cold get promotes its whole run (docs/benchmarks.md has the A/Bs).
    cold_piece_bytes: Size = Size(0)


@dataclass(frozen=True)
class EvictionConfig:
    # Segmented LRU: a block hit this many times (by distinct lookups/acquires) moves to
    # the protected segment and is evicted only after every unprotected block.
    protect_after_hits: int = 2
    protected_fraction: float = 0.8


@dataclass(frozen=True)
class TenantQuota:
    """One tenant's limits (docs/security.md, "Quotas and fair eviction").

    Shares are fractions of a tier (DRAM counted in slabs, since a slab belongs to one
    namespace; flash in bytes). A guaranteed share of 0 means the fair share: the tier
    divided by the number of tenants with an open session.
    """

    dram_guaranteed: float = 0.0
    dram_max: float = 1.0
    flash_guaranteed: float = 0.0
    flash_max: float = 1.0
    # Open leases and open allocations (grants) at once.
    max_leases: int = 1024
    max_allocations: int = 1024
    # Fraction of the DRAM tier's slabs in which the tenant may hold leased blocks or
    # allocated slots at once (a held slot keeps its whole slab from being reclaimed);
    # 0: the tier less the other active tenants' guaranteed shares.
    dram_held_max: float = 0.0
    max_sessions: int = 64
    max_namespaces: int = 64
    # Bytes of staging regions (service-owned memory a client maps and puts from) the
    # tenant's sessions may hold at once; a STAGE_CREATE past it is refused.
    staging_max_bytes: Size = Size(256 << 20)
    # The tenant's share of the I/O threads within a class (loads, stores) against other
    # tenants with work waiting: 2.0 gets twice the jobs of a tenant at 1.0.
    io_weight: float = 1.0


@dataclass(frozen=True)
class QuotasConfig:
    default: TenantQuota = field(default_factory=TenantQuota)
    tenants: dict[str, TenantQuota] = field(default_factory=dict)
    # Tenants reported by name in Stats and /metrics; the rest are summed as "_other".
    stats_tenants: int = 32

    def of(self, tenant: str) -> TenantQuota:
        """The quota of ``tenant``: its own entry, else ``default``."""
        return self.tenants.get(tenant, self.default)


@dataclass(frozen=True)
class EncryptionConfig:
    enabled: bool = True
    key_file: str = ""  # 64 hex characters (a 32-byte master key)
    key_env: str = "CTXMEM_MASTER_KEY"


@dataclass(frozen=True)
class TlsConfig:
    """TLS 1.3 on the gRPC control plane and the TCP data plane (docs/security.md, "TLS
    and mTLS"). On when ``cert_file`` and ``key_file`` are set; ``client_ca_file`` makes
    it mutual: client certificates are required and name the tenant."""

    cert_file: str = ""  # server certificate chain, PEM
    key_file: str = ""  # its private key, PEM (owner-only readable)
    client_ca_file: str = ""  # CA bundle for client certificates; set => mutual TLS
    # How often (seconds) the files' mtimes are checked; changed files are loaded for
    # new connections without a restart (certificate rotation).
    reload_interval_s: float = 10.0

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file and self.key_file)

    @property
    def mutual(self) -> bool:
        return self.enabled and bool(self.client_ca_file)


@dataclass(frozen=True)
class EventsConfig:
    # KV events for routers (docs/operations.md, "Routers"): vLLM's BlockStored /
    # BlockRemoved batches on a ZMQ PUB socket. "" off; "tcp://127.0.0.1:PORT" or
    # "ipc:///PATH": loopback or a Unix socket only (the events name every tenant's block
    # hashes, and ZMQ here has no authentication).
    endpoint: str = ""
    # Each batch goes out under "<topic>@<node>@<model id>" (llm-d's "kv@<pod>@<model>").
    topic: str = "kv"
    # Events are batched this long (ms) before a batch is sent.
    batch_ms: int = 20
    # Events held between batches; beyond it new ones are dropped (kv_events_dropped).
    max_pending: int = 100_000


@dataclass(frozen=True)
class LoggingConfig:
    level: Literal["debug", "info", "warning", "error"] = "info"


@dataclass(frozen=True)
class Config:
    mode: Literal["fallback", "dpu"] = "fallback"
    service: ServiceConfig = field(default_factory=ServiceConfig)
    data_plane: DataPlaneConfig = field(default_factory=DataPlaneConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    dram: DramConfig = field(default_factory=DramConfig)
    flash: FlashConfig = field(default_factory=FlashConfig)
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    quotas: QuotasConfig = field(default_factory=QuotasConfig)
    encryption: EncryptionConfig = field(default_factory=EncryptionConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    pod: PodConfig = field(default_factory=PodConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    s3: S3Config = field(default_factory=S3Config)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def replace(self, **sections: Any) -> Config:
        return dataclasses.replace(self, **sections)


def __getattr__(name: str) -> str:
    # DEFAULT_CONFIG_YAML, the name this text always had: resolved on each access.
    if name == "DEFAULT_CONFIG_YAML":
        return default_config_yaml()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check(cfg: Config) -> None:
    """Cross-field rules that types alone do not express."""
    if cfg.dram.slab_size < (1 << 20) or cfg.dram.slab_size % 4096:
        raise ConfigError("dram.slab_size: must be a multiple of 4 KiB and at least 1 MiB")
    if cfg.dram.size < cfg.dram.slab_size:
        raise ConfigError(
            f"dram.size: {cfg.dram.size} bytes is smaller than one slab "
            f"(dram.slab_size={cfg.dram.slab_size}); raise dram.size or lower dram.slab_size"
        )
    if cfg.flash.slab_size < (1 << 20) or cfg.flash.slab_size % 4096:
        raise ConfigError("flash.slab_size: must be a multiple of 4 KiB and at least 1 MiB")
    if cfg.flash.demote_batch < 1:
        raise ConfigError(f"flash.demote_batch: must be >= 1 (blocks per background "
                          f"demotion batch), got {cfg.flash.demote_batch}")
    if not (cfg.flash.slow_io_s > 0 and cfg.flash.probe_interval_s > 0):
        raise ConfigError(f"flash.slow_io_s and flash.probe_interval_s: must be > 0 (seconds), "
                          f"got {cfg.flash.slow_io_s} and {cfg.flash.probe_interval_s}")
    if cfg.flash.demote_batch_bytes > 1 << 30:
        raise ConfigError(f"flash.demote_batch_bytes: must be at most 1 GiB (0: batches by "
                          f"flash.demote_batch blocks only), got {cfg.flash.demote_batch_bytes}")
    names = [d.name for d in cfg.flash.devices]
    for i, name in enumerate(names):
        if not name:
            raise ConfigError(f"flash.devices[{i}].name: must not be empty")
        if names.index(name) != i:
            raise ConfigError(f"flash.devices[{i}].name: {name!r} is used twice")
    for i, dev in enumerate(cfg.flash.devices):
        if dev.backend == "local" and not dev.path:
            raise ConfigError(f"flash.devices[{i}].path: required for backend 'local'")
        dev.device_spec(f"flash.devices[{i}]")  # names, sizes, which keys each backend takes
    if cfg.service.io_piece_bytes < 0:
        raise ConfigError(f"service.io_piece_bytes: {cfg.service.io_piece_bytes} is "
                          f"negative; give a size (e.g. 1MiB) or 0 for no bound")
    if cfg.service.commit_crc_threads < 0:
        raise ConfigError(f"service.commit_crc_threads: {cfg.service.commit_crc_threads} is "
                          f"negative; use 0 (min(4, CPUs)) or a thread count")
    if not cfg.service.transports:
        raise ConfigError("service.transports: list at least one of ['shm', 'tcp', 'rdma']")
    if "rdma" in cfg.service.transports and not cfg.service.rdma_listen:
        raise ConfigError("service.rdma_listen: required (an IP address of the RDMA device) when "
                          "'rdma' is in service.transports")
    if cfg.service.rdma_listen:
        rdma_ip(cfg.service.rdma_listen)
    if "shm" in cfg.service.transports and not cfg.service.shm_socket:
        raise ConfigError("service.shm_socket: required when 'shm' is in service.transports")
    if cfg.service.lease_ttl_s <= 0 or cfg.service.allocation_ttl_s <= 0:
        raise ConfigError("service.lease_ttl_s and allocation_ttl_s must be > 0")
    if cfg.service.shm_reply_queue < 1:
        raise ConfigError("service.shm_reply_queue: must be >= 1 (MAP replies pending per "
                          "shared-memory connection)")
    if cfg.service.shm_op_max_bytes < 0:
        raise ConfigError("service.shm_op_max_bytes: must be >= 0 (0 turns the shared-memory "
                          "fast path off)")
    if cfg.service.shm_reply_deadline_s <= 0:
        raise ConfigError("service.shm_reply_deadline_s: must be > 0")
    if cfg.service.session_idle_s <= 0:
        raise ConfigError("service.session_idle_s: must be > 0")
    if cfg.service.insecure_max_tenants < 1:
        raise ConfigError("service.insecure_max_tenants: must be >= 1 (tenant names with "
                          "an open session at once, insecure mode)")
    if cfg.service.session_orphan_s <= 0:
        raise ConfigError("service.session_orphan_s: must be > 0 (seconds a session outlives "
                          "its client's last Hold call)")
    if cfg.service.keepalive_s < 0:
        raise ConfigError("service.keepalive_s: must be >= 0 (0: no keepalive pings)")
    check_cpus(cfg.service.cpu_affinity, "service.cpu_affinity")
    for name, q in [("default", cfg.quotas.default), *(
            (f"tenants.{t}", q) for t, q in cfg.quotas.tenants.items())]:
        _check_quota(f"quotas.{name}", q)
    if cfg.quotas.stats_tenants < 0:
        raise ConfigError("quotas.stats_tenants: must be >= 0")
    dp = cfg.data_plane
    for name in ("hello_timeout_s", "read_timeout_s", "idle_timeout_s"):
        if not getattr(dp, name) > 0:
            raise ConfigError(f"data_plane.{name}: must be > 0 (seconds)")
    for name in ("max_connections", "max_connections_per_tenant", "max_unauthenticated",
                 "max_unauthenticated_per_source"):
        if getattr(dp, name) < 1:
            raise ConfigError(f"data_plane.{name}: must be >= 1")
    m = cfg.metrics
    if not (m.request_timeout_s > 0 and m.head_timeout_s > 0) or min(
            m.max_connections, m.max_connections_per_source) < 1:
        raise ConfigError("metrics.request_timeout_s and head_timeout_s must be > 0, "
                          "metrics.max_connections and max_connections_per_source >= 1")
    sv = cfg.service
    if not sv.grpc_handshake_timeout_s > 0 or sv.grpc_max_connections < 1 or \
            sv.fd_reserve < 0:
        raise ConfigError("service.grpc_handshake_timeout_s must be > 0, "
                          "service.grpc_max_connections >= 1 and service.fd_reserve >= 0")
    tls = cfg.tls
    if bool(tls.cert_file) != bool(tls.key_file):
        raise ConfigError("tls.cert_file and tls.key_file: set both (TLS on) or neither "
                          "(TLS off)")
    if tls.client_ca_file and not tls.enabled:
        raise ConfigError("tls.client_ca_file: mutual TLS needs the server's own certificate "
                          "too; set tls.cert_file and tls.key_file")
    if not tls.reload_interval_s > 0:
        raise ConfigError("tls.reload_interval_s: must be > 0 (seconds)")
    check_pod(cfg.pod)
    _check_events(cfg.events)
    check_s3(cfg.s3, cfg.dram.slab_size)
    if not 0.0 <= cfg.eviction.protected_fraction <= 1.0:
        raise ConfigError("eviction.protected_fraction: must be between 0 and 1")
    if cfg.eviction.protect_after_hits < 1:
        raise ConfigError("eviction.protect_after_hits: must be >= 1")


def _check_events(ev: EventsConfig) -> None:
    if ev.batch_ms < 1 or ev.max_pending < 1:
        raise ConfigError("events.batch_ms and events.max_pending: must be >= 1")
    if not ev.endpoint:
        return
    if ev.endpoint.startswith("ipc://") and len(ev.endpoint) > len("ipc://"):
        return
    host = ev.endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    loopback = host == "localhost"
    with contextlib.suppress(ValueError):
        loopback = loopback or ipaddress.ip_address(host).is_loopback
    if not ev.endpoint.startswith("tcp://") or not loopback:
        raise ConfigError(
            f"events.endpoint: {ev.endpoint!r} is not tcp://<loopback>:PORT or ipc:///PATH; "
            f"KV events name every tenant's block hashes and are not authenticated, so "
            f"they are served on this host only (a router elsewhere subscribes through a "
            f"relay it secures)")


def _check_quota(where: str, q: TenantQuota) -> None:
    for key in ("dram_guaranteed", "dram_max", "flash_guaranteed", "flash_max",
                "dram_held_max"):
        if not 0.0 <= getattr(q, key) <= 1.0:
            raise ConfigError(f"{where}.{key}: must be a fraction between 0 and 1")
    if q.dram_guaranteed > q.dram_max or q.flash_guaranteed > q.flash_max:
        raise ConfigError(f"{where}: a guaranteed share cannot exceed its ceiling (_max)")
    for key in ("max_leases", "max_allocations", "max_sessions", "max_namespaces"):
        if getattr(q, key) < 1:
            raise ConfigError(f"{where}.{key}: must be >= 1")
    if not 0.01 <= q.io_weight <= 100.0:
        raise ConfigError(f"{where}.io_weight: must be between 0.01 and 100 (a share of the "
                          f"I/O threads against other tenants), got {q.io_weight}")


def rdma_ip(listen: str) -> str:
    """The IP address in ``service.rdma_listen`` (IPv4, IPv6, or ``[IPv6]``)."""
    text = listen.strip()
    bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        pass
    host, sep, port = text.rpartition(":")
    if sep and port.isdigit():
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            pass
        else:
            raise ConfigError(
                f"service.rdma_listen: {listen!r} has a port; give the IP address only "
                f"({host.strip('[]')!r}): queue pairs are connected over the gRPC control "
                f"plane, so no RDMA port is listened on")
    raise ConfigError(f"service.rdma_listen: {listen!r} is not an IP address (it selects the "
                      f"RDMA device and GID by address; names are not resolved)")


def config_from_dict(raw: Any) -> Config:
    cfg = build(Config, raw, "")
    _check(cfg)
    return typing.cast(Config, cfg)


def parse_config(text: str, source: str = "<config>") -> Config:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    try:
        return config_from_dict(raw)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc.message}") from None


def load_config(path: str | Path | None = None) -> Config:
    """Load and validate a config file; ``None`` gives the embedded default."""
    if path is None:
        return parse_config(default_config_yaml(), "<embedded default>")
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(
            f"cannot read config file {p}: {exc.strerror} (errno {exc.errno})"
        ) from None
    return parse_config(text, str(p))


def reference_markdown() -> str:
    """``docs/config.md``, generated from this schema (a test keeps the file current)."""
    head = [
        "# Configuration reference",
        "",
        "Generated from `ctxmem_common.config` (the one schema) by "
        "`ctxmem_common.config.reference_markdown()`; a test fails when this file is stale.",
        "Unknown keys and invalid values are errors that name the key path. Sizes accept "
        "`64MiB`-style strings. `ctxmem serve --print-default-config` prints the embedded "
        "default, its paths resolved for the user running it: RUNTIME_DIR is `/run/ctxmem` "
        "as root, else `$XDG_RUNTIME_DIR/ctxmem` (or `/run/user/UID/ctxmem`); STATE_DIR "
        "(flash file, master key) is `/var/lib/ctxmem` as root, else "
        "`$XDG_STATE_HOME/ctxmem` (or `~/.local/state/ctxmem`). docs/security.md "
        "(\"Files and paths\") says which paths the service refuses.",
        "",
        "| key | type | default |",
        "|---|---|---|",
    ]
    dev = [
        "",
        "Each `flash.devices[]` entry:",
        "",
        "| key | type | default |",
        "|---|---|---|",
    ]
    keys = [
        "",
        "Each `s3.access_keys` entry (`ACCESS_KEY_ID: {...}`, docs/s3.md):",
        "",
        "| key | type | default |",
        "|---|---|---|",
    ]
    tail = [
        "",
        "The `kernel:` and `spdk:` sections of a device are typed "
        "(`ctxmem_common.device_settings`) and validated with the rest of the config: a bad "
        "key fails at load, naming its path; `docs/storage.md` lists their keys.",
        "",
        "## Environment variables",
        "",
        "Everything the service tunes is a key above. An environment variable remains "
        "only where this table (`ctxmem_common.config_env.ENVIRONMENT`) says why; a test "
        "fails when the code reads a `CTXMEM_*` variable it does not list.",
        "",
        "| variable | read by | why it is not a config key |",
        "|---|---|---|",
    ]
    return "\n".join(head + reference_rows(Config, "") + dev
                     + reference_rows(FlashDeviceConfig, "flash.devices[].") + keys
                     + reference_rows(S3AccessKey, "s3.access_keys.ID.") + tail
                     + env_rows() + [""])
