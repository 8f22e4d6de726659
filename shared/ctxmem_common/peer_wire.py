"""Peer-fetch framing (service to service, TCP with TLS off loopback), its handshake and
its TLS: the one definition both the server and the client use (docs/pod.md, "Peer
fetch"; docs/security.md, "The pod's keys").

Handshake (challenge-response; no secret leaves a node before the peer proved itself):

* hello, client → server: ``b"CXPH"``, version (u8), the client's nonce (32 random
  bytes), its node id (u8 length + UTF-8).
* challenge, server → client: ``b"CXPC"``, version, the server's nonce, its node id. The
  server sends nothing else until the client proved itself.
* client proof (32 bytes): HMAC-SHA256 under the pod's peer key (:mod:`ctxmem_common.podkeys`) over
  the direction ``c2s``, both nonces, both node ids and, with TLS, the TLS channel
  binding (:meth:`Transcript.proof`): a member certificate that relays the handshake
  between two real nodes (TLS terminated on both legs) gets a proof that fails on the
  other leg, so it reads nothing in transit. The server
  checks it in constant time and answers ``1`` and its own proof (direction ``s2c``), or
  closes. The client checks the server's proof (and that the server's node id is the one
  the index named) before it sends any request.

Requests and answers, on a connection that passed the handshake:

* request: ``b"CXPR"``, namespace digest (16 bytes), the namespace proof (32 bytes:
  HMAC-SHA256 under the namespace's request key over both nonces and the digest,
  :func:`ns_proof`; a requester without the namespace's key reads nothing), key count
  (u32), then per key its length (u8) and bytes.
* answer, per key in order: status (u8: 1 hit, 0 miss), CRC32C (u32), length (u64),
  sequence (u64), authenticator (:data:`TAG_BYTES`: the namespace's block authenticator
  over the bytes, bound to the key and to :func:`answer_context`: both nonces and the
  sequence), then, for a hit, ``length`` bytes. The fetcher adopts nothing whose
  authenticator does not verify under its own key.

RDMA (docs/pod.md), on the same authenticated connection, only when both ends have it:

* attach, client → server: ``b"CXPA"`` and the client's queue pair (:data:`QP`). The
  server answers a status (u8: 1, then its own queue pair; 0: no RDMA here, use the
  requests above on this connection). One RC queue pair per connection, both ends', for
  the connection's life.
* RDMA request: as a request, with ``b"CXPD"``. Answer, per key in order
  (:data:`RDMA_ANSWER`): status, CRC32C, length, sequence, for a hit the remote
  address and rkey of the block, readable (RDMA READ only, this QP only) until the
  client sends ``b"CXPF"`` (done) or ``pod.fetch_timeout_s`` passes (the server holds
  the blocks pinned until then), and the authenticator, made over the pinned bytes
  before the grant; the fetcher verifies it after the READ.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import socket
import ssl
import struct
import time
from pathlib import Path

from ctxmem_common.codecs.blockauth import TAG_BYTES
from ctxmem_common.config import PodConfig
from ctxmem_common.errors import ConfigError
from ctxmem_common.rdma_wire import QpInfo

NONCE_BYTES = 32
PROOF_BYTES = 32
HELLO = struct.Struct("!4sB32sB")  # magic, version, nonce, node id length
HELLO_MAGIC = b"CXPH"
CHALLENGE_MAGIC = b"CXPC"
REQUEST = struct.Struct("!4s16s32sI")  # magic, namespace digest, namespace proof, count
REQUEST_MAGIC = b"CXPR"
ANSWER = struct.Struct(f"!BIQQ{TAG_BYTES}s")  # status, crc, length, seq, authenticator
VERSION = 2
# RDMA (both QP fields as ctxmem_common.rdma_wire.QpInfo: qpn, psn, gid, lid, mtu,
# rd_atomic).
QP = struct.Struct("!II16sHBB")
ATTACH_MAGIC = b"CXPA"
RDMA_REQUEST_MAGIC = b"CXPD"
DONE = b"CXPF"
# status, crc, length, seq, remote address, rkey, authenticator
RDMA_ANSWER = struct.Struct(f"!BIQQQI{TAG_BYTES}s")
NO_TAG = bytes(TAG_BYTES)
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


_SEQ = struct.Struct("!Q")


def pack_hello(magic: bytes, nonce: bytes, node_id: str) -> bytes:
    """A hello (``HELLO_MAGIC``) or a challenge (``CHALLENGE_MAGIC``)."""
    raw = node_id.encode()
    return HELLO.pack(magic, VERSION, nonce, len(raw)) + raw


class Transcript:
    """What both ends of one connection agree on after the hello and the challenge: the
    nonces and node ids every proof and every authenticator on it is bound to."""

    __slots__ = ("channel", "client_id", "client_nonce", "server_id", "server_nonce")

    def __init__(self, client_nonce: bytes, client_id: str, server_nonce: bytes,
                 server_id: str, channel: bytes = b"") -> None:
        self.client_nonce, self.client_id = client_nonce, client_id
        self.server_nonce, self.server_id = server_nonce, server_id
        #: The TLS channel binding (:func:`channel_binding`; empty without TLS): a relay
        #: that terminates TLS on both sides has two channels, so a proof made on one
        #: fails on the other.
        self.channel = channel

    def _body(self, label: bytes) -> bytes:
        c, s = self.client_id.encode(), self.server_id.encode()
        return b"".join((b"ctxmem-pod-peer-v1", label, self.client_nonce, self.server_nonce,
                         bytes((len(c),)), c, bytes((len(s),)), s,
                         bytes((len(self.channel),)), self.channel))

    def proof(self, peer_key: bytes, direction: bytes) -> bytes:
        """The handshake proof of the side sending in ``direction`` (``b"c2s"`` or
        ``b"s2c"``)."""
        return hmac.digest(peer_key, self._body(direction), "sha256")

    def ns_proof(self, request_key: bytes, ns_digest: bytes) -> bytes:
        """The proof, on this connection, that the requester holds ``ns_digest``'s key."""
        return hmac.digest(request_key, self._body(b"ns") + ns_digest, "sha256")

    def answer_context(self, seq: int) -> bytes:
        """What a served block's authenticator is bound to besides namespace, key and
        bytes: this connection (an answer recorded on another is refused) and the
        holder's sequence number of the block."""
        return self.client_nonce + self.server_nonce + _SEQ.pack(seq)


