"""Issue 14 item 2, peer fetch over RDMA: the negotiation and every fallback to TCP, on a
host without an RDMA device (pyverbs may import, but there is nothing to open).

* real service processes configured with ``pod.rdma_listen`` on a host without RDMA: the
  device cannot be opened (counted once, logged), a cross-node get is byte-exact over
  TCP; the holder answers an RDMA attach with "no RDMA here", and a request for RDMA
  keys on a connection without a queue pair is refused with nothing served;
* the fetcher's side (:class:`PeerSource`) against a scripted holder that speaks the RDMA
  exchange, with the verbs link replaced by a stand-in: hits are read by RDMA and the
  lease is ended (done); a stale answer (another CRC) is a miss and is never read; a
  holder that cannot grant (status 2) is asked over TCP on the same connection; a failed
  transfer is misses and the peer is fetched from over TCP afterwards; a holder without
  RDMA, or a queue pair that cannot be connected, gets TCP on the same connection.

The verbs path itself (Soft-RoCE, READ, a holder killed mid-fetch) runs in the QEMU
guest: tests/vm/test_pod_rdma_vm.py.
"""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from crc32c import crc32c

import ctxmem
from ctxmem_common import peer_wire as w
from ctxmem_common import rdma_wire as rw
from ctxmem_common.config import PodConfig
from ctxmem_common.config_pod import check_pod
from ctxmem_common.errors import ConfigError, InvalidArgument
from ctxmem_common.podkeys import PodKeys
from ctxmem_dpu.pod import peer_client
from ctxmem_dpu.pod.entries import RemoteEntry
from ctxmem_dpu.pod.peer_rdma import RdmaTransferError
from ctxmem_tools.pod_launcher import LocalPod
from tests.kit import until_async
from tests.pod.peerkit import handshake, pod_keys
from tests.pod.podtest import Clients, blocks, wait_for

TOKEN = "t" * 32
KEYS = PodKeys(bytes(range(32)), TOKEN.encode())
GID = rw.gid_from_str("0000:0000:0000:0000:0000:ffff:0a00:020f")
QP = rw.QpInfo(0x1234, 0x777, GID, 0, 3, 16)


# -- wire and config ------------------------------------------------------------------


def test_qp_round_trips_and_a_bad_one_is_refused() -> None:
    assert w.unpack_qp(w.pack_qp(QP), "here") == QP
    raw = bytearray(w.pack_qp(QP))
    raw[-2] = 9  # mtu enum 9: no such MTU
    with pytest.raises(InvalidArgument, match="mtu 9"):
        w.unpack_qp(bytes(raw), "here")


def test_rdma_listen_must_be_an_ip() -> None:
    check_pod(PodConfig(rdma_listen="10.0.2.15"))
    with pytest.raises(ConfigError, match=r"pod\.rdma_listen"):
        check_pod(PodConfig(rdma_listen="10.0.2.15:4791"))


# -- real services, no RDMA device on this host -----------------------------------------


def _hello(addr: str, keys: PodKeys, node: str) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    handshake(s, keys.peer_key, "tester", node)
    return s


def test_rdma_configured_without_a_device_fetches_over_tcp(tmp_path: Path,
                                                           clients: Clients) -> None:
    with LocalPod(tmp_path / "pod", 2, pod={"rdma_listen": "127.0.0.1"}) as pod:
        n1, n2 = pod.nodes
        keys = ctxmem.chain_hashes(range(16 * 6), 16)
        data = blocks(6, 21)
        assert clients.put(n1.endpoint, keys, data) == 6
        wait_for(lambda: clients.hits(n2.endpoint, keys) == 6, what="publish")
        assert clients.get(n2.endpoint, keys, data) == 6  # byte-checked
        st2, st1 = clients.stats(n2.endpoint), clients.stats(n1.endpoint)
        assert st2["pod_fetch_blocks_peer"] == 6 and st2["pod_peer_rdma_blocks"] == 0
        assert st2["pod_rdma_setup_errors"] == 1 and st2["pod_peer_errors"] == 0
        assert st1["pod_served_blocks"] == 6 and st1["pod_served_rdma_blocks"] == 0
        # The holder, asked for a queue pair, says it has no RDMA ...
        s = _hello(n1.config["pod"]["listen"], pod_keys(pod), "node1")
        try:
            s.sendall(w.ATTACH_MAGIC + w.pack_qp(QP))
            assert s.recv(1) == b"\x00"
            # ... and serves no RDMA keys on a connection without one: refused, closed.
            s.sendall(w.pack_keys(b"\x00" * 16, keys[:1], w.RDMA_REQUEST_MAGIC))
            assert s.recv(64) == b""
        finally:
            s.close()
        assert clients.stats(n1.endpoint)["pod_served_rdma_blocks"] == 0


