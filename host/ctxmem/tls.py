"""The shim's TLS settings: :class:`TlsConfig` for ``Client(..., tls=...)``.

One setting covers both channels a client opens to a TLS service (docs/security.md,
"TLS and mTLS"): the gRPC control channel (``grpc.ssl_channel_credentials``) and the TCP
data channel (``ssl.SSLContext``, TLS 1.3 only). Shared memory is a local Unix socket and
is not encrypted; RDMA's queue pairs are set up over the (TLS) gRPC channel.

With ``cert_file``/``key_file`` the client presents its certificate (mutual TLS): the
service then takes the tenant from it, so a client may only open sessions for the tenant
its certificate names.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from ctxmem_common.errors import ConfigError

__all__ = ["TlsConfig"]


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"TlsConfig.{what}: cannot read {path}: {exc.strerror or exc}"
                          ) from None


@dataclass(frozen=True)
class TlsConfig:
    """How a client reaches a TLS service.

    ``ca_file``: the CA bundle (PEM) the service's certificate must chain to; empty: the
    system's trust store. ``cert_file``/``key_file``: this client's certificate and key
    (mutual TLS; both or neither). ``server_name``: the name (or IP address) the service's
    certificate must carry when it differs from the endpoint's host (e.g. connecting by
    IP to a certificate issued for a DNS name).
    """

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError("TlsConfig: set cert_file and key_file together (mutual TLS) "
                              "or neither")

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        """``grpc.ChannelCredentials`` for the control channel."""
        root = _read(self.ca_file, "ca_file") if self.ca_file else None
        key = _read(self.key_file, "key_file") if self.key_file else None
        chain = _read(self.cert_file, "cert_file") if self.cert_file else None
        return grpc.ssl_channel_credentials(root_certificates=root, private_key=key,
                                            certificate_chain=chain)

    def grpc_options(self) -> list[tuple[str, str]]:
        """Channel arguments: the server-name override, when set."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name \
            else []

    def ssl_context(self) -> ssl.SSLContext:
        """A client context for the TCP data channel: TLS 1.3, the service's certificate
        verified against ``ca_file`` (or the system store) and its name checked."""
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file or None)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_3
            if self.cert_file:
                ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"TlsConfig: cannot load the CA, certificate or key ({exc}); "
                              f"check the paths and that they are PEM") from None
        return ctx

    def hostname(self, host: str) -> str:
        """The name the service's certificate must match when connecting to ``host``."""
        return self.server_name or host
