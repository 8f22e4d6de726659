"""The one place the service connects to the pod's Redis/Valkey index."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ctxmem_common.config import PodConfig
from ctxmem_common.errors import ConfigError

if TYPE_CHECKING:
    import redis.asyncio


def connect(pod: PodConfig) -> redis.asyncio.Redis:
    """A client for ``pod.index_url`` whose every command is bounded by
    ``pod.index_timeout_s`` (connect: ``pod.connect_timeout_s``); ``rediss://`` verifies
    the server against ``pod.index_ca_file`` (or the system CAs). The password comes from
    the URL or the ``pod.index_password_env`` variable. Connects lazily: an index that is
    down at start is not an error (the node serves its own blocks meanwhile)."""
    import redis.asyncio as aioredis

    if not pod.index_url.startswith(("redis://", "rediss://")):
        raise ConfigError(f"pod.index_url: {pod.index_url!r} is not a redis:// or rediss:// "
                          f"URL")
    kwargs: dict[str, Any] = {
        "socket_timeout": pod.index_timeout_s,
        "socket_connect_timeout": pod.connect_timeout_s,
        "retry_on_timeout": False,
        "health_check_interval": 0,
        "decode_responses": False,
    }
    password = os.environ.get(pod.index_password_env) if pod.index_password_env else None
    if password:
        kwargs["password"] = password
    if pod.index_url.startswith("rediss://"):
        kwargs["ssl_cert_reqs"] = "required"
        if pod.index_ca_file:
            kwargs["ssl_ca_certs"] = pod.index_ca_file
    client: redis.asyncio.Redis = aioredis.Redis.from_url(pod.index_url, **kwargs)
    return client
