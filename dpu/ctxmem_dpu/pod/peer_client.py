"""Peer fetch, the client side: :class:`PeerSource` asks the holder node's peer-fetch
server for blocks and checks every answer.

A peer is trusted for nothing, and neither is the index that named it: a connection is
used only once the peer proved, in the challenge-response handshake
(:func:`~ctxmem_common.peer_wire.connect`), that it holds the pod's peer key and is the
node the index named; this node's proof is an HMAC over fresh nonces, so an impostor
learns nothing it could guess offline, and no token is sent. An answer is used only when
its authenticator verifies under this node's own key of the namespace
(:class:`~ctxmem_common.codecs.blockauth.BlockAuthenticator`, bound to the key, the bytes,
this connection and the sequence number; over RDMA, verified after the READ): a block that
does not is a miss, counted (``pod_fetch_unauthenticated``) and logged. The CRC32C checks
against the index entry stay as accident checks. Anything else, and a peer that is dead,
slow past ``pod.fetch_timeout_s`` or unreachable, is a miss. Connections are kept per
peer and reused; one that fails or times out is closed, never reused.

**Bulk bytes off the event loop, landing once** (issue 28 items 1 and 2): without an RDMA
device, a fetch runs on plain blocking sockets, a pool per peer (TLS: ``ssl.SSLSocket``,
the same mutual TLS 1.3 and handshake), each connection driven by one worker thread at a
time: the request is sent, each block is received with ``recv_into`` straight into the
buffer the caller gave (the DRAM slot it is adopted into, :meth:`PeerSource.fetch_into`),
and checked there in the same pass (length, CRC32C against the entry, authenticator), so
no byte passes through an intermediate buffer or the event loop. A fetch from one peer is
spread over up to :data:`STREAMS` connections at once, and each fetch takes connections
of its own (idle ones reused, new ones opened up to :data:`MAX_CONNS_PER_PEER` per peer),
so a fetch never waits behind another's bytes and the loop only awaits the result. Every
socket call is bounded by the fetch's one deadline (``pod.fetch_timeout_s``); a fetch that
is cancelled or times out shuts its sockets down and waits for its threads before the
buffers are given back.

With an RDMA device (``pod.rdma_listen``), each new connection offers the holder a queue
pair; where the holder attaches it, requests on that connection are answered with READ
keys and the blocks are read by RDMA (:mod:`ctxmem_dpu.pod.peer_rdma`), else the same
connection carries them over TCP. A failed RDMA setup or transfer is logged, counted
(``pod_rdma_setup_errors``, ``pod_peer_rdma_fallbacks``) and turns that peer to TCP for
:data:`RDMA_RETRY_S`; the blocks of a failed transfer are misses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import select
import socket
import ssl as ssl_mod
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from crc32c import crc32c

from ctxmem_common import peer_wire as w
from ctxmem_common.config import PodConfig
from ctxmem_common.errors import CtxmemError
from ctxmem_common.netaddr import split_hostport
from ctxmem_common.podkeys import NamespaceKeys, PodKeys
from ctxmem_dpu.logthrottle import throttled
from ctxmem_dpu.pod.entries import RemoteEntry
from ctxmem_dpu.pod.peer_rdma import FetchLink, RdmaTransferError
from ctxmem_dpu.pod.sources import RemoteSource
from ctxmem_dpu.transport.rdma_device import RdmaDevice

log = logging.getLogger(__name__)
_UNAUTH = ("peer block %s of namespace %s from node %s: its authenticator does not verify "
           "under this node's key (a peer without the pod's master key, or bytes changed "
           "on the way); a miss, nothing adopted")

# A peer that failed RDMA (setup or a transfer) is fetched from over TCP this long.
RDMA_RETRY_S = 30.0
#: Connections one fetch from one peer is spread over at most (each part on its own
#: connection and thread), and the least bytes a part carries.
STREAMS = 4
STREAM_MIN_BYTES = 4 << 20
#: Connections open to one peer at once; a fetch beyond waits for one (within its
#: deadline).
MAX_CONNS_PER_PEER = 16
#: Worker threads that move peer-fetch bytes (all peers together).
THREADS = 16
# Beyond the fetch's deadline, how long the loop waits for a worker before it shuts the
# worker's socket down (the worker's own socket timeouts end it first).
_GRACE_S = 1.0


@dataclass
class Conn:
    """One connection to a peer's peer-fetch server, and its RDMA link if attached."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    link: FetchLink | None = None
    transcript: w.Transcript | None = None  # set once the handshake passed

    def abort(self) -> None:
        if self.link is not None:
            self.link.close()  # before the socket: no READ lands after this
        self.writer.transport.abort()


