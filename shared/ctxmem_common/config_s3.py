"""The ``s3:`` section: the S3-compatible endpoint (docs/s3.md), off by default.

A compatibility door, not the fast path: objects are stored as ordinary blocks of the
access key's tenant (quotas, encryption, authenticators and the pod apply as to any
put), requests are signed with AWS Signature V4 against ``access_keys``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ctxmem_common.config_schema import Size
from ctxmem_common.errors import ConfigError

__all__ = ["S3AccessKey", "S3Config", "check_s3", "s3_secret"]

_KEY_ID = re.compile(r"^[A-Za-z0-9]{4,128}$")


@dataclass(frozen=True)
class S3AccessKey:
    """One access key: the tenant it acts for and its secret (from ``secret_env``, an
    environment variable, or ``secret`` in the config)."""

    tenant: str
    secret: str = ""
    secret_env: str = ""


@dataclass(frozen=True)
class S3Config:
    # "HOST:PORT" to serve the S3-compatible endpoint; "" (the default) serves none.
    listen: str = ""
    # The region clients sign for (any name; it is part of the signature's scope).
    region: str = "us-east-1"
    # Virtual-hosted addressing: a request for host BUCKET.<domain> names BUCKET; "" serves
    # path-style requests only (http://HOST:PORT/BUCKET/KEY).
    domain: str = ""
    # ACCESS_KEY_ID: {tenant, secret_env or secret}; the tenant is the key's owner.
    access_keys: dict[str, S3AccessKey] = field(default_factory=dict)
    # Objects are stored in blocks of this size (the last one padded), with one small
    # manifest block per object.
    chunk_size: Size = Size(2 << 20)
    # One PutObject or UploadPart body at most this large (EntityTooLarge over it): it is
    # staged in DRAM whole before it is committed.
    max_put_bytes: Size = Size(256 << 20)
    # Parts of one multipart upload, and multipart uploads in progress per tenant (kept in
    # memory until completed or aborted; a restart forgets them).
    max_parts: int = 1000
    max_uploads: int = 1000
    # A request signed more than this many seconds from the service's clock is refused.
    max_clock_skew_s: float = 900.0
    # Seconds from accept for the request head (and the TLS handshake) to arrive; a
    # connection that has not sent a signed request head within it is closed.
    head_timeout_s: float = 5.0
    # Seconds one request may take, body and answer included.
    request_timeout_s: float = 300.0
    # Seconds an idle keep-alive connection stays open.
    keepalive_s: float = 15.0
    # Connections before their first request is authenticated: in total and per peer IP
    # (over a cap the oldest is closed, as on every listener), and connections in all.
    max_unauthenticated: int = 64
    max_unauthenticated_per_source: int = 16
    max_connections: int = 256


def s3_secret(key_id: str, key: S3AccessKey) -> str:
    """The secret of ``key`` (its environment variable first); ConfigError when empty."""
    secret = os.environ.get(key.secret_env, "") if key.secret_env else key.secret
    if not secret:
        where = (f"environment variable {key.secret_env} (s3.access_keys.{key_id}.secret_env)"
                 if key.secret_env else f"s3.access_keys.{key_id}.secret")
        raise ConfigError(f"s3.access_keys.{key_id}: no secret: {where} is empty; set it")
    return secret


def check_s3(s3: S3Config, dram_slab_size: int) -> None:
    """Cross-field rules of the ``s3:`` section."""
    if not s3.listen:
        return
    if not s3.access_keys:
        raise ConfigError("s3.access_keys: the S3 endpoint (s3.listen) needs at least one "
                          "access key (ACCESS_KEY_ID: {tenant: ..., secret_env: ...})")
    for key_id, key in s3.access_keys.items():
        if not _KEY_ID.match(key_id):
            raise ConfigError(f"s3.access_keys.{key_id}: an access key id is 4 to 128 "
                              f"letters and digits")
        if not key.tenant:
            raise ConfigError(f"s3.access_keys.{key_id}.tenant: required (the key's owner)")
        if bool(key.secret) == bool(key.secret_env):
            raise ConfigError(f"s3.access_keys.{key_id}: set exactly one of secret_env "
                              f"(an environment variable) and secret")
    if s3.chunk_size < 4096 or s3.chunk_size % 4096 or s3.chunk_size > dram_slab_size:
        raise ConfigError(f"s3.chunk_size: must be a multiple of 4 KiB, at most "
                          f"dram.slab_size ({dram_slab_size}); got {s3.chunk_size}")
    if s3.max_put_bytes < 1:
        raise ConfigError("s3.max_put_bytes: must be >= 1")
    if not 1 <= s3.max_parts <= 10000 or s3.max_uploads < 1:
        raise ConfigError("s3.max_parts: 1..10000; s3.max_uploads: >= 1")
    for name in ("max_clock_skew_s", "head_timeout_s", "request_timeout_s", "keepalive_s"):
        if not getattr(s3, name) > 0:
            raise ConfigError(f"s3.{name}: must be > 0 (seconds)")
    if min(s3.max_unauthenticated, s3.max_unauthenticated_per_source,
           s3.max_connections) < 1:
        raise ConfigError("s3.max_unauthenticated, s3.max_unauthenticated_per_source and "
                          "s3.max_connections: must be >= 1")
