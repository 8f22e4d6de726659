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

With an RDMA device (``pod.rdma_listen``), each new connection offers the holder a queue
pair; where the holder attaches it, requests on that connection are answered with READ
keys and the blocks are read by RDMA (:mod:`ctxmem_dpu.pod.peer_rdma`), else the same
connection carries them over TCP. A failed RDMA setup or transfer is logged, counted
(``pod_rdma_setup_errors``, ``pod_peer_rdma_fallbacks``) and turns that peer to TCP for
:data:`RDMA_RETRY_S`; the blocks of a failed transfer are misses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from crc32c import crc32c

from ctxmem_common import peer_wire as w
from ctxmem_common.config import PodConfig
from ctxmem_common.errors import CtxmemError
from ctxmem_common.netaddr import split_hostport
from ctxmem_common.podkeys import PodKeys
from ctxmem_dpu.logthrottle import throttled
from ctxmem_dpu.pod.entries import RemoteEntry
from ctxmem_dpu.pod.peer_rdma import FetchLink, RdmaTransferError
from ctxmem_dpu.pod.sources import RemoteSource
from ctxmem_dpu.transport.rdma_device import RdmaDevice

log = logging.getLogger(__name__)

# A peer that failed RDMA (setup or a transfer) is fetched from over TCP this long.
RDMA_RETRY_S = 30.0


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


class PeerFailed(Exception):
    """A peer answered something that is not the protocol (what, in the message)."""


class PeerSource(RemoteSource):
    """Blocks from the node that holds them, over TCP (TLS 1.3 with the pod CA when
    configured). ``address_of(node_id)`` gives a live peer's advertised address, or
    ``None`` for a node not alive. Every block it returns verified under ``keys``."""

    name = "peer"
    verifies = True

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

    def accepts(self, entry: RemoteEntry) -> bool:
        return self._address_of(entry.node_id) is not None

    async def fetch(self, ns_digest: bytes, entries: Sequence[RemoteEntry]
                    ) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(entries)
        by_node: dict[str, list[int]] = {}
        for i, e in enumerate(entries):
            by_node.setdefault(e.node_id, []).append(i)
        jobs = [self._from_node(ns_digest, node, [entries[i] for i in idx])
                for node, idx in by_node.items()]
        for idx, got in zip(by_node.values(), await asyncio.gather(*jobs), strict=True):
            for i, data in zip(idx, got, strict=True):
                out[i] = data
        return out

    async def _from_node(self, ns_digest: bytes, node: str, entries: list[RemoteEntry]
                         ) -> list[bytes | None]:
        addr = self._address_of(node)
        if addr is None or self._closed:
            return [None] * len(entries)
        got: list[bytes | None] = []
        conn: Conn | None = None

        async def run() -> None:
            nonlocal conn
            conn = await self._connection(addr, node)
            for part in range(0, len(entries), w.MAX_KEYS):
                chunk = entries[part:part + w.MAX_KEYS]
                got.extend(await (self._request_rdma(conn, ns_digest, chunk)
                                  if conn.link is not None else
                                  self._request(conn, ns_digest, chunk)))

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
            return got + [None] * (len(entries) - len(got))

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

    def _verified(self, conn: Conn, ns_digest: bytes, e: RemoteEntry, data: bytes,
                  seq: int, tag: bytes) -> bytes | None:
        """``data`` when its authenticator verifies under this node's key, else a miss
        (counted, logged)."""
        assert conn.transcript is not None
        auth = self._keys.namespace(ns_digest).auth
        if auth.verify(e.key, data, tag, conn.transcript.answer_context(seq)):
            return data
        self._counters["pod_fetch_unauthenticated"] += 1
        throttled(log, logging.WARNING, "pod.peer_unauthenticated",
                  "peer block %s of namespace %s from node %s: its authenticator does not "
                  "verify under this node's key (a peer without the pod's master key, or "
                  "bytes changed on the way); a miss, nothing adopted", e.key.hex()[:16],
                  ns_digest.hex(), e.node_id)
        return None

    async def _request_rdma(self, conn: Conn, ns_digest: bytes,
                            entries: Sequence[RemoteEntry]) -> list[bytes | None]:
        """One request answered with READ keys: the hits whose answer matches the index
        entry are read by RDMA and their authenticators verified, then the lease is ended
        (done); a holder that could not grant them (status 2) is asked again over TCP on
        the same connection."""
        assert conn.link is not None
        conn.writer.write(self._request_bytes(conn, ns_digest, entries, w.RDMA_REQUEST_MAGIC))
        raw = await conn.reader.readexactly(w.RDMA_ANSWER.size * len(entries))
        out: list[bytes | None] = [None] * len(entries)
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
            elif status != 1 or nbytes != e.nbytes or crc != e.crc32c:
                self._counters["pod_peer_misses"] += 1  # stale: another version there
            else:
                want.append(i)
                items.append((addr, rkey, nbytes))
                tags.append((seq, tag))
        if items:
            data = await self._read_watched(conn, items)
            for i, d, (seq, tag) in zip(want, data, tags, strict=True):
                out[i] = self._verified(conn, ns_digest, entries[i], d, seq, tag)
            self._counters["pod_peer_rdma_blocks"] += len(items)
            self._counters["pod_peer_rdma_bytes"] += sum(n for _a, _k, n in items)
        if granted:
            conn.writer.write(w.DONE)
        if again:
            self._counters["pod_peer_rdma_fallbacks"] += 1
            got = await self._request(conn, ns_digest, [entries[i] for i in again])
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

    async def _request(self, conn: Conn, ns_digest: bytes, entries: Sequence[RemoteEntry]
                       ) -> list[bytes | None]:
        reader, writer = conn.reader, conn.writer
        writer.write(self._request_bytes(conn, ns_digest, entries, w.REQUEST_MAGIC))
        out: list[bytes | None] = []
        for e in entries:
            status, crc, nbytes, seq, tag = w.ANSWER.unpack(
                await reader.readexactly(w.ANSWER.size))
            if status == 0:
                self._counters["pod_peer_misses"] += 1
                out.append(None)
                continue
            if status != 1 or nbytes != e.nbytes:
                raise PeerFailed(f"answer for key {e.key.hex()[:16]}: status {status}, "
                                 f"{nbytes} bytes where the index says {e.nbytes}")
            data = await reader.readexactly(nbytes)
            if crc != e.crc32c or crc32c(data) != crc:
                self._counters["pod_fetch_bad"] += 1
                throttled(log, logging.WARNING, "pod.peer_crc",
                          "peer block %s: CRC32C %08x (sent) / %08x (received) where the "
                          "index says %08x; a miss", e.key.hex()[:16], crc, crc32c(data),
                          e.crc32c)
                out.append(None)
                continue
            out.append(self._verified(conn, ns_digest, e, data, seq, tag))
        return out

    async def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                if conn.link is not None:
                    conn.link.close()
                conn.writer.close()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(conn.writer.wait_closed(), 1.0)
        self._idle.clear()
