"""The ``pod:`` section of the config (docs/pod.md): the pod tier's cluster index, peer
fetch and shared-flash slab leases, and its cross-field rules. Part of
:mod:`ctxmem_common.config`, kept apart so each module stays one screenful of concepts."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from ctxmem_common.errors import ConfigError


@dataclass(frozen=True)
class PodConfig:
    """The pod tier (docs/pod.md): a cluster index on Redis/Valkey and peer fetch between
    services. Off by default; one node needs none of it."""

    enabled: bool = False
    # redis://[:PASSWORD@]HOST:PORT/DB or rediss:// (TLS); the password may instead come
    # from index_password_env. Without a password or client certificate the service
    # refuses an index beyond loopback (and warns on loopback).
    index_url: str = ""
    index_password_env: str = "CTXMEM_POD_INDEX_PASSWORD"
    index_ca_file: str = ""  # rediss:// only: CA bundle for the index server's certificate
    # rediss:// only: the client certificate and its key this node presents to the index
    # (a server started with tls-auth-clients yes refuses a node without one). The key
    # file must be private (mode 0600, owned by the service's user or root).
    index_cert_file: str = ""
    index_key_file: str = ""
    # The index is a Redis Cluster (or Valkey cluster): index_url names any one of its
    # nodes (redis:// or rediss://, database 0), the client finds the others. Every key
    # used together shares a hash tag, so the pod works across slots and masters.
    index_cluster: bool = False
    node_id: str = ""  # unique in the pod; letters, digits, '-', '_', '.'
    # HOST:PORT peers connect to for this node's peer-fetch server, and where it listens.
    advertise: str = ""
    listen: str = "127.0.0.1:0"
    # A secret every pod member shares (>= 16 characters), from this environment
    # variable or pod_token (config): mixed into the peer key the handshake proves
    # (derived from the master key, which every node holds too), never sent.
    pod_token: str = ""
    pod_token_env: str = "CTXMEM_POD_TOKEN"
    # TLS on peer fetch (required when listen is not loopback): this node's certificate and
    # key, and the pod CA that signs every member's (mutual: peers present theirs).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    heartbeat_s: float = 1.0
    node_ttl_s: float = 5.0
    publish_interval_ms: int = 20
    publish_batch: int = 1024
    # Updates kept while the index is unreachable (coalesced per key); beyond it the
    # publisher drops them and republishes everything once the index answers again.
    publish_backlog: int = 100_000
    index_timeout_s: float = 0.5
    fetch_timeout_s: float = 5.0
    connect_timeout_s: float = 1.0
    # The peer-fetch port before a peer has proved itself (docs/security.md,
    # "Listeners"): seconds from accept for its hello (and as long again for the TLS
    # handshake before it), and the connections without a proven hello, in total and per
    # peer IP; over a cap the oldest such connection is closed to admit the new one.
    hello_timeout_s: float = 5.0
    max_unauthenticated: int = 64
    max_unauthenticated_per_source: int = 16
    # Remote blocks pulled per Acquire/Prefetch (one request per holder node).
    fetch_max_blocks: int = 256
    # Remote blocks of one tenant that Prefetch pulls in the background at once on this
    # node (pre-staging); a Prefetch's remote blocks past it are not pulled (counted
    # pod_prefetch_refused_blocks: a get fetches them on demand). 0: Prefetch pulls none.
    prefetch_max_blocks_per_tenant: int = 1024

    # Lease of a slab on a shared flash device (flash.devices[].shared), renewed every
    # third of it: a dead node's slabs are taken over this long after its last renewal.
    slab_lease_s: float = 10.0
    # Free slabs of each shared device a node keeps leased ahead of need.
    shared_spare_slabs: int = 2
    # A dead node's slab that holds durable records is taken (its blocks lost) only once
    # the node has been dead this long, seen from the taker (a killed node restarting
    # re-attaches its slabs within seconds; before, a node out of room took them at once
    # and 292 acknowledged durable blocks were lost in a chaos run). Until then a writer
    # out of room makes room among its own blocks or has its write refused. Blank slabs
    # and a dead node's empty ones are taken at once, as before.
    dead_slab_grace_s: float = 60.0

    # Peer fetch over RDMA (docs/pod.md): an IP address of this node's RDMA device (it
    # picks the device and its RoCE v2 GID; no port). Set: this node serves and fetches
    # blocks by RDMA READ wherever the other end has it too (negotiated on the TLS peer
    # connection), TCP otherwise. Empty: TCP only. rdma_device names the device when the
    # IP alone is ambiguous.
    rdma_listen: str = ""
    rdma_device: str = ""


def check_pod(pod: PodConfig) -> None:
    """The cross-field rules of ``pod:`` (``ConfigError`` naming the key)."""
    if pod.rdma_listen:
        try:
            ipaddress.ip_address(pod.rdma_listen.strip("[]"))
        except ValueError:
            raise ConfigError(f"pod.rdma_listen: {pod.rdma_listen!r} is not an IP address "
                              f"(an address of this node's RDMA device, no port)") from None
    if pod.dead_slab_grace_s < 0:
        raise ConfigError("pod.dead_slab_grace_s must be >= 0 (seconds a dead node's slabs "
                          "with records are kept before another node may take them)")
    if not pod.slab_lease_s > 0 or pod.shared_spare_slabs < 1:
        raise ConfigError("pod.slab_lease_s must be > 0 (seconds) and pod.shared_spare_slabs "
                          ">= 1")
    if not pod.enabled:
        return
    if not pod.index_url.startswith(("redis://", "rediss://")):
        raise ConfigError(f"pod.index_url: {pod.index_url!r} is not a redis:// or rediss:// "
                          f"URL; name the pod's Redis/Valkey index")
    db = pod.index_url.split("//", 1)[1].split("?", 1)[0].partition("/")[2]
    if pod.index_cluster and db not in ("", "0"):
        raise ConfigError(f"pod.index_url: database {db!r} with pod.index_cluster: a Redis "
                          f"Cluster has database 0 only; end the URL with /0 or nothing")
    if bool(pod.index_cert_file) != bool(pod.index_key_file):
        raise ConfigError("pod.index_cert_file, pod.index_key_file: set both (the client "
                          "certificate this node presents to the index, and its key) or "
                          "neither")
    if pod.index_cert_file and not pod.index_url.startswith("rediss://"):
        raise ConfigError(f"pod.index_cert_file: a client certificate needs TLS to the index; "
                          f"pod.index_url {pod.index_url.split('@')[-1]!r} is not rediss://")
    if not pod.node_id or not all(c.isalnum() or c in "-_." for c in pod.node_id) \
            or len(pod.node_id) > 64:
        raise ConfigError(f"pod.node_id: {pod.node_id!r}: give 1-64 letters, digits, '-', "
                          f"'_' or '.', unique in the pod")
    if not pod.advertise:
        raise ConfigError("pod.advertise: required (HOST:PORT peers use to reach this node's "
                          "peer-fetch server)")
    if bool(pod.tls_cert_file) != bool(pod.tls_key_file) or (
            pod.tls_cert_file and not pod.tls_ca_file):
        raise ConfigError("pod.tls_cert_file, tls_key_file, tls_ca_file: set all three "
                          "(mutual TLS between pod members) or none")
    for key in ("heartbeat_s", "node_ttl_s", "index_timeout_s", "fetch_timeout_s",
                "connect_timeout_s", "hello_timeout_s"):
        if not getattr(pod, key) > 0:
            raise ConfigError(f"pod.{key}: must be > 0 (seconds)")
    if pod.node_ttl_s <= pod.heartbeat_s:
        raise ConfigError("pod.node_ttl_s: must exceed pod.heartbeat_s (a live node's key "
                          "must not expire between two heartbeats)")
    for key in ("publish_interval_ms", "publish_batch", "publish_backlog", "fetch_max_blocks",
                "max_unauthenticated", "max_unauthenticated_per_source"):
        if getattr(pod, key) < 1:
            raise ConfigError(f"pod.{key}: must be >= 1")
    if pod.prefetch_max_blocks_per_tenant < 0:
        raise ConfigError("pod.prefetch_max_blocks_per_tenant: must be >= 0 (0: Prefetch "
                          "pulls no remote blocks)")


def index_authentication(pod: PodConfig, environ: Mapping[str, str] | None = None
                         ) -> tuple[bool, str]:
    """(whether ``pod.index_url`` reaches only this host, how this node authenticates to
    the index: ``"password"``, ``"client certificate"`` or ``""`` for nothing). The
    password counts from the URL or from ``pod.index_password_env``'s variable in
    ``environ`` (default: this process's environment)."""
    env = os.environ if environ is None else environ
    parts = urlsplit(pod.index_url)
    host = (parts.hostname or "").strip("[]")
    try:
        local = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = False
    if parts.password or (pod.index_password_env and env.get(pod.index_password_env)):
        return local, "password"
    if pod.index_cert_file and pod.index_url.startswith("rediss://"):
        return local, "client certificate"
    return local, ""


def index_auth_problem(pod: PodConfig, environ: Mapping[str, str] | None = None
                       ) -> tuple[bool, str]:
    """(fatal, message) when the index is reached without authentication, else
    ``(False, "")``: beyond loopback the service refuses to start (anyone who can reach
    the index could rewrite where blocks are said to be, and read which nodes hold what);
    on loopback it is a warning (every local user can reach it)."""
    if not pod.enabled:
        return False, ""
    local, how = index_authentication(pod, environ)
    if how:
        return False, ""
    where = pod.index_url.split("@", 1)[-1].split("//", 1)[-1]
    if local:
        return False, (f"pod.index_url: the index on {where} is reached without a password "
                       f"or client certificate: any local user can write it (harmless to "
                       f"the blocks, which every node verifies, but it can deny service); "
                       f"set a password (requirepass, and ${pod.index_password_env} or the "
                       f"URL)")
    return True, (f"pod.index_url: the index on {where} (beyond loopback) is reached without "
                  f"authentication: no password in the URL or in ${pod.index_password_env}, "
                  f"no client certificate (pod.index_cert_file with rediss://); give the "
                  f"index a password (requirepass) and set ${pod.index_password_env}, or "
                  f"require client certificates")