# -- the fetcher against a scripted holder ------------------------------------------------


class FakeLink:
    """Stands in for :class:`FetchLink`: "reads" from :attr:`memory` (address -> bytes)."""

    memory: dict[int, bytes] = {}
    fail = False
    made: list[FakeLink] = []

    def __init__(self, dev: object) -> None:
        self.peer: rw.QpInfo | None = None
        self.closed = False
        FakeLink.made.append(self)

    def info(self) -> rw.QpInfo:
        return QP

    def connect(self, peer: rw.QpInfo) -> None:
        self.peer = peer

    async def read(self, items: Sequence[tuple[int, int, int]], timeout_s: float
                   ) -> list[bytes]:
        if FakeLink.fail:
            self.close()
            raise RdmaTransferError("RDMA READ from the holder failed: IBV_WC_RETRY_EXC_ERR")
        return [FakeLink.memory[a][:n] for a, _k, n in items]

    def close(self) -> None:
        self.closed = True


class Holder:
    """A pod member speaking the peer protocol: ``rdma`` (attach answered with a QP or
    not) and ``grant`` (RDMA requests answered with keys, or status 2)."""

    def __init__(self, data: dict[bytes, bytes], rdma: bool = True, grant: bool = True,
                 lie_crc: bytes = b"", forge: bytes = b"") -> None:
        self.data, self.rdma, self.grant, self.lie_crc = data, rdma, grant, lie_crc
        self.forge = forge  # this key's READ brings other bytes than its tag covers
        self.attaches = self.dones = self.tcp_requests = self.rdma_requests = 0
        self.server: asyncio.Server | None = None
        self.conns: list[asyncio.StreamWriter] = []
        self.addr = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.addr = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, r: asyncio.StreamReader, wr: asyncio.StreamWriter) -> None:
        self.conns.append(wr)
        try:
            t = await w.accept(r, wr, KEYS.peer_key, "n1", 10.0)
            while True:
                magic = await r.readexactly(4)
                if magic == w.ATTACH_MAGIC:
                    assert w.unpack_qp(await r.readexactly(w.QP.size), "test") == QP
                    self.attaches += 1
                    wr.write(b"\x01" + w.pack_qp(QP) if self.rdma else b"\x00")
                    continue
                _m, ns, proof, count = w.REQUEST.unpack(magic + await r.readexactly(
                    w.REQUEST.size - 4))
                nk = KEYS.namespace(ns)
                assert w.check(t.ns_proof(nk.request_key, ns), proof)
                keys = [await r.readexactly((await r.readexactly(1))[0]) for _ in range(count)]
                if magic == w.REQUEST_MAGIC:
                    self.tcp_requests += 1
                    for k in keys:
                        d = self.data.get(k)
                        wr.write(w.ANSWER.pack(1, crc32c(d), len(d), 1,
                                               nk.auth.tag(k, d, t.answer_context(1))) + d
                                 if d is not None else w.ANSWER.pack(0, 0, 0, 0, w.NO_TAG))
                    continue
                self.rdma_requests += 1
                granted = False
                for k in keys:
                    d = self.data.get(k)
                    if d is None:
                        wr.write(w.RDMA_ANSWER.pack(0, 0, 0, 0, 0, 0, w.NO_TAG))
                    elif not self.grant:
                        wr.write(w.RDMA_ANSWER.pack(2, 0, 0, 0, 0, 0, w.NO_TAG))
                    else:
                        granted = True
                        crc = crc32c(d) ^ (1 if k == self.lie_crc else 0)
                        addr = 0x1000 * (1 + sorted(self.data).index(k))
                        # The READ brings these bytes; the tag is over what the holder
                        # meant (a forged one for ``self.forge``).
                        FakeLink.memory[addr] = d if k != self.forge else bytes(len(d))
                        tag = nk.auth.tag(k, d, t.answer_context(1))
                        wr.write(w.RDMA_ANSWER.pack(1, crc, len(d), 1, addr, 0x42, tag))
                if granted:
                    assert await r.readexactly(4) == w.DONE
                    self.dones += 1
        except (asyncio.IncompleteReadError, ConnectionError, w.HandshakeFailed):
            pass
        finally:
            wr.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            for wr in self.conns:
                wr.close()
            await self.server.wait_closed()
            self.server = None


