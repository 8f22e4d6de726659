"""Peer fetch, the client side: :class:`PeerSource` asks the holder node's peer-fetch
server for blocks and checks every answer.

A peer is trusted for nothing: an answer is used only when its length equals the index
entry's, its CRC32C equals the entry's, and the CRC32C of the bytes received (computed in
C) equals both. Anything else, and a peer that is dead, slow past ``pod.fetch_timeout_s``
or unreachable, is a miss. Connections are kept per peer and reused; one that fails or
times out is closed, never reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence

from crc32c import crc32c

from ctxmem_common.config import PodConfig
from ctxmem_common.netaddr import split_hostport
from ctxmem_dpu.logthrottle import throttled
from ctxmem_dpu.pod import peer_wire as w
from ctxmem_dpu.pod.entries import RemoteEntry
from ctxmem_dpu.pod.sources import RemoteSource

log = logging.getLogger(__name__)

Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class PeerFailed(Exception):
    """A peer answered something that is not the protocol (what, in the message)."""


class PeerSource(RemoteSource):
    """Blocks from the node that holds them, over TCP (TLS 1.3 with the pod CA when
    configured). ``address_of(node_id)`` gives a live peer's advertised address, or
    ``None`` for a node not alive."""

    name = "peer"

    def __init__(self, pod: PodConfig, address_of: Callable[[str], str | None],
                 counters: Counter[str]) -> None:
        self._pod = pod
        self._address_of = address_of
        self._counters = counters
        self._token = w.pod_token(pod)
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
            conn = await self._connection(addr)
            for part in range(0, len(entries), w.MAX_KEYS):
                got.extend(await self._request(conn, ns_digest,
                                               entries[part:part + w.MAX_KEYS]))

        try:
            await asyncio.wait_for(run(), self._pod.fetch_timeout_s)
            assert conn is not None
            self._idle.setdefault(addr, []).append(conn)
            return got
        except (OSError, TimeoutError, asyncio.TimeoutError, asyncio.IncompleteReadError,
                PeerFailed) as exc:
            self._counters["pod_peer_errors"] += 1
            throttled(log, logging.WARNING, "pod.peer_fetch",
                      "peer fetch of %d blocks from node %s at %s failed (%s: %s); they "
                      "are misses", len(entries), node, addr, type(exc).__name__, exc)
            if conn is not None:
                conn[1].transport.abort()
            return got + [None] * (len(entries) - len(got))

    async def _connection(self, addr: str) -> Conn:
        idle = self._idle.get(addr)
        while idle:
            reader, writer = idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return reader, writer
            writer.transport.abort()
        host, port = split_hostport(addr, "peer address")
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=self._ssl, limit=w.STREAM_LIMIT,
                                    ssl_handshake_timeout=self._pod.connect_timeout_s
                                    if self._ssl else None),
            self._pod.connect_timeout_s)
        writer.write(w.HELLO.pack(w.HELLO_MAGIC, w.VERSION, len(self._token)) + self._token)
        ok = await reader.readexactly(1)
        if ok != b"\x01":
            writer.transport.abort()
            raise PeerFailed(f"peer {addr} refused the pod token")
        return reader, writer

    async def _request(self, conn: Conn, ns_digest: bytes, entries: Sequence[RemoteEntry]
                       ) -> list[bytes | None]:
        reader, writer = conn
        writer.write(w.pack_keys(ns_digest, [e.key for e in entries]))
        out: list[bytes | None] = []
        for e in entries:
            status, crc, nbytes, _seq = w.ANSWER.unpack(await reader.readexactly(w.ANSWER.size))
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
            out.append(data)
        return out

    async def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for _r, writer in conns:
                writer.close()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(writer.wait_closed(), 1.0)
        self._idle.clear()
