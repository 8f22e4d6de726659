"""``HOST:PORT`` text, parsed one way for the config, the service and the shim."""

from __future__ import annotations

from ctxmem_common.errors import ConfigError

__all__ = ["split_hostport"]


def split_hostport(value: str, what: str, *, default_host: str = "0.0.0.0") -> tuple[str, int]:
    """``"host:port"``, ``"[v6]:port"`` or ``":port"`` → ``(host, port)``.

    ``what`` names the setting or field in the error (``service.data_listen``); an empty
    host becomes ``default_host``. Raises ConfigError for text without a numeric port or a
    port outside 0-65535.
    """
    host, sep, port = value.strip().rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{what}: expected HOST:PORT with a port 0-65535, got {value!r}")
    return host.strip("[]") or default_host, int(port)
