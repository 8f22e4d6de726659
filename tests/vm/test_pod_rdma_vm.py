"""Pod peer fetch over REAL RDMA (Soft-RoCE rxe0 in the QEMU guest), issue 14 item 2.

Three real service processes (``ctxmem serve``) and a real ``redis-server`` in the guest;
nodes 1 and 2 have ``pod.rdma_listen`` on rxe0's address, node 3 has no RDMA:

- a put through node 1 is a byte-exact hit on node 2, read by RDMA (the fetcher's
  ``pod_peer_rdma_blocks`` and the holder's ``pod_served_rdma_blocks`` count every
  block; nothing went over TCP) and on node 3 over TCP (it has no RDMA);
- blocks held by node 3 reach node 2 over TCP: node 2 offers RDMA, node 3 declines, the
  fallback is counted and the bytes are exact;
- the holder's lease, at the verbs level (this test process as the fetcher, with the
  node's own :class:`FetchLink`): a granted key READs the block's exact bytes until the
  fetcher's done, and fails (remote access error) after it; a fetcher that never says
  done loses the key at ``pod.fetch_timeout_s`` and its connection is closed;
- node 1 killed (SIGKILL) in the middle of RDMA fetches: node 2's gets are a byte-exact
  prefix, then misses; never a wrong block (``pod_fetch_bad`` stays 0); a READ with a key
  node 1 granted just before it died fails and returns nothing.

Run: bash tests/vm/run.sh .venv/bin/pytest -q -m vm tests/vm/test_pod_rdma_vm.py
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import kit

LAYOUT = kit.model_layout(num_layers=4)  # the pod tests' (tests/pod/podtest.py)

IN_VM = os.environ.get("CTXMEM_VM") == "1"
pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(not IN_VM, reason="needs the QEMU guest with Soft-RoCE; run: "
                       "bash tests/vm/run.sh .venv/bin/pytest -m vm "
                       "tests/vm/test_pod_rdma_vm.py"),
    pytest.mark.timeout(1500),
]

START_TIMEOUT_S = 300.0  # bounds, not timings: the guest CPU is emulated
PUBLISH_TIMEOUT_S = 60.0
FETCH_TIMEOUT_S = 20.0  # pod.fetch_timeout_s: the holder's lease without a done


class Pod:
    """redis-server and three nodes: 1 and 2 with RDMA on rxe0, 3 without."""

    def __init__(self, workdir: Path) -> None:
        from ctxmem_tools.launcher import ServiceProcess, local_config
        from ctxmem_tools.pod_launcher import pod_section, write_key
        from ctxmem_tools.redis_server import RedisServer

        self.redis = RedisServer(workdir / "redis")
        self.token = token = secrets.token_hex(16)
        # The pod's one master key: blocks served between nodes are authenticated under it.
        self.master_key = secrets.token_bytes(32)
        rdma = {"rdma_listen": os.environ["CTXMEM_RDMA_IP"],
                "rdma_device": os.environ["CTXMEM_RDMA_DEV"]}
        self.nodes: list[Any] = []
        try:
            for i, with_rdma in enumerate((True, True, False), start=1):
                d = workdir / f"node{i}"
                write_key(d / "master.key", self.master_key.hex())
                # DRAM only: the guest's /tmp is tmpfs (no O_DIRECT for a flash file).
                cfg = local_config(d, flash_size=None, dram_size="64MiB")
                cfg["pod"] = pod_section(self.redis.url, f"node{i}", token,
                                         fetch_timeout_s=FETCH_TIMEOUT_S, node_ttl_s=10.0,
                                         heartbeat_s=1.0, **(rdma if with_rdma else {}))
                node = ServiceProcess(d, cfg, start=False)
                self.nodes.append(node)
                node.start(timeout_s=START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        out = os.environ.get("CTXMEM_VM_OUT")
        for i, node in enumerate(self.nodes, start=1):
            node.stop()
            if out and node.log_path.exists():
                Path(out, f"pod-rdma-node{i}.log").write_bytes(node.log_path.read_bytes())
        self.redis.stop()


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    p = Pod(tmp_path_factory.mktemp("pod-rdma"))
    yield p
    p.close()


@pytest.fixture(scope="module")
def clients() -> Iterator[Any]:
    from tests.pod.podtest import Clients

    c = Clients()
    yield c
    c.close()


class Fetcher:
    """This process as a pod member fetching by RDMA, step by step: one peer connection
    with an attached queue pair (the node's own ``FetchLink``), raw requests."""

    def __init__(self, addr: str, pod: Pod, node: str = "node1") -> None:
        from ctxmem_common.podkeys import PodKeys

        self.addr, self.node = addr, node
        self.keys = PodKeys(pod.master_key, pod.token.encode())
        self.transcript: Any = None
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.link: Any = None

    async def __aenter__(self) -> Fetcher:
        from ctxmem_common import peer_wire as w
        from ctxmem_common import rdma_wire as rw
        from ctxmem_dpu.transport.rdma_device import RdmaDevice

        self.dev = RdmaDevice(rw.find_gid(os.environ["CTXMEM_RDMA_IP"],
                                          os.environ["CTXMEM_RDMA_DEV"]))
        host, port = self.addr.rsplit(":", 1)
        self.reader, self.writer = await asyncio.wait_for(
            asyncio.open_connection(host, int(port)), 30)
        self.transcript = await w.connect(self.reader, self.writer, self.keys.peer_key,
                                          "vm-fetcher", self.node, 30)
        await self.attach()
        return self

    async def attach(self) -> None:
        from ctxmem_common import peer_wire as w
        from ctxmem_dpu.pod.peer_rdma import FetchLink

        assert self.reader is not None and self.writer is not None
        self.link = FetchLink(self.dev)
        self.writer.write(w.ATTACH_MAGIC + w.pack_qp(self.link.info()))
        assert await asyncio.wait_for(self.reader.readexactly(1), 30) == b"\x01"
        self.link.connect(w.unpack_qp(await self.reader.readexactly(w.QP.size), "test"))

    async def grant(self, ns_digest: bytes, keys: list[bytes]) -> list[tuple[int, int, int]]:
        """(address, rkey, length) per key, all hits; the holder's lease starts."""
        from ctxmem_common import peer_wire as w

        assert self.reader is not None and self.writer is not None
        proof = self.transcript.ns_proof(self.keys.namespace(ns_digest).request_key,
                                         ns_digest)
        self.writer.write(w.pack_keys(ns_digest, keys, w.RDMA_REQUEST_MAGIC, proof))
        raw = await asyncio.wait_for(
            self.reader.readexactly(w.RDMA_ANSWER.size * len(keys)), 60)
        out = []
        for i in range(len(keys)):
            status, _crc, n, _seq, addr, rkey, _tag = w.RDMA_ANSWER.unpack_from(
                raw, i * w.RDMA_ANSWER.size)
            assert status == 1, f"key {i}: status {status}"
            out.append((addr, rkey, n))
        return out

    def done(self) -> None:
        from ctxmem_common import peer_wire as w

        assert self.writer is not None
        self.writer.write(w.DONE)

    async def __aexit__(self, *exc: object) -> None:
        if self.link is not None:
            self.link.close()
        if self.writer is not None:
            self.writer.transport.abort()
        self.dev.close()


async def _read_fails(f: Fetcher, items: list[tuple[int, int, int]]) -> str:
    """A READ that must fail and return nothing: its error; the link is closed then.
    (A READ towards a QP that is gone gets no completion at all on Soft-RoCE here, where
    a NIC reports a retry-count error in about 2 s: the read's own bound ends it.)"""
    from ctxmem_dpu.pod.peer_rdma import RdmaTransferError

    with pytest.raises(RdmaTransferError) as info:
        got = await f.link.read(items, 10.0)
        raise AssertionError(f"a READ after the lease returned {len(got)} blocks")
    assert f.link.closed
    return str(info.value)


def _publish(clients: Any, endpoint: str, keys: list[bytes]) -> None:
    from tests.pod.podtest import wait_for

    wait_for(lambda: clients.hits(endpoint, keys) == len(keys), PUBLISH_TIMEOUT_S,
             "the holder's entries in the index")


def test_put_on_node1_is_an_rdma_hit_on_node2_and_tcp_on_node3(pod: Pod,
                                                               clients: Any) -> None:
    from tests.pod.podtest import blocks

    n1, n2, n3 = pod.nodes
    keys, data = kit.chain_keys(LAYOUT, 6250, 8), blocks(8, 1)
    assert clients.put(n1.endpoint, keys, data) == 8
    _publish(clients, n2.endpoint, keys)
    assert clients.get(n2.endpoint, keys, data) == 8  # byte-checked
    s2 = clients.stats(n2.endpoint)
    assert s2["pod_peer_rdma_blocks"] == 8 and s2["pod_fetch_blocks_peer"] == 8, s2
    assert s2["pod_peer_rdma_fallbacks"] == 0 and s2["pod_rdma_setup_errors"] == 0
    assert s2["pod_fetch_bad"] == 0
    # The holder counts RDMA-served blocks when the fetcher's done arrives; the fetcher
    # sends it without waiting, so node 2's get can return before node 1 has counted.
    s1 = clients.stats_when(n1.endpoint, lambda s: s["pod_served_rdma_blocks"] >= 8, 60.0)
    assert s1["pod_served_rdma_blocks"] == 8 == s1["pod_served_blocks"], s1
    # Node 3 has no RDMA: the same blocks over TCP from the same holder.
    _publish(clients, n3.endpoint, keys)
    assert clients.get(n3.endpoint, keys, data) == 8
    s3 = clients.stats(n3.endpoint)
    assert s3["pod_fetch_blocks_peer"] == 8 and s3["pod_peer_rdma_blocks"] == 0
    s1 = clients.stats(n1.endpoint)
    assert s1["pod_served_blocks"] == 16 and s1["pod_served_rdma_blocks"] == 8


def test_a_holder_without_rdma_serves_over_tcp(pod: Pod, clients: Any) -> None:
    from tests.pod.podtest import blocks

    _n1, n2, n3 = pod.nodes
    keys, data = kit.chain_keys(LAYOUT, 12500, 6), blocks(6, 2)
    assert clients.put(n3.endpoint, keys, data) == 6
    _publish(clients, n2.endpoint, keys)
    before = clients.stats(n2.endpoint)
    assert clients.get(n2.endpoint, keys, data) == 6  # byte-checked
    s2 = clients.stats(n2.endpoint)
    assert s2["pod_peer_rdma_blocks"] == before["pod_peer_rdma_blocks"]  # none by RDMA
    assert s2["pod_fetch_blocks_peer"] == before["pod_fetch_blocks_peer"] + 6
    assert s2["pod_peer_rdma_fallbacks"] >= 1 and s2["pod_fetch_bad"] == 0
    assert clients.stats(n3.endpoint)["pod_served_rdma_blocks"] == 0


async def test_the_holders_lease_ends_at_done_and_at_the_timeout(pod: Pod,
                                                                 clients: Any) -> None:
    from crc32c import crc32c

    from tests.pod.podtest import blocks

    n1, _n2, _n3 = pod.nodes
    keys, data = kit.chain_keys(LAYOUT, 25000, 4), blocks(4, 4)
    assert clients.put(n1.endpoint, keys, data) == 4
    digest = clients.ns(n1.endpoint).digest
    async with Fetcher(n1.config["pod"]["listen"], pod) as f:
        items = await f.grant(digest, keys)
        got = await f.link.read(items, 30.0)
        assert got == [d.tobytes() for d in data]  # exact, and so is the CRC
        assert [crc32c(g) for g in got] == [crc32c(d.tobytes()) for d in data]
        f.done()
        await asyncio.sleep(1.0)  # the holder deregisters at done
        why = await _read_fails(f, items)
        print(f"READ after done: {why}")
    # No done: the key dies at the holder's fetch timeout, and the connection with it.
    async with Fetcher(n1.config["pod"]["listen"], pod) as f:
        items = await f.grant(digest, keys[:2])
        assert f.reader is not None
        assert await asyncio.wait_for(f.reader.read(1), FETCH_TIMEOUT_S + 60) == b""
        why = await _read_fails(f, items)
        print(f"READ after the lease timed out: {why}")
    assert clients.stats(n1.endpoint)["pod_served_rdma_blocks"] >= 4


async def test_holder_killed_mid_rdma_fetch_gives_misses_never_wrong_bytes(
        pod: Pod, clients: Any) -> None:
    from tests.pod.podtest import blocks, wait_for

    n1, n2, _n3 = pod.nodes
    n = 200
    keys, data = kit.chain_keys(LAYOUT, 18750, n), blocks(n, 3)
    assert clients.put(n1.endpoint, keys, data) == n
    _publish(clients, n2.endpoint, keys)
    before = clients.stats(n2.endpoint)["pod_peer_rdma_blocks"]
    # A fetcher holding keys node 1 granted, when node 1 dies.
    f = await Fetcher(n1.config["pod"]["listen"], pod).__aenter__()
    held = await f.grant(clients.ns(n1.endpoint).digest, keys[:4])
    # Pulls of pod.fetch_max_blocks (256) per Acquire: one get of 200 keys is one RDMA
    # request; kill the holder while gets run, chunk after chunk.
    killer = threading.Timer(0.5, n1.kill)
    killer.start()
    got = 0
    try:
        for part in range(0, n, 20):
            got += clients.get(n2.endpoint, keys[part:part + 20], data[part:part + 20])
    finally:
        killer.join()
    try:
        print(f"READ from the killed holder: {await _read_fails(f, held)}")
    finally:
        await f.__aexit__()
    assert 0 <= got <= n
    s2 = clients.stats(n2.endpoint)
    assert s2["pod_fetch_bad"] == 0
    print(f"holder killed: {got} of {n} blocks fetched first, "
          f"{s2['pod_peer_rdma_blocks'] - before} by RDMA")
    # The dead holder's entries are ignored, and with them the copies node 2 fetched
    # from it: a copy is served only while the index names its entry (docs/pod.md,
    # "Deletes and re-puts across nodes"); misses, never wrong bytes.
    wait_for(lambda: clients.hits(n2.endpoint, keys) == 0, 60,
             "the dead holder's entries to be ignored")
    assert clients.get(n2.endpoint, keys, data) == 0

