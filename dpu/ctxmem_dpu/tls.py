"""The service's TLS material (``tls:`` config): TLS 1.3 contexts for the TCP data plane,
credentials for gRPC, and reload of rotated files without a restart.

:class:`ServerTls` reads ``tls.cert_file``, ``tls.key_file`` (checked private by
:func:`ctxmem_common.safepaths.read_tls_key_file`) and ``tls.client_ca_file`` once at
start (a bad file stops the start with an error naming it), then at most every
``tls.reload_interval_s`` compares the files' (mtime, inode, size): when they changed it
loads them again, and new connections (gRPC handshakes and TCP data connections) get the
new certificate; connections already open keep theirs. A reload that fails (a half-written
rotation) keeps the previous material and logs one warning; the next check tries again.

gRPC: :meth:`ServerTls.grpc_credentials` is ``grpc.dynamic_ssl_server_credentials`` whose
fetcher gRPC calls on each new handshake; it returns the new configuration only when the
files changed. gRPC's Python API does not expose a minimum TLS version for servers, so
the interceptor refuses any call whose connection negotiated less than TLS 1.3
(:func:`tls_version_ok`); the TCP data plane's ``ssl.SSLContext`` sets
``minimum_version = TLSv1_3`` itself.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any

import grpc

from ctxmem_common.config import TlsConfig
from ctxmem_common.errors import ConfigError
from ctxmem_common.safepaths import read_tls_key_file

__all__ = ["ServerTls", "TlsMaterial", "tls_version_ok"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsMaterial:
    """One loaded generation of the files: PEM bytes and the TCP data plane's context."""

    cert_chain: bytes
    key: bytes
    client_ca: bytes | None
    context: ssl.SSLContext
    signature: tuple[tuple[int, int, int], ...]


def _signature(paths: list[str]) -> tuple[tuple[int, int, int], ...]:
    """(mtime, inode, size) of each file, links followed (a Secret's ``..data`` swap
    changes the inode)."""
    out = []
    for p in paths:
        st = os.stat(p)
        out.append((st.st_mtime_ns, st.st_ino, st.st_size))
    return tuple(out)


def _read(path: str, key: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror or exc}") from None


def _context(cert: bytes, key: bytes, client_ca: bytes | None) -> ssl.SSLContext:
    """A server ``SSLContext``: TLS 1.3 only; client certificates required when
    ``client_ca`` is given. The PEM bytes are loaded through memfds, so the context holds
    exactly the bytes that were checked (no second open of the paths)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    cfd = os.memfd_create("ctxmem-tls-cert")
    kfd = os.memfd_create("ctxmem-tls-key")
    try:
        os.write(cfd, cert)
        os.write(kfd, key)
        ctx.load_cert_chain(f"/proc/self/fd/{cfd}", f"/proc/self/fd/{kfd}")
    finally:
        os.close(cfd)
        os.close(kfd)
    if client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=client_ca.decode("ascii", "replace"))
    return ctx


class ServerTls:
    """The service's TLS files, loaded and reloaded (see the module docstring)."""

    def __init__(self, cfg: TlsConfig) -> None:
        if not cfg.enabled:
            raise ValueError("ServerTls needs tls.cert_file and tls.key_file")
        self.cfg = cfg
        self.mutual = cfg.mutual
        self._paths = [cfg.cert_file, cfg.key_file] + (
            [cfg.client_ca_file] if cfg.client_ca_file else [])
        self._lock = threading.Lock()  # gRPC calls the fetcher on its own threads
        self._checked = time.monotonic()
        self._material = self._load()
        self._grpc_generation = self._material.signature
        self.reloads = 0

    def _load(self) -> TlsMaterial:
        """Read, check and parse every file now.

        Raises:
            ConfigError: naming the key and file that failed, and why.
        """
        cfg = self.cfg
        sig = _signature(self._paths)
        cert = _read(cfg.cert_file, "tls.cert_file")
        try:
            key = read_tls_key_file(cfg.key_file)
        except OSError as exc:
            raise ConfigError(f"tls.key_file: cannot read {cfg.key_file}: "
                              f"{exc.strerror or exc}") from None
        ca = _read(cfg.client_ca_file, "tls.client_ca_file") if cfg.client_ca_file else None
        try:
            ctx = _context(cert, key, ca)
        except (ssl.SSLError, ValueError) as exc:
            raise ConfigError(
                f"tls: cannot load tls.cert_file {cfg.cert_file} / tls.key_file "
                f"{cfg.key_file}" + (f" / tls.client_ca_file {cfg.client_ca_file}" if ca
                                     else "") + f": {exc}; check they are PEM and that the "
                f"key matches the certificate") from None
        return TlsMaterial(cert, key, ca, ctx, sig)

    def current(self) -> TlsMaterial:
        """The material for a new connection: reloaded first if ``reload_interval_s``
        passed since the last check and the files changed."""
        now = time.monotonic()
        if now - self._checked < self.cfg.reload_interval_s:
            return self._material
        with self._lock:
            if now - self._checked < self.cfg.reload_interval_s:
                return self._material
            self._checked = now
            try:
                changed = _signature(self._paths) != self._material.signature
                if changed:
                    self._material = self._load()
                    self.reloads += 1
                    log.info("TLS files changed: loaded %s for new connections",
                             self.cfg.cert_file)
            except (ConfigError, OSError) as exc:
                log.warning("TLS files changed but cannot be loaded (%s); new connections "
                            "keep the previous certificate until the files are fixed", exc)
            return self._material

    def ssl_context(self) -> ssl.SSLContext:
        """The TCP data plane's context for a new connection."""
        return self.current().context

    def _grpc_config(self, m: TlsMaterial) -> Any:
        return grpc.ssl_server_certificate_configuration(
            [(m.key, m.cert_chain)], root_certificates=m.client_ca)

    def _fetch(self) -> Any:
        """gRPC's fetcher: a new configuration only when the files changed."""
        m = self.current()
        if m.signature == self._grpc_generation:
            return None
        self._grpc_generation = m.signature
        return self._grpc_config(m)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Dynamic server credentials that follow reloads; client certificates required
        in mutual mode."""
        return grpc.dynamic_ssl_server_credentials(
            self._grpc_config(self._material), self._fetch,
            require_client_authentication=self.mutual)


def tls_version_ok(context: Any) -> bool:
    """Whether the gRPC call's connection negotiated TLS 1.3 (see the module docstring);
    True when the property is absent (a gRPC build that does not report it)."""
    try:
        auth = context.auth_context()
    except Exception:  # not a TLS connection at all: the listener would not accept it
        return True
    versions = auth.get("ssl_tls_version") or auth.get("tls_version")
    if not versions:
        return True
    v = versions[0]
    text = v.decode() if isinstance(v, bytes) else str(v)
    return text.replace(" ", "").upper() in ("TLSV1.3", "TLS1.3", "TLS13")
