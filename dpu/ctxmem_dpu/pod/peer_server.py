"""The peer-fetch server: serves this node's blocks to authenticated pod members.

Only pod members reach it: every connection starts with a challenge-response handshake
under the pod's peer key (derived from the master key, :mod:`ctxmem_common.podkeys`; the
server sends nothing but its challenge until the client proved itself) and, off loopback, mutual TLS
with the pod CA; tenants' session tokens are not accepted here. A request names a
namespace digest (which covers the tenant) and proves that the requester holds that
namespace's key, so a block is only ever served to the same namespace on the other node,
and a member certificate or the pod token alone reads nothing. Every served block carries
the namespace's authenticator over the holder's own DRAM bytes, bound to the connection
and the block's sequence number. Every wait is bounded (hello, request read, send), and
connections are capped: those whose handshake is not proven yet apart
(``pod.max_unauthenticated``, per peer IP, the oldest closed to admit a new one,
:mod:`ctxmem_dpu.listenguard`), within ``pod.hello_timeout_s`` of accept, and the
authenticated ones at :data:`MAX_CONNECTIONS`.

With an RDMA device (``pod.rdma_listen``), a connection may attach a queue pair; its
requests are then answered with READ keys to the pinned blocks instead of their bytes,
and the blocks stay pinned (and the keys valid) until the fetcher says done or
``pod.fetch_timeout_s`` passes (:mod:`ctxmem_dpu.pod.peer_rdma`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import secrets
import select
import socket
import time
from collections import Counter
from collections.abc import Callable

from ctxmem_common import peer_wire as w
from ctxmem_common.codecs.blockauth import BlockAuthenticator
from ctxmem_common.config import PodConfig
from ctxmem_common.errors import ConfigError, CtxmemError
from ctxmem_common.identity import is_local_listen
from ctxmem_common.netaddr import split_hostport
from ctxmem_common.podkeys import PodKeys
from ctxmem_dpu.blocks import Block
from ctxmem_dpu.listenguard import FdReserve, Unauthenticated
from ctxmem_dpu.logthrottle import throttled
from ctxmem_dpu.pod.peer_rdma import grant_blocks, holder_endpoint
from ctxmem_dpu.store import BlockStore
from ctxmem_dpu.transport.rdma_device import RdmaDevice
from ctxmem_dpu.transport.rdma_endpoint import SessionEndpoint

log = logging.getLogger(__name__)
MAX_CONNECTIONS = 256  # authenticated peer connections open at once
#: Threads that send plaintext answers (all connections together): each answer's blocks
#: are authenticated and sent from their pinned slots there, off the event loop.
SEND_THREADS = 8
#: The send buffer asked for on a connection that answers over plaintext (the kernel caps
#: it at net.core.wmem_max and doubles it).
SEND_BUFFER = 4 << 20


class PeerServer:
    """``async with PeerServer(...)`` or :meth:`start` / :meth:`close`."""

    def __init__(self, pod: PodConfig, store: BlockStore, counters: Counter[str],
                 keys: PodKeys, io_timeout_s: float = 10.0,
                 rdma: RdmaDevice | None = None) -> None:
        if not pod.tls_cert_file and not is_local_listen(pod.listen):
            raise ConfigError(
                f"pod.listen: {pod.listen!r} is not loopback and pod TLS is off; set "
                f"pod.tls_cert_file, tls_key_file and tls_ca_file (mutual TLS between pod "
                f"members), or listen on 127.0.0.1")
        self._pod = pod
        self._keys = keys
        self._ssl = w.server_context(pod)
        self._store = store
        self._counters = counters
        self._timeout = io_timeout_s
        self._rdma = rdma  # serve over RDMA to peers that attach (docs/pod.md)
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._senders = concurrent.futures.ThreadPoolExecutor(
            SEND_THREADS, thread_name_prefix="ctxmem-peer-send")
        self._authenticated = 0
        self._unauth = Unauthenticated("peer-fetch", pod.max_unauthenticated,
                                       pod.max_unauthenticated_per_source,
                                       FdReserve(store.cfg.service.fd_reserve))
        self.address = ""

    async def start(self) -> None:
        host, port = split_hostport(self._pod.listen, "pod.listen")
        self._server = await asyncio.start_server(
            self._serve, host, port, ssl=self._ssl, limit=w.STREAM_LIMIT,
            ssl_handshake_timeout=self._pod.hello_timeout_s if self._ssl is not None
            else None)
        sock = self._server.sockets[0].getsockname()
        self.address = f"{sock[0]}:{sock[1]}"

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for t in list(self._conns):
            t.cancel()
        for t in list(self._conns):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self._server.wait_closed()
        self._server = None
        self._senders.shutdown(wait=False)

    async def __aenter__(self) -> PeerServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, tuple) and peer else "local"
        evicted = authed = False

        def evict() -> None:
            nonlocal evicted
            evicted = True
            task.cancel()

        ticket = self._unauth.admit(source, evict)
        if ticket is None:  # fds below service.fd_reserve: closed before any read
            writer.close()
            return

        def proven() -> bool:
            """The hello checked out: out of the unauthenticated count, into the cap of
            authenticated connections (False: that cap is full, close)."""
            nonlocal authed
            ticket.done()
            if self._authenticated >= MAX_CONNECTIONS:
                throttled(log, logging.WARNING, "pod.peer_cap",
                          "peer-fetch connection from %s refused: %d authenticated peer "
                          "connections open", peer, self._authenticated)
                return False
            self._authenticated += 1
            authed = True
            return True

        self._conns.add(task)
        try:
            await self._session(reader, writer, peer, proven)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError,
                asyncio.TimeoutError, OSError) as exc:
            throttled(log, logging.WARNING, "pod.peer_conn",
                      "peer-fetch connection from %s ended: %s", peer, type(exc).__name__)
        except asyncio.CancelledError:
            # Returned, not raised: asyncio's stream server (Python 3.11) asks a connection
            # task for its exception when it ends, and a cancelled one logs a
            # CancelledError traceback. Cancelled either as the oldest unauthenticated
            # connection over a cap (logged there) or by close() (the node is stopping).
            if not evicted:
                log.debug("peer-fetch connection from %s closed: this node is stopping", peer)
        finally:
            if authed:
                self._authenticated -= 1
            ticket.done()
            self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       peer: object, proven: Callable[[], bool]) -> None:
        t = self._timeout
        try:
            # One deadline from accept for the whole handshake, however it trickles in.
            tr = await asyncio.wait_for(
                w.accept(reader, writer, self._keys.peer_key, self._pod.node_id, t),
                self._pod.hello_timeout_s)
        except w.HandshakeFailed as exc:
            self._counters["pod_peer_refused"] += 1
            throttled(log, logging.WARNING, "pod.peer_hello",
                      "peer-fetch handshake from %s refused: %s", peer, exc)
            return
        if not proven():
            return
        ep: SessionEndpoint | None = None
        try:
            while True:
                magic = await asyncio.wait_for(reader.readexactly(4),
                                               self._pod.fetch_timeout_s * 12)
                if magic == w.ATTACH_MAGIC and ep is None:
                    qp = await asyncio.wait_for(reader.readexactly(w.QP.size), t)
                    ep = self._attach(writer, qp, peer)
                    continue
                rest = await asyncio.wait_for(reader.readexactly(w.REQUEST.size - 4), t)
                _magic, ns_digest, proof, count = w.REQUEST.unpack(magic + rest)
                rdma = magic == w.RDMA_REQUEST_MAGIC and ep is not None
                if not (rdma or magic == w.REQUEST_MAGIC) or count > w.MAX_KEYS:
                    throttled(log, logging.WARNING, "pod.peer_request",
                              "peer-fetch request from %s refused: bad magic %r or %d keys "
                              "(max %d)", peer, magic, count, w.MAX_KEYS)
                    return
                nk = self._keys.namespace(ns_digest)
                if not w.check(tr.ns_proof(nk.request_key, ns_digest), proof):
                    self._counters["pod_peer_refused"] += 1
                    throttled(log, logging.WARNING, "pod.peer_ns_proof",
                              "peer-fetch request from %s (node %r) for namespace %s "
                              "refused: no proof that it holds the namespace's key; "
                              "connection closed", peer, tr.client_id, ns_digest.hex())
                    return
                keys = []
                for _ in range(count):
                    klen = (await asyncio.wait_for(reader.readexactly(1), t))[0]
                    keys.append(await asyncio.wait_for(reader.readexactly(klen), t))
                if not rdma:
                    await self._answer(writer, tr, nk.auth, ns_digest, keys)
                elif ep is not None and not await self._answer_rdma(
                        reader, writer, ep, tr, nk.auth, ns_digest, keys, peer):
                    return
        finally:
            if ep is not None:
                ep.close()

    def _attach(self, writer: asyncio.StreamWriter, qp: bytes, peer: object
                ) -> SessionEndpoint | None:
        """This end of the connection's RDMA queue pair, connected to the fetcher's ``qp``;
        ``None`` (answered 0: the fetcher uses TCP here) without a device or on failure."""
        if self._rdma is None:
            writer.write(b"\x00")
            return None
        try:
            ep = holder_endpoint(self._rdma, w.unpack_qp(qp, "peer-fetch attach"))
        except CtxmemError as exc:
            self._counters["pod_rdma_setup_errors"] += 1
            throttled(log, logging.WARNING, "pod.peer_rdma_attach",
                      "peer-fetch RDMA attach from %s failed (%s); that peer fetches over "
                      "TCP", peer, exc.message)
            writer.write(b"\x00")
            return None
        writer.write(b"\x01" + w.pack_qp(ep.info()))
        return ep

    async def _answer_rdma(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           ep: SessionEndpoint, tr: w.Transcript, auth: BlockAuthenticator,
                           ns_digest: bytes, keys: list[bytes], peer: object) -> bool:
        """Pin the blocks, grant READ keys for them, answer, and hold both until the
        fetcher's done (or ``pod.fetch_timeout_s``: then the connection is closed).
        A grant the device refuses answers status 2 (ask over TCP). Returns whether the
        connection goes on."""
        store = self._store
        blocks = await store.pin_for_peer(ns_digest, keys)
        grant_id = secrets.token_bytes(16)
        try:
            hits = [b for b in blocks if b is not None and b.dram is not None]
            granted: list[tuple[int, int]] | None = None
            if hits:
                try:
                    granted = await grant_blocks(ep, store.dram, grant_id, hits)
                except CtxmemError as exc:
                    self._counters["pod_rdma_setup_errors"] += 1
                    throttled(log, logging.WARNING, "pod.peer_rdma_grant",
                              "peer-fetch RDMA grant of %d blocks for %s failed (%s); "
                              "answered: ask over TCP", len(hits), peer, exc.message)
            keyed = iter(granted or ())
            parts = []
            for b in blocks:
                if b is None or b.dram is None:
                    parts.append(w.RDMA_ANSWER.pack(0, 0, 0, 0, 0, 0, w.NO_TAG))
                elif granted is None:
                    parts.append(w.RDMA_ANSWER.pack(2, 0, 0, 0, 0, 0, w.NO_TAG))
                else:
                    addr, rkey = next(keyed)
                    # Over the pinned slot's bytes: the READ brings exactly these.
                    tag = auth.tag(b.key, store.dram.view(b.dram, b.length),
                                   tr.answer_context(b.seq))
                    parts.append(w.RDMA_ANSWER.pack(1, b.crc, b.length, b.seq, addr, rkey,
                                                    tag))
            writer.write(b"".join(parts))
            await asyncio.wait_for(writer.drain(), self._timeout)
            if granted is None:
                return True
            done = await asyncio.wait_for(reader.readexactly(len(w.DONE)),
                                          self._pod.fetch_timeout_s)
            if done != w.DONE:
                throttled(log, logging.WARNING, "pod.peer_request",
                          "peer-fetch RDMA lease from %s ended by %r, not done; closing",
                          peer, done)
                return False
            nbytes = sum(b.length for b in hits)
            for name in ("pod_served", "pod_served_rdma"):
                self._counters[f"{name}_blocks"] += len(hits)
                self._counters[f"{name}_bytes"] += nbytes
            return True
        finally:
            ep.revoke(grant_id)  # the keys die before the slots can be reused
            for b in blocks:
                if b is not None:
                    store.unpin(b)

    async def _answer_off_loop(self, writer: asyncio.StreamWriter, fd: int,
                               tr: w.Transcript, auth: BlockAuthenticator,
                               blocks: list[Block | None]) -> None:
        """A plaintext answer sent by a sender thread (:func:`_send_answer`): the
        authenticator (GMAC) and ``sendmsg`` of each block straight from its pinned slot,
        so the loop serves other connections meanwhile and the answers of several
        connections go out on several cores. The thread writes on a duplicate of the
        connection's descriptor (its number cannot be reused under it, whatever the
        transport does); the transport holds nothing of ours then (drained first) and
        writes nothing while this awaits. If this task is cancelled, the socket is shut
        down and the thread waited for before the caller unpins the slots."""
        await asyncio.wait_for(writer.drain(), self._timeout)
        sock = socket.socket(fileno=os.dup(fd))
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < SEND_BUFFER:
            # Room for a whole block: one sendmsg per block, not one per few hundred KiB
            # (each partial send costs a poll and a GIL hand-off on a busy node).
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        views = [self._store.dram.view(b.dram, b.length)
                 if b is not None and b.dram is not None else None for b in blocks]
        fut = asyncio.get_running_loop().run_in_executor(
            self._senders, _send_answer, sock, tr, auth, blocks, views, self._timeout)
        try:
            try:
                await asyncio.shield(fut)
            except BaseException:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # the thread's send ends at once
                while not fut.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait({fut})
                writer.transport.abort()  # half an answer sent: the connection is done
                raise
        finally:
            sock.close()
            for v in views:
                if v is not None:
                    v.release()
        for b, v in zip(blocks, views, strict=True):
            if b is not None and v is not None:
                self._counters["pod_served_blocks"] += 1
                self._counters["pod_served_bytes"] += b.length

    async def _answer(self, writer: asyncio.StreamWriter, tr: w.Transcript,
                      auth: BlockAuthenticator, ns_digest: bytes, keys: list[bytes]) -> None:
        store = self._store
        blocks = await store.pin_for_peer(ns_digest, keys)
        tls = writer.get_extra_info("ssl_object") is not None
        sock = writer.get_extra_info("socket")
        if not tls and sock is not None:
            # Plaintext: sent by a sender thread straight from the pinned slots (below).
            try:
                await self._answer_off_loop(writer, sock.fileno(), tr, auth, blocks)
            finally:
                for b in blocks:
                    if b is not None:
                        store.unpin(b)
            return
        # TLS encrypts into buffers of its own anyway (a copy), and asyncio's TLS
        # transport does not wake a drain at a write-buffer limit of 0 (measured: a 2 MiB
        # answer stalled until the timeout): there each block is copied and written on
        # the loop.
        try:
            for b in blocks:
                if b is None or b.dram is None:
                    writer.write(w.ANSWER.pack(0, 0, 0, 0, w.NO_TAG))
                    continue
                # The authenticator over the pinned slot's bytes (GMAC in C; a committed
                # block's bytes do not change while it is pinned), never cached.
                data = bytes(store.dram.view(b.dram, b.length))
                tag = auth.tag(b.key, data, tr.answer_context(b.seq))
                writer.write(w.ANSWER.pack(1, b.crc, b.length, b.seq, tag))
                writer.write(data)
                self._counters["pod_served_blocks"] += 1
                self._counters["pod_served_bytes"] += b.length
                # Backpressure per block: a slow reader holds the pins at most this long.
                await asyncio.wait_for(writer.drain(), self._timeout)
            await asyncio.wait_for(writer.drain(), self._timeout)
        except BaseException:
            # Not flushed (a slow reader, a cancel): what the transport still holds is
            # dropped with the connection before the slots are unpinned, so no byte of a
            # slot reused later can go out.
            writer.transport.abort()
            raise
        finally:
            for b in blocks:
                if b is not None:
                    store.unpin(b)


def _send_answer(sock: socket.socket, tr: w.Transcript, auth: BlockAuthenticator,
                 blocks: list[Block | None], views: list[memoryview | None],
                 timeout_s: float) -> None:
    """On a sender thread: each block's answer header (with its authenticator over the
    pinned slot's bytes) and the bytes themselves, by ``sendmsg`` from the slot (no copy
    of ours), on ``sock`` (non-blocking: the loop's; a poll waits for room). Each block
    within ``timeout_s`` (a slow reader holds the pins at most that long per block)."""
    for b, view in zip(blocks, views, strict=True):
        if b is None or view is None:
            _send_all(sock, [w.ANSWER.pack(0, 0, 0, 0, w.NO_TAG)], timeout_s)
            continue
        tag = auth.tag(b.key, view, tr.answer_context(b.seq))
        _send_all(sock, [w.ANSWER.pack(1, b.crc, b.length, b.seq, tag), view], timeout_s)


def _send_all(sock: socket.socket, parts: list[bytes | memoryview], timeout_s: float) -> None:
    """``sendmsg`` of ``parts`` until all went to the kernel (a poll for room between
    partial sends), within ``timeout_s``; raises ``TimeoutError`` past it and
    ``ConnectionError`` when the peer went away or the socket was shut down."""
    bufs = [memoryview(p) for p in parts]
    end = time.monotonic() + timeout_s
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    while bufs:
        try:
            n = sock.sendmsg(bufs)
        except (BlockingIOError, InterruptedError):
            n = 0
        while n and bufs:
            if n >= len(bufs[0]):
                n -= len(bufs[0])
                bufs.pop(0)
            else:
                bufs[0] = bufs[0][n:]
                n = 0
        if not bufs:
            return
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"peer-fetch answer: the reader took no bytes for "
                               f"{timeout_s:g} s")
        for _fd, ev in poller.poll(min(left, 1.0) * 1000):
            if ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                raise ConnectionError(f"peer-fetch answer: the connection ended (poll "
                                      f"events {ev:#x}) with {sum(map(len, bufs))} bytes "
                                      f"of a block unsent")