def check(mine: bytes, theirs: bytes) -> bool:
    """Constant-time compare of a proof."""
    return hmac.compare_digest(mine, theirs)


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


class HandshakeFailed(Exception):
    """The other end is not a pod member, or spoke another protocol (why, in the
    message)."""


def channel_binding(writer: asyncio.StreamWriter) -> bytes:
    """The connection's TLS channel binding (``tls-unique``: the client's Finished
    message, the same on both ends of one TLS session, different on each leg of a relay),
    or ``b""`` without TLS. Raises :class:`HandshakeFailed` when TLS gives none."""
    tls = writer.get_extra_info("ssl_object")
    if tls is None:
        return b""
    cb = tls.get_channel_binding("tls-unique")
    if not cb:
        raise HandshakeFailed("the TLS session gives no channel binding (tls-unique)")
    return bytes(cb)


async def _read_hello(reader: asyncio.StreamReader, magic: bytes, timeout_s: float,
                      what: str) -> tuple[bytes, str]:
    got, version, nonce, n = HELLO.unpack(
        await asyncio.wait_for(reader.readexactly(HELLO.size), timeout_s))
    if got != magic or version != VERSION:
        raise HandshakeFailed(f"{what}: magic {got!r} version {version} where "
                              f"{magic!r} version {VERSION} was expected (an older ctxmem, "
                              f"or not a pod member)")
    raw = await asyncio.wait_for(reader.readexactly(n), timeout_s) if n else b""
    try:
        return nonce, raw.decode()
    except UnicodeDecodeError:
        raise HandshakeFailed(f"{what}: node id is not UTF-8") from None


