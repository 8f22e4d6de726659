"""The service's TLS material (``tls:`` config): TLS 1.3 contexts for the TCP data plane,
credentials for gRPC, and reload of rotated files without a restart.

:class:`ServerTls` reads ``tls.cert_file``, ``tls.key_file`` (checked private by
:func:`ctxmem_common.safepaths.read_tls_key_file`) and ``tls.client_ca_file`` once at
start (a bad file stops the start with an error naming it), then at most every
``tls.reload_interval_s`` compares the files' (mtime, inode, size): when they changed it
loads them again, and new connections (gRPC handshakes and TCP data connections) get the
new certificate; connections already open keep theirs. A reload that fails (a half-written
rotation) keeps the previous material and logs one warning; the next check tries again.

**Connections the rotated client CA no longer trusts end** (issue 25, item 5). A TLS
handshake checks the client certificate once; without more, a tenant whose certificate the
new ``tls.client_ca_file`` no longer trusts kept its open channel (and new Connects on it)
indefinitely. So in mutual mode:

* every gRPC call but Health re-checks its peer certificate against the *current* client
  CA (:meth:`ServerTls.peer_trusted`: issued by a certificate of the CA file, directly
  or through others in it; cached per certificate and CA generation, so a call pays one
  dict lookup) and is refused UNAUTHENTICATED when it no longer verifies; the check first
  lets :meth:`ServerTls.current` notice changed files, so the first call after a rotation
  sees the new CA;
* :meth:`ServerTls.watch` (a task on the service's loop) checks the files every
  ``reload_interval_s`` even with no new connection, and after a reload that changed the
  CA closes the TCP data connections whose certificate no longer verifies (their
  sockets are shut down) and calls the service's hooks (which end the sessions opened
  with such a certificate: their shared-memory, TCP and RDMA access ends with them).

So a connection the new CA would refuse ends at most ``reload_interval_s`` (plus one
check) after the CA file changed. While the CA file is unchanged, nothing is re-verified
here: the handshake's verification stands.

gRPC: :meth:`ServerTls.grpc_credentials` is ``grpc.dynamic_ssl_server_credentials`` whose
fetcher gRPC calls on each new handshake; it returns the new configuration only when the
files changed. gRPC's Python API does not expose a minimum TLS version for servers, so
the interceptor refuses any call whose connection negotiated less than TLS 1.3
(:func:`tls_version_ok`); the TCP data plane's ``ssl.SSLContext`` sets
``minimum_version = TLSv1_3`` itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature

from ctxmem_common.config import TlsConfig
from ctxmem_common.errors import ConfigError
from ctxmem_common.safepaths import read_tls_key_file

if TYPE_CHECKING:
    from ctxmem_dpu.transport.tls_stream import TlsStream

__all__ = ["ServerTls", "TlsMaterial", "tls_version_ok"]

#: Cached verdicts of :meth:`ServerTls.peer_trusted` (cleared past this many entries).
_TRUST_CACHE_MAX = 4096

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsMaterial:
    """One loaded generation of the files: PEM bytes and the TCP data plane's context."""

    cert_chain: bytes
    key: bytes
    client_ca: bytes | None
    context: ssl.SSLContext
    signature: tuple[tuple[int, int, int], ...]
    # The client CA file's certificates, parsed (what peer_trusted verifies against).
    client_cas: tuple[x509.Certificate, ...] = field(default=())


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


class TrackedContext(ssl.SSLContext):
    """A server context that knows its :class:`ServerTls`, so each TLS data connection
    made with it registers there (and is closed when a rotated CA no longer trusts its
    certificate) without the data server knowing about it."""

    server_tls: ServerTls | None = None


def issued_by_bundle(leaf: x509.Certificate, cas: tuple[x509.Certificate, ...]) -> bool:
    """Whether ``leaf`` chains to a self-signed root of ``cas``, directly or through
    other certificates of ``cas`` (at most 8 links), each link's issuer name matching and
    signature verifying. (An intermediate the client sends in its handshake is not known
    here: after a CA change, a certificate issued by one is trusted only if the
    intermediate is in the CA file.)"""
    cert = leaf
    for _depth in range(8):
        issuer = None
        for ca in cas:
            if ca.subject != cert.issuer:
                continue
            try:
                cert.verify_directly_issued_by(ca)
            except (ValueError, TypeError, InvalidSignature):
                continue
            issuer = ca
            break
        if issuer is None:
            return False
        if issuer.subject == issuer.issuer:  # a (self-signed) root of the bundle
            return True
        cert = issuer
    return False