class BlockingConn:
    """One blocking connection to a peer (plain or TLS), driven by one worker thread at a
    time. :meth:`kill` may be called from the loop at any time: it shuts the socket down,
    so the worker's socket call returns at once (the worker then fails the fetch)."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.transcript: w.Transcript | None = None
        self.hdr = bytearray(w.ANSWER.size)
        self._lock = threading.Lock()
        self._killed = False

    def attach(self, sock: socket.socket) -> None:
        """Take ``sock`` (the worker, once made); raises when killed meanwhile."""
        with self._lock:
            if self._killed:
                sock.close()
                raise ConnectionError("peer fetch cancelled while connecting")
            self.sock = sock

    def kill(self) -> None:
        with self._lock:
            self._killed = True
            sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the fd, not a TLS close

    def close(self) -> None:
        self.kill()
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()

    def usable(self) -> bool:
        """Idle and still open: nothing to read (an idle peer connection that became
        readable was closed by the peer, or broke the protocol)."""
        if self._killed or self.sock is None or self.sock.fileno() < 0:
            return False
        try:
            readable, _w, _x = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable


@dataclass
class _Part:
    """One part of a fetch, done by one worker on one connection: what it fetched so
    far (also when it failed half way), and what to count and log on the loop."""

    entries: Sequence[RemoteEntry]
    views: Sequence[memoryview]
    landed: list[bool] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    warnings: list[tuple[str, str, tuple[object, ...]]] = field(default_factory=list)


class PeerFailed(Exception):
    """A peer answered something that is not the protocol (what, in the message)."""


class PeerSource(RemoteSource):
    """Blocks from the node that holds them, over TCP (TLS 1.3 with the pod CA when
    configured). ``address_of(node_id)`` gives a live peer's advertised address, or
    ``None`` for a node not alive. Every block it returns verified under ``keys``."""

    name = "peer"
    verifies = True
    lands = True  # fetch_into: recv_into the caller's buffers, checked there

    def __init__(self, pod: PodConfig, address_of: Callable[[str], str | None],
                 counters: Counter[str], keys: PodKeys,
                 rdma: RdmaDevice | None = None) -> None:
        self._pod = pod
        self._rdma = rdma
        self._tcp_until: dict[str, float] = {}  # peer address -> RDMA not tried before
        self._address_of = address_of
        self._counters = counters
        self._keys = keys
        self._ssl = w.client_context(pod)
        self._idle: dict[str, list[Conn]] = {}
        self._closed = False
        # The blocking path (no RDMA device): idle connections per peer, those in use,
        # a cap per peer, and the worker threads.
        self._pool: dict[str, list[BlockingConn]] = {}
        self._busy: set[BlockingConn] = set()
        self._caps: dict[str, asyncio.Semaphore] = {}
        self._workers = concurrent.futures.ThreadPoolExecutor(
            THREADS, thread_name_prefix="ctxmem-peer")

    def accepts(self, entry: RemoteEntry) -> bool:
        return self._address_of(entry.node_id) is not None

    async def fetch(self, ns_digest: bytes, entries: Sequence[RemoteEntry]
                    ) -> list[bytes | None]:
        """:meth:`fetch_into` buffers of its own, as bytes."""
        bufs = [bytearray(e.nbytes) for e in entries]
        landed = await self.fetch_into(ns_digest, entries, [memoryview(b) for b in bufs])
        return [bytes(b) if ok else None for b, ok in zip(bufs, landed, strict=True)]

    async def fetch_into(self, ns_digest: bytes, entries: Sequence[RemoteEntry],
                         views: Sequence[memoryview]) -> list[bool]:
        """Each entry's block received into ``views[i]`` and verified there (module
        docstring); per entry whether it landed. Returns only once nothing writes into
        ``views`` any more (also when cancelled)."""
        out = [False] * len(entries)
        by_node: dict[str, list[int]] = {}
        for i, e in enumerate(entries):
            by_node.setdefault(e.node_id, []).append(i)
        jobs = [self._from_node(ns_digest, node, [entries[i] for i in idx],
                                [views[i] for i in idx])
                for node, idx in by_node.items()]
        for idx, got in zip(by_node.values(), await asyncio.gather(*jobs), strict=True):
            for i, ok in zip(idx, got, strict=True):
                out[i] = ok
        return out

    async def _from_node(self, ns_digest: bytes, node: str, entries: list[RemoteEntry],
                         views: list[memoryview]) -> list[bool]:
        addr = self._address_of(node)
        if addr is None or self._closed:
            return [False] * len(entries)
        if self._rdma is None:
            return await self._from_node_blocking(ns_digest, node, addr, entries, views)
        got: list[bool] = []
        conn: Conn | None = None

        async def run() -> None:
            nonlocal conn
            conn = await self._connection(addr, node)
            for part in range(0, len(entries), w.MAX_KEYS):
                chunk = entries[part:part + w.MAX_KEYS]
                into = views[part:part + w.MAX_KEYS]
                got.extend(await (self._request_rdma(conn, ns_digest, chunk, into)
                                  if conn.link is not None else
                                  self._request(conn, ns_digest, chunk, into)))

        try:
            await asyncio.wait_for(run(), self._pod.fetch_timeout_s)
            assert conn is not None
            self._idle.setdefault(f"{node}@{addr}", []).append(conn)
            return got
        except (OSError, TimeoutError, asyncio.TimeoutError, asyncio.IncompleteReadError,
                PeerFailed, RdmaTransferError, w.HandshakeFailed) as exc:
            self._counters["pod_peer_errors"] += 1
            if conn is not None and conn.link is not None:
                self._rdma_failed(addr, f"transfer: {exc}", setup=False)
            throttled(log, logging.WARNING, "pod.peer_fetch",
                      "peer fetch of %d blocks from node %s at %s failed (%s: %s); they "
                      "are misses", len(entries), node, addr, type(exc).__name__, exc)
            if conn is not None:
                conn.abort()
            return got + [False] * (len(entries) - len(got))

    # -- the blocking path: worker threads, recv_into the caller's buffers ------------
    async def _from_node_blocking(self, ns_digest: bytes, node: str, addr: str,
                                  entries: list[RemoteEntry], views: list[memoryview]
                                  ) -> list[bool]:
        """The entries of one peer, in up to :data:`STREAMS` parts fetched at once, each
        on a connection of its own, all within one deadline."""
        deadline = w.Deadline(self._pod.fetch_timeout_s)
        nk = self._keys.namespace(ns_digest)
        total = sum(e.nbytes for e in entries)
        k = max(1, min(STREAMS, len(entries), total // STREAM_MIN_BYTES))
        size = -(-len(entries) // k)
        parts = [_Part(entries[i:i + size], views[i:i + size])
                 for i in range(0, len(entries), size)]
        await asyncio.gather(*(self._run_part(ns_digest, nk, node, addr, p, deadline)
                               for p in parts))
        return [ok for p in parts
                for ok in p.landed + [False] * (len(p.entries) - len(p.landed))]

    async def _run_part(self, ns_digest: bytes, nk: NamespaceKeys, node: str, addr: str,
                        part: _Part, deadline: w.Deadline) -> None:
        where = f"{node}@{addr}"
        cap = self._caps.setdefault(where, asyncio.Semaphore(MAX_CONNS_PER_PEER))
        conn: BlockingConn | None = None
        try:
            await asyncio.wait_for(cap.acquire(), max(0.0, deadline.left()))
        except (TimeoutError, asyncio.TimeoutError):
            self._failed(part, node, addr, TimeoutError(
                f"{MAX_CONNS_PER_PEER} connections to the peer busy past the deadline"))
            return
        try:
            conn = self._idle_conn(where)
            self._busy.add(conn)
            fut = asyncio.get_running_loop().run_in_executor(
                self._workers, self._work, conn, node, addr, ns_digest, nk, part, deadline)
            await self._settle(fut, conn, deadline)
        except (OSError, TimeoutError, asyncio.TimeoutError, PeerFailed,
                w.HandshakeFailed, RuntimeError) as exc:  # RuntimeError: closed meanwhile
            if conn is not None:
                conn.close()
            self._failed(part, node, addr, exc)
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        else:
            if self._closed:
                conn.close()
            else:
                self._pool.setdefault(where, []).append(conn)
        finally:
            cap.release()
            if conn is not None:
                self._busy.discard(conn)
            self._counters.update(part.counts)
            for site, msg, args in part.warnings:
                throttled(log, logging.WARNING, site, msg, *args)

    def _failed(self, part: _Part, node: str, addr: str, exc: BaseException) -> None:
        self._counters["pod_peer_errors"] += 1
        throttled(log, logging.WARNING, "pod.peer_fetch",
                  "peer fetch of %d blocks from node %s at %s failed (%s: %s); they "
                  "are misses", len(part.entries) - len(part.landed), node, addr,
                  type(exc).__name__, exc)

    def _idle_conn(self, where: str) -> BlockingConn:
        idle = self._pool.get(where)
        while idle:
            conn = idle.pop()
            if conn.usable():
                return conn
            conn.close()
        return BlockingConn()  # the worker connects it

    @staticmethod
    async def _settle(fut: asyncio.Future[None], conn: BlockingConn,
                      deadline: w.Deadline) -> None:
        """The worker's result. If this task is cancelled, or the worker outlives the
        deadline, its socket is shut down and the worker waited for (it writes into the
        caller's buffers until it returns), then the error is raised."""
        try:
            await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline.left()) + _GRACE_S)
        except BaseException:
            conn.kill()
            while not fut.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({fut})
            if not fut.cancelled():
                fut.exception()  # retrieved: the error raised is this task's own
            raise

    def _connect(self, conn: BlockingConn, node: str, addr: str,
                 deadline: w.Deadline) -> None:
        """On the worker: open, TLS (mutual, the pod CA) and the handshake, bounded by
        ``pod.connect_timeout_s`` and the deadline."""
        host, port = split_hostport(addr, "peer address")
        raw = socket.create_connection(
            (host, port), timeout=max(0.001, min(self._pod.connect_timeout_s,
                                                 deadline.left())))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock: socket.socket = raw
        if self._ssl is not None:
            sock = self._ssl.wrap_socket(raw, do_handshake_on_connect=False)
        conn.attach(sock)  # from here on, kill() ends its calls
        if self._ssl is not None:
            deadline.arm(sock)
            assert isinstance(sock, ssl_mod.SSLSocket)
            sock.do_handshake()
        conn.transcript = w.connect_blocking(sock, self._keys.peer_key, self._pod.node_id,
                                             node, deadline)

    def _work(self, conn: BlockingConn, node: str, addr: str, ns_digest: bytes,
              nk: NamespaceKeys, part: _Part, deadline: w.Deadline) -> None:
        """On a worker thread: one part's requests and answers; each block received
        into its view and checked there, in that pass: the answer must match the entry
        (length; a CRC32C or length the index does not name is a miss), then the bytes'
        CRC32C and the authenticator under this node's key, bound to this connection.
        ``part.landed`` grows as blocks are done (kept when a later one fails)."""
        if conn.sock is None:
            self._connect(conn, node, addr, deadline)
        sock, tr = conn.sock, conn.transcript
        assert sock is not None and tr is not None
        hdr = memoryview(conn.hdr)
        entries, views = part.entries, part.views

        for start in range(0, len(entries), w.MAX_KEYS):
            chunk = entries[start:start + w.MAX_KEYS]
            deadline.arm(sock)
            sock.sendall(w.pack_keys(ns_digest, [e.key for e in chunk], w.REQUEST_MAGIC,
                                     tr.ns_proof(nk.request_key, ns_digest)))
            for e, view in zip(chunk, views[start:start + w.MAX_KEYS], strict=True):
                w.recv_into_exactly(sock, hdr, deadline, "an answer")
                status, crc, nbytes, seq, tag = w.ANSWER.unpack(hdr)
                if status == 0:
                    part.counts["pod_peer_misses"] += 1
                    part.landed.append(False)
                    continue
                if status != 1 or nbytes != e.nbytes or len(view) != nbytes:
                    raise PeerFailed(f"answer for key {e.key.hex()[:16]}: status {status}, "
                                     f"{nbytes} bytes where the index says {e.nbytes}")
                w.recv_block_into(sock, view, deadline, f"block {e.key.hex()[:16]}")
                got = crc32c(view)
                if crc != e.crc32c or got != crc:
                    part.counts["pod_fetch_bad"] += 1
                    part.warnings.append((
                        "pod.peer_crc", "peer block %s: CRC32C %08x (sent) / %08x "
                        "(received) where the index says %08x; a miss",
                        (e.key.hex()[:16], crc, got, e.crc32c)))
                    part.landed.append(False)
                    continue
                if not nk.auth.verify(e.key, view, tag, tr.answer_context(seq)):
                    part.counts["pod_fetch_unauthenticated"] += 1
                    part.warnings.append(("pod.peer_unauthenticated", _UNAUTH,
                                          (e.key.hex()[:16], ns_digest.hex(), e.node_id)))
                    part.landed.append(False)
                    continue
                part.landed.append(True)

    async def _connection(self, addr: str, node: str) -> Conn:
        idle = self._idle.get(f"{node}@{addr}")
        while idle:
            conn = idle.pop()
            if not conn.writer.is_closing() and not conn.reader.at_eof():
                return conn
            conn.abort()
        host, port = split_hostport(addr, "peer address")
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=self._ssl, limit=w.STREAM_LIMIT,
                                    ssl_handshake_timeout=self._pod.connect_timeout_s
                                    if self._ssl else None),
            self._pod.connect_timeout_s)
        conn = Conn(reader, writer)
        try:
            # Each handshake read bounded like the rest of the fetch (its caller's
            # pod.fetch_timeout_s bounds the whole).
            conn.transcript = await w.connect(reader, writer, self._keys.peer_key,
                                              self._pod.node_id, node,
                                              self._pod.fetch_timeout_s)
            if self._rdma is not None and time.monotonic() >= self._tcp_until.get(addr, 0.0):
                conn.link = await self._attach(conn, addr)
        except BaseException:
            conn.abort()
            raise
        return conn

    async def _attach(self, conn: Conn, addr: str) -> FetchLink | None:
        """Offer the holder a queue pair; the connected link, or ``None`` (TCP on this
        connection) when the holder has no RDMA or setting it up failed."""
        assert self._rdma is not None
        try:
            link = FetchLink(self._rdma)
        except CtxmemError as exc:
            self._rdma_failed(addr, exc.message)
            return None
        try:
            conn.writer.write(w.ATTACH_MAGIC + w.pack_qp(link.info()))
            status = await conn.reader.readexactly(1)
            if status != b"\x01":
                self._counters["pod_peer_rdma_fallbacks"] += 1
                self._tcp_until[addr] = time.monotonic() + RDMA_RETRY_S
                throttled(log, logging.INFO, "pod.peer_rdma_none",
                          "peer %s has no RDMA for peer fetch; fetching from it over TCP",
                          addr)
                link.close()
                return None
            peer = w.unpack_qp(await conn.reader.readexactly(w.QP.size),
                               f"peer {addr}'s attach answer")
            link.connect(peer)
        except CtxmemError as exc:  # the holder's QP goes unused; TCP on this connection
            link.close()
            self._rdma_failed(addr, exc.message)
            return None
        except BaseException:
            link.close()
            raise
        return link

    def _rdma_failed(self, addr: str, why: str, setup: bool = True) -> None:
        """RDMA to ``addr`` failed (setting it up, or a transfer): TCP to it for a while."""
        if setup:
            self._counters["pod_rdma_setup_errors"] += 1
        self._counters["pod_peer_rdma_fallbacks"] += 1
        self._tcp_until[addr] = time.monotonic() + RDMA_RETRY_S
        throttled(log, logging.WARNING, "pod.peer_rdma",
                  "peer fetch over RDMA from %s failed (%s); TCP for the next %g s",
                  addr, why, RDMA_RETRY_S)

    def _request_bytes(self, conn: Conn, ns_digest: bytes, entries: Sequence[RemoteEntry],
                       magic: bytes) -> bytes:
        """A request with this connection's proof that this node holds the namespace's
        key."""
        assert conn.transcript is not None
        nk = self._keys.namespace(ns_digest)
        return w.pack_keys(ns_digest, [e.key for e in entries], magic,
                           conn.transcript.ns_proof(nk.request_key, ns_digest))

    def _verified(self, conn: Conn, ns_digest: bytes, e: RemoteEntry, data: memoryview,
                  seq: int, tag: bytes, check_crc: bool) -> bool:
        """Whether ``data`` (the block where it landed) verifies under this node's key
        (else a miss, counted ``pod_fetch_unauthenticated``, logged) and, with
        ``check_crc``, then matches the entry's CRC32C (else ``pod_fetch_bad``)."""
        assert conn.transcript is not None
        auth = self._keys.namespace(ns_digest).auth
        if not auth.verify(e.key, data, tag, conn.transcript.answer_context(seq)):
            self._counters["pod_fetch_unauthenticated"] += 1
            throttled(log, logging.WARNING, "pod.peer_unauthenticated", _UNAUTH,
                      e.key.hex()[:16], ns_digest.hex(), e.node_id)
            return False
        if check_crc and (got := crc32c(data)) != e.crc32c:
            self._counters["pod_fetch_bad"] += 1
            throttled(log, logging.WARNING, "pod.peer_crc",
                      "peer block %s: CRC32C %08x (received) where the index says %08x; "
                      "a miss", e.key.hex()[:16], got, e.crc32c)
            return False
        return True

    async def _request_rdma(self, conn: Conn, ns_digest: bytes,
                            entries: Sequence[RemoteEntry], views: Sequence[memoryview]
                            ) -> list[bool]:
        """One request answered with READ keys: the hits whose answer matches the index
        entry are read by RDMA and their authenticators verified, then the lease is ended
        (done); a holder that could not grant them (status 2) is asked again over TCP on
        the same connection."""
        assert conn.link is not None
        conn.writer.write(self._request_bytes(conn, ns_digest, entries, w.RDMA_REQUEST_MAGIC))
        raw = await conn.reader.readexactly(w.RDMA_ANSWER.size * len(entries))
        out = [False] * len(entries)
        want: list[int] = []
        items: list[tuple[int, int, int]] = []
        tags: list[tuple[int, bytes]] = []
        again: list[int] = []
        granted = False  # the holder holds a lease until our done
        for i, e in enumerate(entries):
            status, crc, nbytes, seq, addr, rkey, tag = w.RDMA_ANSWER.unpack_from(
                raw, i * w.RDMA_ANSWER.size)
            granted = granted or status == 1
            if status == 2:
                again.append(i)
            elif status != 1 or nbytes != e.nbytes or crc != e.crc32c \
                    or len(views[i]) != nbytes:
                self._counters["pod_peer_misses"] += 1  # stale: another version there
            else:
                want.append(i)
                items.append((addr, rkey, nbytes))
                tags.append((seq, tag))
        if items:
            data = await self._read_watched(conn, items)
            for i, d, (seq, tag) in zip(want, data, tags, strict=True):
                # The link's landing buffer is reused: one copy into the caller's buffer,
                # checked there.
                views[i][:] = d
                out[i] = self._verified(conn, ns_digest, entries[i], views[i], seq, tag,
                                        check_crc=True)
            self._counters["pod_peer_rdma_blocks"] += len(items)
            self._counters["pod_peer_rdma_bytes"] += sum(n for _a, _k, n in items)
        if granted:
            conn.writer.write(w.DONE)
        if again:
            self._counters["pod_peer_rdma_fallbacks"] += 1
            got = await self._request(conn, ns_digest, [entries[i] for i in again],
                                      [views[i] for i in again])
            for i, tcp_got in zip(again, got, strict=True):
                out[i] = tcp_got
        return out

    async def _read_watched(self, conn: Conn, items: list[tuple[int, int, int]]
                            ) -> list[bytes]:
        """The link's READs, ended early when the holder's connection ends (it died, or
        ended the lease): a READ towards a QP that is gone may only end at the RC retry
        limit or not at all (Soft-RoCE), while the socket says so at once. The holder
        sends nothing during a lease, so any byte or EOF there ends the READs."""
        assert conn.link is not None
        watch = asyncio.ensure_future(conn.reader.read(1))
        read = asyncio.ensure_future(conn.link.read(items, self._pod.fetch_timeout_s))
        try:
            done, _ = await asyncio.wait({watch, read}, return_when=asyncio.FIRST_COMPLETED)
            if watch in done:  # EOF, or a byte out of protocol: the connection is done
                raise PeerFailed("the holder closed the connection during the RDMA READs "
                                 "(it died or ended the lease)")
            return read.result()
        finally:
            for t in (watch, read):
                if not t.done():
                    t.cancel()
                    with contextlib.suppress(BaseException):
                        await t

    async def _request(self, conn: Conn, ns_digest: bytes, entries: Sequence[RemoteEntry],
                       views: Sequence[memoryview]) -> list[bool]:
        """A request over TCP on an asyncio connection (a node with an RDMA device: the
        connection may carry READ keys too); each block copied into its view and checked
        there."""
        reader, writer = conn.reader, conn.writer
        writer.write(self._request_bytes(conn, ns_digest, entries, w.REQUEST_MAGIC))
        out: list[bool] = []
        for e, view in zip(entries, views, strict=True):
            status, crc, nbytes, seq, tag = w.ANSWER.unpack(
                await reader.readexactly(w.ANSWER.size))
            if status == 0:
                self._counters["pod_peer_misses"] += 1
                out.append(False)
                continue
            if status != 1 or nbytes != e.nbytes or len(view) != nbytes:
                raise PeerFailed(f"answer for key {e.key.hex()[:16]}: status {status}, "
                                 f"{nbytes} bytes where the index says {e.nbytes}")
            view[:] = await reader.readexactly(nbytes)
            if crc != e.crc32c or crc32c(view) != crc:
                self._counters["pod_fetch_bad"] += 1
                throttled(log, logging.WARNING, "pod.peer_crc",
                          "peer block %s: CRC32C %08x (sent) / %08x (received) where the "
                          "index says %08x; a miss", e.key.hex()[:16], crc,
                          crc32c(view) if crc == e.crc32c else 0, e.crc32c)
                out.append(False)
                continue
            out.append(self._verified(conn, ns_digest, e, view, seq, tag, check_crc=False))
        return out

    async def close(self) -> None:
        self._closed = True
        for busy in list(self._busy):
            busy.kill()  # their fetches end now (misses); each closes its connection
        for pool in self._pool.values():
            for idle in pool:
                idle.close()
        self._pool.clear()
        self._workers.shutdown(wait=False)
        for conns in self._idle.values():
            for conn in conns:
                if conn.link is not None:
                    conn.link.close()
                conn.writer.close()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(conn.writer.wait_closed(), 1.0)
        self._idle.clear()