def _entries(data: dict[bytes, bytes], keys: list[bytes]) -> list[RemoteEntry]:
    return [RemoteEntry("n1", "dram", 1, len(data[k]), crc32c(data[k]), None, k)
            for k in keys]


@pytest.fixture
def fake_link(monkeypatch: pytest.MonkeyPatch) -> type[FakeLink]:
    monkeypatch.setattr(peer_client, "FetchLink", FakeLink)
    FakeLink.memory, FakeLink.fail, FakeLink.made = {}, False, []
    return FakeLink


@pytest.fixture
async def data() -> AsyncIterator[dict[bytes, bytes]]:
    yield {bytes([i]) * 16: bytes([i]) * (4096 + i) for i in range(1, 6)}


async def _source(holder: Holder) -> tuple[peer_client.PeerSource, Counter[str]]:
    await holder.start()
    counters: Counter[str] = Counter()
    pod = PodConfig(pod_token=TOKEN, fetch_timeout_s=5.0)
    dev: Any = object()  # only handed to the (stand-in) link
    return peer_client.PeerSource(pod, lambda _n: holder.addr, counters, KEYS,
                                  rdma=dev), counters


async def test_hits_are_read_by_rdma_and_the_lease_ended(
        fake_link: type[FakeLink], data: dict[bytes, bytes]) -> None:
    keys = sorted(data)
    holder = Holder(data, lie_crc=keys[2])
    src, counters = await _source(holder)
    try:
        missing = b"\x99" * 16
        entries = [*_entries(data, keys), RemoteEntry("n1", "dram", 1, 10, 0, None, missing)]
        got = await src.fetch(b"\x01" * 16, entries)
        assert got[:2] == [data[k] for k in keys[:2]] and got[3:5] == [data[k]
                                                                       for k in keys[3:5]]
        assert got[2] is None and got[5] is None  # another version there; not held
        # The scripted holder reads the fetcher's done after the fetch returned.
        await until_async(lambda: holder.dones == 1, 5, "the fetcher's done", 0.01)
        assert (holder.attaches, holder.rdma_requests, holder.tcp_requests) == (1, 1, 0)
        assert counters["pod_peer_rdma_blocks"] == 4 and counters["pod_peer_misses"] == 2
        got = await src.fetch(b"\x01" * 16, _entries(data, keys[:1]))  # connection reused
        assert got == [data[keys[0]]] and holder.attaches == 1
        await until_async(lambda: holder.dones == 2, 5, "the second done", 0.01)
    finally:
        await src.close()
        await holder.close()
    assert all(link.closed for link in fake_link.made)


async def test_a_block_read_by_rdma_whose_authenticator_fails_is_a_miss(
        fake_link: type[FakeLink], data: dict[bytes, bytes]) -> None:
    """The READ brings bytes other than those the holder's authenticator covers (the
    index's CRC32C says nothing of them): a miss, counted; the others are hits."""
    keys = sorted(data)
    holder = Holder(data, forge=keys[1])
    src, counters = await _source(holder)
    try:
        got = await src.fetch(b"\x01" * 16, _entries(data, keys))
        assert got[1] is None
        assert [g for i, g in enumerate(got) if i != 1] == [data[k] for k in keys if
                                                            k != keys[1]]
        assert counters["pod_fetch_unauthenticated"] == 1
    finally:
        await src.close()
        await holder.close()