async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 peer_key: bytes, node_id: str, timeout_s: float) -> Transcript:
    """The server's side of the handshake: hello in, challenge out, the client's proof
    checked, then ``1`` and this server's proof. Nothing but the challenge is sent before
    the client proved itself. Raises :class:`HandshakeFailed` (and the stream errors)."""
    c_nonce, c_id = await _read_hello(reader, HELLO_MAGIC, timeout_s, "peer hello")
    t = Transcript(c_nonce, c_id, new_nonce(), node_id, channel_binding(writer))
    writer.write(pack_hello(CHALLENGE_MAGIC, t.server_nonce, node_id))
    theirs = await asyncio.wait_for(reader.readexactly(PROOF_BYTES), timeout_s)
    if not check(t.proof(peer_key, b"c2s"), theirs):
        raise HandshakeFailed(f"peer {c_id!r} did not prove it holds the pod's peer key "
                              f"(another master key or pod token)")
    writer.write(b"\x01" + t.proof(peer_key, b"s2c"))
    return t


async def connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                  peer_key: bytes, node_id: str, expect_id: str, timeout_s: float
                  ) -> Transcript:
    """The client's side: hello with a fresh nonce, the server's challenge (its node id
    must be ``expect_id``, the node the index named), this node's proof, then the
    server's proof checked before anything else is sent. Raises
    :class:`HandshakeFailed` (and the stream errors)."""
    nonce = new_nonce()
    writer.write(pack_hello(HELLO_MAGIC, nonce, node_id))
    s_nonce, s_id = await _read_hello(reader, CHALLENGE_MAGIC, timeout_s, "peer challenge")
    if s_id != expect_id:
        raise HandshakeFailed(f"the peer says it is node {s_id!r} where the index named "
                              f"{expect_id!r}")
    t = Transcript(nonce, node_id, s_nonce, s_id, channel_binding(writer))
    writer.write(t.proof(peer_key, b"c2s"))
    ok = await asyncio.wait_for(reader.readexactly(1 + PROOF_BYTES), timeout_s)
    if ok[:1] != b"\x01" or not check(t.proof(peer_key, b"s2c"), ok[1:]):
        raise HandshakeFailed(f"node {s_id!r} did not prove it holds the pod's peer key "
                              f"(another master key or pod token, or not a pod member)")
    return t


class Deadline:
    """A monotonic deadline for blocking socket calls: :meth:`arm` sets a socket's timeout
    to what is left (``TimeoutError`` once it passed), so a peer that trickles bytes is
    bounded by the whole deadline, never a timeout per call."""

    __slots__ = ("at",)

    def __init__(self, timeout_s: float) -> None:
        self.at = time.monotonic() + timeout_s

    def left(self) -> float:
        return self.at - time.monotonic()

    def arm(self, sock: socket.socket) -> None:
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError("peer fetch: the deadline (pod.fetch_timeout_s) passed")
        sock.settimeout(left)


def recv_into_exactly(sock: socket.socket, view: memoryview, deadline: Deadline,
                      what: str) -> None:
    """Fill ``view`` from ``sock`` (``recv_into``: the bytes land in ``view`` itself, in
    C; no intermediate buffer), within ``deadline``. Raises ``ConnectionError`` naming
    ``what`` when the peer closes first, ``TimeoutError`` past the deadline."""
    got, n = 0, len(view)
    while got < n:
        deadline.arm(sock)
        k = sock.recv_into(view[got:] if got else view)
        if not k:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes "
                                  f"of {what}")
        got += k


def recv_block_into(sock: socket.socket, view: memoryview, deadline: Deadline,
                    what: str) -> None:
    """:func:`recv_into_exactly` for a block's bytes: on a plain socket, one blocking
    ``recv_into`` with ``MSG_WAITALL`` (the kernel fills the whole block before the
    thread runs again: one system call and one GIL hand-off per block instead of one per
    socket-buffer's worth), bounded by ``SO_RCVTIMEO`` set to what is left of
    ``deadline``. A TLS socket takes no flags: :func:`recv_into_exactly` there."""
    if isinstance(sock, ssl.SSLSocket):
        recv_into_exactly(sock, view, deadline, what)
        return
    got, n = 0, len(view)
    sock.settimeout(None)  # blocking: the wait is in the kernel, bounded by SO_RCVTIMEO
    try:
        while got < n:
            left = deadline.left()
            if left <= 0:
                raise TimeoutError("peer fetch: the deadline (pod.fetch_timeout_s) passed "
                                   f"after {got} of {n} bytes of {what}")
            sec = int(left)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                            struct.pack("ll", sec, max(1, int((left - sec) * 1e6))))
            try:
                k = sock.recv_into(view[got:] if got else view, n - got, socket.MSG_WAITALL)
            except BlockingIOError:  # SO_RCVTIMEO passed with nothing received
                continue  # the deadline check above raises
            if not k:
                raise ConnectionError(f"peer closed the connection after {got} of {n} "
                                      f"bytes of {what}")
            got += k
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))