def _context(cert: bytes, key: bytes, client_ca: bytes | None) -> ssl.SSLContext:
    """A server ``SSLContext``: TLS 1.3 only; client certificates required when
    ``client_ca`` is given. The PEM bytes are loaded through memfds, so the context holds
    exactly the bytes that were checked (no second open of the paths)."""
    ctx = TrackedContext(ssl.PROTOCOL_TLS_SERVER)
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
        # Bumped when a reload changed the client CA: cached verdicts are per generation.
        self.ca_generation = 0
        self._trust: dict[bytes, tuple[int, bool]] = {}
        # Open TLS data connections (weakly: a closed one just disappears) and their
        # certificates; hooks called on the loop after a reload changed the CA.
        self._streams: weakref.WeakSet[TlsStream] = weakref.WeakSet()
        self.on_ca_change: list[Callable[[], None]] = []
        self.untrusted_closed = 0

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
        cas: tuple[x509.Certificate, ...] = ()
        if ca is not None:
            try:
                cas = tuple(x509.load_pem_x509_certificates(ca))
            except ValueError as exc:
                raise ConfigError(f"tls.client_ca_file {cfg.client_ca_file}: cannot parse "
                                  f"its certificates: {exc}") from None
        assert isinstance(ctx, TrackedContext)
        ctx.server_tls = self
        return TlsMaterial(cert, key, ca, ctx, sig, cas)

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
                    old_ca = self._material.client_ca
                    self._material = self._load()
                    self.reloads += 1
                    if self._material.client_ca != old_ca:
                        self.ca_generation += 1
                    log.info("TLS files changed: loaded %s for new connections",
                             self.cfg.cert_file)
            except (ConfigError, OSError) as exc:
                log.warning("TLS files changed but cannot be loaded (%s); new connections "
                            "keep the previous certificate until the files are fixed", exc)
            return self._material

    # -- connections a rotated CA no longer trusts ----------------------------------------
    def ca_changed(self) -> bool:
        """Whether the client CA changed since the start (checking the files first, at
        most every ``reload_interval_s``): until it does, every connection's handshake
        verification stands and nothing needs checking again."""
        self.current()
        return self.ca_generation > 0

    def peer_trusted(self, cert: bytes) -> bool:
        """Whether the client certificate ``cert`` (PEM or DER) verifies against the
        current client CA (see the module doc). True while the CA file is the one the
        service started with (the handshake verified it), and outside mutual mode."""
        m = self.current()
        if m.client_ca is None or self.ca_generation == 0:
            return True
        gen = self.ca_generation
        hit = self._trust.get(cert)
        if hit is not None and hit[0] == gen:
            return hit[1]
        try:
            leaf = (x509.load_pem_x509_certificate(cert) if cert.lstrip().startswith(b"-----")
                    else x509.load_der_x509_certificate(cert))
            ok = issued_by_bundle(leaf, m.client_cas)
        except ValueError:
            ok = False
        if len(self._trust) >= _TRUST_CACHE_MAX:
            self._trust.clear()
        self._trust[cert] = (gen, ok)
        return ok

    def track(self, stream: TlsStream) -> None:
        """A TLS data connection finished its handshake: closed if a rotated CA no longer
        trusts its certificate (:meth:`close_untrusted`)."""
        if self.mutual:
            self._streams.add(stream)

    def close_untrusted(self) -> int:
        """Shut down every tracked data connection whose certificate the current client CA
        does not trust (the data server sees the peer close and ends it). Returns how
        many."""
        n = 0
        for stream in list(self._streams):
            der = stream.peer_der
            if der and not self.peer_trusted(der):
                self._streams.discard(stream)
                try:
                    stream.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    continue  # already closed
                n += 1
        if n:
            self.untrusted_closed += n
            log.warning("TLS client CA changed: closed %d data connection(s) whose client "
                        "certificate it no longer trusts", n)
        return n

    async def watch(self) -> None:
        """Check the files every ``reload_interval_s`` (with or without new connections);
        after a reload that changed the client CA, close the data connections and call
        the ``on_ca_change`` hooks (on this loop). Runs until cancelled."""
        seen = self.ca_generation
        while True:
            await asyncio.sleep(self.cfg.reload_interval_s)
            self.current()
            if self.ca_generation == seen:
                continue
            seen = self.ca_generation
            self.close_untrusted()
            for hook in self.on_ca_change:
                try:
                    hook()
                except Exception:
                    log.exception("ending connections of untrusted certificates failed")

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
