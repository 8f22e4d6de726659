"""Helpers shared by the engine integrations (no engine imports here)."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from ctxmem.client import Client, Namespace
from ctxmem.tls import TlsConfig
from ctxmem_common.errors import InvalidArgument
from ctxmem_common.layout import DTYPE_SIZES, KVLayout

DEFAULT_ENDPOINT = "127.0.0.1:50051"
ENDPOINT_ENV = "CTXMEM_ENDPOINT"

_clients: dict[tuple[Any, ...], Client] = {}
_clients_lock = threading.Lock()


def resolve_endpoint(value: Any = None) -> str:
    """The service endpoint: the engine's config value, else ``$CTXMEM_ENDPOINT``, else
    ``127.0.0.1:50051``."""
    if value:
        return str(value)
    return os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT


# The engine-side TLS keys (docs/engines.md): ctxmem.tls_ca_file, ctxmem.tls_cert_file,
# ctxmem.tls_key_file, ctxmem.tls_server_name; each falls back to $CTXMEM_TLS_<NAME>.
TLS_KEYS = ("ca_file", "cert_file", "key_file", "server_name")


def resolve_tls(get: Any) -> TlsConfig | None:
    """The engine's TLS settings: ``get(name, default)`` reads ``ctxmem.<name>`` from the
    engine's config (``config_get`` bound to its extra config); each unset key falls back
    to ``$CTXMEM_TLS_<NAME>``. None when none is set (a plaintext service)."""
    values = {k: str(get(f"tls_{k}", "") or os.environ.get(f"CTXMEM_TLS_{k.upper()}", ""))
              for k in TLS_KEYS}
    if not any(values.values()):
        return None
    return TlsConfig(**values)


def shared_client(endpoint: str, *, transport: str = "auto", tenant_token: str = "",
                  timeout_s: float = 30.0, tls: TlsConfig | None = None) -> Client:
    """One :class:`ctxmem.Client` per process and settings (the client is thread- and
    fork-safe, so connectors, backends and their worker threads share it)."""
    key = (endpoint, transport, tenant_token, float(timeout_s), tls)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = Client(endpoint, transport=transport,  # type: ignore[arg-type]
                            tenant_token=tenant_token, timeout_s=timeout_s, tls=tls)
            _clients[key] = client
        return client


def open_namespace(client: Client, layout: KVLayout, *, model_id: str, tenant: str,
                   tags: Mapping[str, str], weights_revision: str = "") -> Namespace:
    """Open a namespace (the client reconnects by itself after a service restart)."""
    return client.open_namespace(layout, model_id=model_id, tenant=tenant, tags=tags,
                                 weights_revision=weights_revision)


def weights_revision_of(setting: Any = None, model_config: Any = None) -> str:
    """The model weights' revision a namespace names (issue 25, item 6): the
    integration's ``ctxmem.weights_revision`` setting (a digest of the weights, a
    checkpoint id), else the engine model config's ``revision`` when it has one set
    (vLLM's ``--revision``: a Hugging Face commit, tag or branch), else "" (none: the
    namespace of earlier versions). A value longer than 256 bytes is replaced by its
    SHA-256 (hex)."""
    value = str(setting or "") or str(getattr(model_config, "revision", None) or "")
    if len(value.encode()) > 256:
        value = hashlib.sha256(value.encode()).hexdigest()
    return value


def salt_tag(salt: str | bytes) -> str:
    """The namespace tag value for a cache salt: a digest, so the salt itself never leaves
    the engine (it is a client-chosen secret that separates users' caches)."""
    raw = salt.encode() if isinstance(salt, str) else bytes(salt)
    return hashlib.sha256(b"ctxmem-cache-salt-v1|" + raw).hexdigest()[:32]


def torch_dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, checked against the layouts ctxmem knows."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise InvalidArgument(
            f"KV dtype {name!r} is not supported by ctxmem layouts; supported: "
            f"{sorted(DTYPE_SIZES)}")
    return name


def fit_key(raw: bytes) -> bytes:
    """A block key of at most 64 bytes: ``raw`` itself, or its SHA-256 when longer."""
    if 1 <= len(raw) <= 64:
        return raw
    return hashlib.sha256(b"ctxmem-long-key|" + raw).digest()


def config_get(cfg: Mapping[str, Any] | None, name: str, default: Any = None) -> Any:
    """``cfg["ctxmem.<name>"]``, or ``cfg["ctxmem_<name>"]``, or ``default``."""
    if not cfg:
        return default
    for key in (f"ctxmem.{name}", f"ctxmem_{name}"):
        if key in cfg and cfg[key] is not None:
            return cfg[key]
    return default


def as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


class RateLimitedLog:
    """Warn at most once per ``interval_s`` per message kind: a down service must not
    flood the engine's log (each failure is already a miss)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 30.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -1e18) < self.interval_s:
                return
            self._last[kind] = now
        self.logger.warning(msg, *args)


# The service's tier names (Lookup/Acquire responses), nearest to the engine first.
# "peer" (a pod peer's service) and "shared_flash" (pod flash shared by the nodes) come
# with the pod tier; a name not listed here ranks last and reports as unspecified.
TIER_ORDER = ("dram", "flash", "shared_flash", "peer")

# ctxmem tier -> vLLM's CacheHitSource value (vllm.v1.metrics.cache_hit_source).
VLLM_HIT_SOURCES = {"dram": "host", "flash": "disk", "shared_flash": "disk", "peer": "p2p"}


def tier_rank(tier: str) -> int:
    """Distance of a service tier from the engine (unknown names: farthest)."""
    return TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER)
