"""Peer-fetch framing (service to service, TCP with TLS off loopback) and its TLS and
token checks: the one definition both the server and the client use.

* hello, client → server: ``b"CXPH"``, version (u8), token length (u16), the pod token.
  The server answers one byte (1: accepted) or closes. Constant-time compare.
* request: ``b"CXPR"``, namespace digest (16 bytes), key count (u32), then per key its
  length (u8) and bytes.
* answer, per key in order: status (u8: 1 hit, 0 miss), CRC32C (u32), length (u64),
  sequence (u64), then, for a hit, ``length`` bytes.

RDMA (docs/pod.md), on the same authenticated connection, only when both ends have it:

* attach, client → server: ``b"CXPA"`` and the client's queue pair (:data:`QP`). The
  server answers a status (u8: 1, then its own queue pair; 0: no RDMA here, use the
  requests above on this connection). One RC queue pair per connection, both ends', for
  the connection's life.
* RDMA request: as a request, with ``b"CXPD"``. Answer, per key in order
  (:data:`RDMA_ANSWER`): status, CRC32C, length, sequence, and for a hit the remote
  address and rkey of the block, readable (RDMA READ only, this QP only) until the
  client sends ``b"CXPF"`` (done) or ``pod.fetch_timeout_s`` passes; the server holds the
  blocks pinned until then.
"""

from __future__ import annotations

import hmac
import os
import ssl
import struct
from pathlib import Path

from ctxmem_common.config import PodConfig
from ctxmem_common.errors import ConfigError
from ctxmem_common.rdma_wire import QpInfo

HELLO = struct.Struct("!4sBH")
HELLO_MAGIC = b"CXPH"
REQUEST = struct.Struct("!4s16sI")
REQUEST_MAGIC = b"CXPR"
ANSWER = struct.Struct("!BIQQ")
VERSION = 1
# RDMA (both QP fields as ctxmem_common.rdma_wire.QpInfo: qpn, psn, gid, lid, mtu,
# rd_atomic).
QP = struct.Struct("!II16sHBB")
ATTACH_MAGIC = b"CXPA"
RDMA_REQUEST_MAGIC = b"CXPD"
DONE = b"CXPF"
RDMA_ANSWER = struct.Struct("!BIQQQI")  # status, crc, length, seq, remote address, rkey
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


def pack_keys(ns_digest: bytes, keys: list[bytes], magic: bytes = REQUEST_MAGIC) -> bytes:
    parts = [REQUEST.pack(magic, ns_digest, len(keys))]
    for k in keys:
        parts.append(bytes((len(k),)))
        parts.append(k)
    return b"".join(parts)


def pack_qp(qp: QpInfo) -> bytes:
    return QP.pack(qp.qpn, qp.psn, qp.gid, qp.lid, qp.mtu, qp.rd_atomic)


def unpack_qp(raw: bytes, what: str) -> QpInfo:
    """A peer's queue pair from :data:`QP` bytes (``InvalidArgument`` naming ``what``
    when a field does not fit its verbs type)."""
    return QpInfo(*QP.unpack(raw)).check(what)


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
