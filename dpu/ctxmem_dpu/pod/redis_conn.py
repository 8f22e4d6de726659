"""The one place the service connects to the pod's Redis/Valkey index."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from ctxmem_common.config import PodConfig
from ctxmem_common.config_pod import index_auth_problem
from ctxmem_common.errors import ConfigError
from ctxmem_common.safepaths import read_tls_key_file

if TYPE_CHECKING:
    import redis.asyncio

    #: A single server or a Redis Cluster (``pod.index_cluster``).
    IndexClient = redis.asyncio.Redis | redis.asyncio.RedisCluster

log = logging.getLogger(__name__)


def client_key_file(path: str) -> str:
    """``path`` once checked as a private key file (``pod.index_key_file``): readable, a
    regular file of this user or root, no access for group or other — the rule of every
    ctxmem key file (:func:`~ctxmem_common.safepaths.read_tls_key_file`). ``ConfigError``
    (``UnsafePathError``) naming the key and the fix otherwise: the service does not
    start."""
    try:
        read_tls_key_file(path, "TLS client key file (pod.index_key_file)")
    except OSError as exc:
        raise ConfigError(f"pod.index_key_file: {path!r} cannot be read: "
                          f"{exc.strerror or exc} (errno {exc.errno})") from None
    return path


def _readable(path: str, key: str) -> str:
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"{key}: {path!r} cannot be read: {exc.strerror or exc} "
                          f"(errno {exc.errno})") from None
    return path


def connect(pod: PodConfig) -> IndexClient:
    """A client for ``pod.index_url`` whose every command is bounded by
    ``pod.index_timeout_s`` (connect: ``pod.connect_timeout_s``); ``rediss://`` verifies
    the server against ``pod.index_ca_file`` (or the system CAs) and, with
    ``pod.index_cert_file``/``index_key_file``, presents this node's client certificate
    (the files are checked here: a missing or unsafe one stops the service at start,
    naming the key). The password comes from
    the URL or the ``pod.index_password_env`` variable; an index reached without a
    password or client certificate is refused beyond loopback (``ConfigError``) and
    warned about on loopback (:func:`~ctxmem_common.config_pod.index_auth_problem`).
    Connects lazily: an index that is down at start is not an error (the node serves its
    own blocks meanwhile).

    With ``pod.index_cluster`` the URL names one node of a Redis Cluster (any master or
    replica; the client learns the others from it) and the client is a
    ``redis.asyncio.RedisCluster``: every key the pod uses together shares a hash tag
    (docs/pod.md, "Redis layout"), so no command crosses slots."""
    import redis.asyncio as aioredis
    from redis.asyncio.connection import Connection, parse_url

    from ctxmem_dpu.pod.resp_pack import fast_connection_class, use_on_cluster

    if not pod.index_url.startswith(("redis://", "rediss://")):
        raise ConfigError(f"pod.index_url: {pod.index_url!r} is not a redis:// or rediss:// "
                          f"URL")
    fatal, problem = index_auth_problem(pod)
    if fatal:
        raise ConfigError(problem)
    if problem:
        log.warning("%s", problem)
    kwargs: dict[str, Any] = {
        "socket_timeout": pod.index_timeout_s,
        "socket_connect_timeout": pod.connect_timeout_s,
        "health_check_interval": 0,
        "decode_responses": False,
    }
    password = os.environ.get(pod.index_password_env) if pod.index_password_env else None
    if password:
        kwargs["password"] = password
    if pod.index_url.startswith("rediss://"):
        kwargs["ssl_cert_reqs"] = "required"
        kwargs["ssl_check_hostname"] = True  # the URL's host must be in the certificate
        if pod.index_ca_file:
            kwargs["ssl_ca_certs"] = _readable(pod.index_ca_file, "pod.index_ca_file")
        if pod.index_cert_file:  # mutual TLS: the index checks this node's certificate
            kwargs["ssl_certfile"] = _readable(pod.index_cert_file, "pod.index_cert_file")
            kwargs["ssl_keyfile"] = client_key_file(pod.index_key_file)
    if pod.index_cluster:
        cluster: redis.asyncio.RedisCluster = aioredis.RedisCluster.from_url(
            pod.index_url, **kwargs)
        use_on_cluster(cluster)
        return cluster
    # Commands packed in C (pod/resp_pack.py); the URL's scheme picks plain or TLS.
    options = {**kwargs, "retry_on_timeout": False, **parse_url(pod.index_url)}
    options["connection_class"] = fast_connection_class(
        options.get("connection_class", Connection))
    return aioredis.Redis.from_pool(aioredis.ConnectionPool(**options))
