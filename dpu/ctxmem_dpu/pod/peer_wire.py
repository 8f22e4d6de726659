"""Peer-fetch framing (service to service, TCP with TLS off loopback) and its TLS and
token checks: the one definition both the server and the client use.

* hello, client → server: ``b"CXPH"``, version (u8), token length (u16), the pod token.
  The server answers one byte (1: accepted) or closes. Constant-time compare.
* request: ``b"CXPR"``, namespace digest (16 bytes), key count (u32), then per key its
  length (u8) and bytes.
* answer, per key in order: status (u8: 1 hit, 0 miss), CRC32C (u32), length (u64),
  sequence (u64), then, for a hit, ``length`` bytes.
"""

from __future__ import annotations

import hmac
import os
import ssl
import struct
from pathlib import Path

from ctxmem_common.config import PodConfig
from ctxmem_common.errors import ConfigError

HELLO = struct.Struct("!4sBH")
HELLO_MAGIC = b"CXPH"
REQUEST = struct.Struct("!4s16sI")
REQUEST_MAGIC = b"CXPR"
ANSWER = struct.Struct("!BIQQ")
VERSION = 1
MAX_KEYS = 4096  # keys per request; a request above it is refused
MIN_TOKEN = 16
# asyncio stream buffer: above the default 64 KiB, a 2 MiB block arrives in a few reads
# instead of a pause/resume per 128 KiB (measured: see docs/benchmarks.md, pod).
STREAM_LIMIT = 8 << 20


def pod_token(pod: PodConfig) -> bytes:
    """The pod's shared secret: ``pod.pod_token_env``'s variable, else ``pod.pod_token``.

    Raises:
        ConfigError: none set, or shorter than 16 characters.
    """
    token = (os.environ.get(pod.pod_token_env) if pod.pod_token_env else None) \
        or pod.pod_token
    if len(token) < MIN_TOKEN:
        raise ConfigError(
            f"pod: peer fetch needs the pod's shared token (>= {MIN_TOKEN} characters) in "
            f"${pod.pod_token_env} or pod.pod_token; every pod member sets the same one")
    return token.encode()


def token_ok(sent: bytes, expected: bytes) -> bool:
    return hmac.compare_digest(sent, expected)


def pack_keys(ns_digest: bytes, keys: list[bytes]) -> bytes:
    parts = [REQUEST.pack(REQUEST_MAGIC, ns_digest, len(keys))]
    for k in keys:
        parts.append(bytes((len(k),)))
        parts.append(k)
    return b"".join(parts)


def _files(pod: PodConfig) -> tuple[str, str, str]:
    for key in ("tls_cert_file", "tls_key_file", "tls_ca_file"):
        path = getattr(pod, key)
        if not Path(path).is_file():
            raise ConfigError(f"pod.{key}: {path!r} is not a readable file")
    return pod.tls_cert_file, pod.tls_key_file, pod.tls_ca_file


def server_context(pod: PodConfig) -> ssl.SSLContext | None:
    """Mutual TLS 1.3 for the peer-fetch server (``None`` when pod TLS is off): a peer
    must present a certificate the pod CA signed."""
    if not pod.tls_cert_file:
        return None
    cert, key, ca = _files(pod)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(pod: PodConfig) -> ssl.SSLContext | None:
    """TLS 1.3 towards a peer: its certificate must chain to the pod CA (any member's
    is accepted: the CA is the pod's own, so membership is the identity checked; host
    names are not, since peers are reached by their advertised addresses)."""
    if not pod.tls_cert_file:
        return None
    cert, key, ca = _files(pod)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
