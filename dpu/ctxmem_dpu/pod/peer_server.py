"""The peer-fetch server: serves this node's blocks to authenticated pod members.

Only pod members reach it: every connection starts with the pod token (constant-time
compare) and, off loopback, mutual TLS with the pod CA; tenants' session tokens are not
accepted here. A request names a namespace digest (which covers the tenant), so a block
is only ever served to the same namespace on the other node. Every wait is bounded
(hello, request read, send), and connections are capped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter

from ctxmem_common.config import PodConfig
from ctxmem_common.errors import ConfigError
from ctxmem_common.identity import is_local_listen
from ctxmem_common.netaddr import split_hostport
from ctxmem_dpu.logthrottle import throttled
from ctxmem_dpu.pod import peer_wire as w
from ctxmem_dpu.store import BlockStore

log = logging.getLogger(__name__)
MAX_CONNECTIONS = 256


class PeerServer:
    """``async with PeerServer(...)`` or :meth:`start` / :meth:`close`."""

    def __init__(self, pod: PodConfig, store: BlockStore, counters: Counter[str],
                 io_timeout_s: float = 10.0) -> None:
        if not pod.tls_cert_file and not is_local_listen(pod.listen):
            raise ConfigError(
                f"pod.listen: {pod.listen!r} is not loopback and pod TLS is off; set "
                f"pod.tls_cert_file, tls_key_file and tls_ca_file (mutual TLS between pod "
                f"members), or listen on 127.0.0.1")
        self._pod = pod
        self._token = w.pod_token(pod)
        self._ssl = w.server_context(pod)
        self._store = store
        self._counters = counters
        self._timeout = io_timeout_s
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self.address = ""

    async def start(self) -> None:
        host, port = split_hostport(self._pod.listen, "pod.listen")
        self._server = await asyncio.start_server(
            self._serve, host, port, ssl=self._ssl, limit=w.STREAM_LIMIT,
            ssl_handshake_timeout=self._timeout if self._ssl is not None else None)
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

    async def __aenter__(self) -> PeerServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._conns) >= MAX_CONNECTIONS:
            writer.close()
            return
        self._conns.add(task)
        peer = writer.get_extra_info("peername")
        try:
            await self._session(reader, writer, peer)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError,
                asyncio.TimeoutError, OSError) as exc:
            throttled(log, logging.WARNING, "pod.peer_conn",
                      "peer-fetch connection from %s ended: %s", peer, type(exc).__name__)
        finally:
            self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       peer: object) -> None:
        t = self._timeout
        magic, version, n = w.HELLO.unpack(
            await asyncio.wait_for(reader.readexactly(w.HELLO.size), t))
        token = await asyncio.wait_for(reader.readexactly(n), t)
        if magic != w.HELLO_MAGIC or version != w.VERSION or not w.token_ok(token, self._token):
            self._counters["pod_peer_refused"] += 1
            throttled(log, logging.WARNING, "pod.peer_hello",
                      "peer-fetch hello from %s refused: bad magic, version or pod token",
                      peer)
            return
        writer.write(b"\x01")
        while True:
            head = await asyncio.wait_for(reader.readexactly(w.REQUEST.size),
                                          self._pod.fetch_timeout_s * 12)
            magic, ns_digest, count = w.REQUEST.unpack(head)
            if magic != w.REQUEST_MAGIC or count > w.MAX_KEYS:
                throttled(log, logging.WARNING, "pod.peer_request",
                          "peer-fetch request from %s refused: bad magic or %d keys (max %d)",
                          peer, count, w.MAX_KEYS)
                return
            keys = []
            for _ in range(count):
                klen = (await asyncio.wait_for(reader.readexactly(1), t))[0]
                keys.append(await asyncio.wait_for(reader.readexactly(klen), t))
            await self._answer(writer, ns_digest, keys)

    async def _answer(self, writer: asyncio.StreamWriter, ns_digest: bytes,
                      keys: list[bytes]) -> None:
        store = self._store
        blocks = await store.pin_for_peer(ns_digest, keys)
        try:
            for b in blocks:
                if b is None or b.dram is None:
                    writer.write(w.ANSWER.pack(0, 0, 0, 0))
                    continue
                writer.write(w.ANSWER.pack(1, b.crc, b.length, b.seq))
                # A copy (C memcpy): the transport may keep what it could not send yet,
                # and the slot is unpinned once this answer is written.
                writer.write(bytes(store.dram.view(b.dram, b.length)))
                self._counters["pod_served_blocks"] += 1
                self._counters["pod_served_bytes"] += b.length
                # Backpressure per block: a slow reader holds the pins at most this long.
                await asyncio.wait_for(writer.drain(), self._timeout)
            await asyncio.wait_for(writer.drain(), self._timeout)
        finally:
            for b in blocks:
                if b is not None:
                    store.unpin(b)