def recv_exactly(sock: socket.socket, n: int, deadline: Deadline, what: str) -> bytes:
    buf = bytearray(n)
    recv_into_exactly(sock, memoryview(buf), deadline, what)
    return bytes(buf)


def socket_channel_binding(sock: socket.socket) -> bytes:
    """:func:`channel_binding` of a blocking socket (``tls-unique`` of an
    ``ssl.SSLSocket``, ``b""`` for a plain one)."""
    if not isinstance(sock, ssl.SSLSocket):
        return b""
    cb = sock.get_channel_binding("tls-unique")
    if not cb:
        raise HandshakeFailed("the TLS session gives no channel binding (tls-unique)")
    return bytes(cb)


def connect_blocking(sock: socket.socket, peer_key: bytes, node_id: str, expect_id: str,
                     deadline: Deadline) -> Transcript:
    """:func:`connect` on a blocking socket (plain or ``ssl.SSLSocket``, its TLS
    handshake done), every read within ``deadline``: the same messages and the same
    checks (the server's node id must be ``expect_id``, its proof must verify before
    anything else is sent). Raises :class:`HandshakeFailed` (and the socket errors)."""
    nonce = new_nonce()
    deadline.arm(sock)
    sock.sendall(pack_hello(HELLO_MAGIC, nonce, node_id))
    got, version, s_nonce, n = HELLO.unpack(recv_exactly(sock, HELLO.size, deadline,
                                                         "the peer challenge"))
    if got != CHALLENGE_MAGIC or version != VERSION:
        raise HandshakeFailed(f"peer challenge: magic {got!r} version {version} where "
                              f"{CHALLENGE_MAGIC!r} version {VERSION} was expected (an older "
                              f"ctxmem, or not a pod member)")
    raw = recv_exactly(sock, n, deadline, "the peer's node id") if n else b""
    try:
        s_id = raw.decode()
    except UnicodeDecodeError:
        raise HandshakeFailed("peer challenge: node id is not UTF-8") from None
    if s_id != expect_id:
        raise HandshakeFailed(f"the peer says it is node {s_id!r} where the index named "
                              f"{expect_id!r}")
    t = Transcript(nonce, node_id, s_nonce, s_id, socket_channel_binding(sock))
    deadline.arm(sock)
    sock.sendall(t.proof(peer_key, b"c2s"))
    ok = recv_exactly(sock, 1 + PROOF_BYTES, deadline, "the peer's proof")
    if ok[:1] != b"\x01" or not check(t.proof(peer_key, b"s2c"), ok[1:]):
        raise HandshakeFailed(f"node {s_id!r} did not prove it holds the pod's peer key "
                              f"(another master key or pod token, or not a pod member)")
    return t


def pack_keys(ns_digest: bytes, keys: list[bytes], magic: bytes = REQUEST_MAGIC,
              proof: bytes = bytes(PROOF_BYTES)) -> bytes:
    parts = [REQUEST.pack(magic, ns_digest, proof, len(keys))]
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


#: ``ssl.OP_ENABLE_KTLS`` where this Python has it (3.12+), else 0 (nothing asked).
KTLS_OPTION: int = getattr(ssl, "OP_ENABLE_KTLS", 0)


def client_context(pod: PodConfig) -> ssl.SSLContext | None:
    """TLS 1.3 towards a peer: its certificate must chain to the pod CA (any member's
    is accepted: the CA is the pod's own, so membership is the identity checked; host
    names are not, since peers are reached by their advertised addresses)."""
    if not pod.tls_cert_file:
        return None
    cert, key, ca = _files(pod)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    # Kernel TLS where Python exposes it (3.12+) and OpenSSL and the kernel allow it: the
    # fetcher's blocking sockets then decrypt in the kernel; else OpenSSL's record layer
    # as before (docs/pod.md, "Peer fetch data path").
    ctx.options |= KTLS_OPTION
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