async def test_a_holder_that_cannot_grant_is_asked_over_tcp(
        fake_link: type[FakeLink], data: dict[bytes, bytes]) -> None:
    keys = sorted(data)
    holder = Holder(data, grant=False)
    src, counters = await _source(holder)
    try:
        assert await src.fetch(b"\x01" * 16, _entries(data, keys)) == [data[k] for k in keys]
        assert (holder.rdma_requests, holder.tcp_requests, holder.dones) == (1, 1, 0)
        assert counters["pod_peer_rdma_blocks"] == 0 and counters["pod_peer_rdma_fallbacks"] == 1
    finally:
        await src.close()
        await holder.close()


async def test_a_failed_transfer_is_misses_then_tcp(
        fake_link: type[FakeLink], data: dict[bytes, bytes]) -> None:
    keys = sorted(data)
    holder = Holder(data)
    src, counters = await _source(holder)
    try:
        fake_link.fail = True
        assert await src.fetch(b"\x01" * 16, _entries(data, keys)) == [None] * len(keys)
        assert counters["pod_peer_errors"] == 1 and counters["pod_peer_rdma_fallbacks"] == 1
        assert counters["pod_rdma_setup_errors"] == 0
        assert fake_link.made[0].closed
        # The peer is fetched from over TCP now (no new attach), byte-exact.
        assert await src.fetch(b"\x01" * 16, _entries(data, keys)) == [data[k] for k in keys]
        assert (holder.attaches, holder.tcp_requests) == (1, 1)
    finally:
        await src.close()
        await holder.close()


async def test_a_holder_without_rdma_gets_tcp(
        fake_link: type[FakeLink], data: dict[bytes, bytes]) -> None:
    keys = sorted(data)
    holder = Holder(data, rdma=False)
    src, counters = await _source(holder)
    try:
        assert await src.fetch(b"\x01" * 16, _entries(data, keys)) == [data[k] for k in keys]
        assert (holder.attaches, holder.rdma_requests, holder.tcp_requests) == (1, 0, 1)
        assert counters["pod_peer_rdma_fallbacks"] == 1 and fake_link.made[0].closed
        assert counters["pod_rdma_setup_errors"] == 0
    finally:
        await src.close()
        await holder.close()


async def test_a_queue_pair_that_cannot_connect_gives_tcp(
        fake_link: type[FakeLink], data: dict[bytes, bytes],
        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: FakeLink, peer: rw.QpInfo) -> None:
        raise rw.RdmaDeviceError("connecting peer-fetch QP failed: errno 110", 110)

    monkeypatch.setattr(FakeLink, "connect", refuse)
    keys = sorted(data)
    holder = Holder(data)
    src, counters = await _source(holder)
    try:
        assert await src.fetch(b"\x01" * 16, _entries(data, keys)) == [data[k] for k in keys]
        assert (holder.attaches, holder.rdma_requests, holder.tcp_requests) == (1, 0, 1)
        assert counters["pod_rdma_setup_errors"] == 1 and counters["pod_peer_errors"] == 0
        assert fake_link.made[0].closed
    finally:
        await src.close()
        await holder.close()


async def test_a_holder_that_dies_during_the_reads_ends_them(
        fake_link: type[FakeLink], data: dict[bytes, bytes],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The READs towards a holder that is gone may never complete (Soft-RoCE); its
    connection's end stops them, long before pod.fetch_timeout_s (here 120 s)."""
    reading = asyncio.Event()

    async def hang(self: FakeLink, items: Sequence[tuple[int, int, int]],
                   timeout_s: float) -> list[bytes]:
        reading.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.close()
            raise
        return []

    monkeypatch.setattr(FakeLink, "read", hang)
    keys = sorted(data)
    holder = Holder(data)
    await holder.start()
    counters: Counter[str] = Counter()
    dev: Any = object()
    src = peer_client.PeerSource(PodConfig(pod_token=TOKEN, fetch_timeout_s=120.0),
                                 lambda _n: holder.addr, counters, KEYS, rdma=dev)
    try:
        job = asyncio.ensure_future(src.fetch(b"\x01" * 16, _entries(data, keys)))
        await asyncio.wait_for(reading.wait(), 30)
        await holder.close()  # the holder dies: its connections end
        assert await asyncio.wait_for(job, 30) == [None] * len(keys)
        assert counters["pod_peer_errors"] == 1 and fake_link.made[0].closed
    finally:
        await src.close()
        await holder.close()
