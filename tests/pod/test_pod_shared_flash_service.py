"""Issue 14, parts 1-3 together: two real service processes with the pod tier on, one
shared flash file and a real redis-server. A block node 1 demoted onto the shared device
is read by node 2 straight from flash (not through node 1), also after node 1 is killed."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import ctxmem
from ctxmem_common.flash_format import (
    BEAT_OFFSET,
    BEAT_SLOTS,
    DATA_START,
    SECTOR,
    NodeBeat,
    SlabHeader,
    Superblock,
)
from ctxmem_dpu.pod.entries import unpack_entry
from ctxmem_tools.launcher import ServiceProcess, local_config
from ctxmem_tools.pod_launcher import pod_section
from ctxmem_tools.redis_server import RedisServer
from tests.dpu.pod.podkit import format_shared
from tests.pod.podtest import Clients, blocks, wait_for

SLAB = 16 << 20


def _located_entries(url: str) -> int:
    """How many index entries (all namespaces) carry a shared-flash location."""
    import redis

    with redis.Redis.from_url(url, socket_timeout=5) as r:
        return sum(1 for name in r.scan_iter(match="ctxmem:*:blocks")
                   for v in r.hvals(name)
                   if (e := unpack_entry(v)) is not None and e.shared is not None)


@pytest.fixture
def shared_pod(tmp_path: Path) -> Iterator[tuple[list[ServiceProcess], str]]:
    shared = tmp_path / "shared0.img"
    format_shared(str(shared), SLAB, size=256 << 20)
    token = secrets.token_hex(16)
    nodes: list[ServiceProcess] = []
    with RedisServer(tmp_path / "redis") as redis:
        try:
            for i in (1, 2):
                d = tmp_path / f"node{i}"
                cfg = local_config(d, flash_path=str(shared), flash_slab="16MiB")
                cfg["flash"]["devices"][0].update(name="shared0", shared=True, create=False)
                if i == 2:  # one master key for the pod: any node decrypts any record
                    shutil.copy(tmp_path / "node1" / "master.key", d / "master.key")
                cfg["pod"] = pod_section(redis.url, f"node{i}", token, slab_lease_s=2.0,
                                         shared_spare_slabs=1)
                nodes.append(ServiceProcess(d, cfg))
            yield nodes, redis.url
        finally:
            for n in nodes:
                n.stop()


def test_shared_flash_block_is_read_directly_and_outlives_its_writer(
        shared_pod: tuple[list[ServiceProcess], str], clients: Clients) -> None:
    (n1, n2), redis_url = shared_pod
    keys = ctxmem.chain_hashes(range(16 * 6), 16)
    data = blocks(len(keys), 7)
    ns1 = clients.ns(n1.endpoint)
    assert ns1.put(keys, data).stored == 6
    # Make them durable on the shared device and drop node 1's DRAM copies: the entries
    # are published again with their shared location.
    assert ns1.evict(keys, "dram") == 6
    assert ns1.lookup(keys).tiers == ["flash"] * 6
    # Published at commit, then again with the location once durable on the shared device.
    wait_for(lambda: _located_entries(redis_url) == 6, what="entries with a shared location")
    wait_for(lambda: clients.hits(n2.endpoint, keys) == 6, what="publish to the index")
    assert clients.get(n2.endpoint, keys[:3], data[:3]) == 3
    st = clients.stats(n2.endpoint)
    assert st.get("pod_fetch_blocks_shared_flash") == 3 and st.get("pod_fetch_blocks_peer", 0) == 0
    assert clients.stats(n1.endpoint).get("pod_served_blocks", 0) == 0  # node 1 sent nothing

    n1.kill()  # the writer dies: its blocks are still on the shared device
    clients.drop(n1.endpoint)
    time.sleep(3.0)  # past pod.node_ttl_s (2 s): node 1 is dead to the index now
    assert clients.hits(n2.endpoint, keys[3:]) == 3  # its shared-flash entries still hit
    got = [np.zeros_like(d) for d in data[3:]]
    ns2 = clients.ns(n2.endpoint)
    assert ns2.get(keys[3:], got) == 3  # read from flash, node 1 gone
    assert all(np.array_equal(a, b) for a, b in zip(got, data[3:], strict=True))
    assert clients.stats(n2.endpoint).get("pod_fetch_blocks_shared_flash") == 6


def _slab_owners(path: Path) -> list[str]:
    """The owner node each slab header on the shared device names now ("": blank)."""
    return [o for o, _r in _slab_stamps(path)]


def _slab_stamps(path: Path) -> list[tuple[str, bool]]:
    """Per slab header on the shared device now: (owner node or "", whether it is a real
    slab header that may hold records, not a lease stamp)."""
    out = []
    with open(path, "rb") as f:
        sb = Superblock.unpack(os.pread(f.fileno(), SECTOR, 0))
        assert sb is not None
        for s in range(sb.num_slabs):
            h = SlabHeader.unpack(memoryview(os.pread(f.fileno(), SECTOR,
                                                      DATA_START + s * sb.slab_size)))
            out.append((h.owner, h.slot_size > 0) if h is not None else ("", False))
    return out


def _beats(path: Path) -> dict[str, int]:
    """Every node's heartbeat counter on the shared device."""
    with open(path, "rb") as f:
        raw = memoryview(os.pread(f.fileno(), BEAT_SLOTS * SECTOR, BEAT_OFFSET))
    beats = (NodeBeat.unpack(raw[i * SECTOR:(i + 1) * SECTOR]) for i in range(BEAT_SLOTS))
    return {b.node: b.beat for b in beats if b is not None}


def _located_slabs(url: str, node: str) -> set[int]:
    """The shared-device slabs the index locates ``node``'s blocks in."""
    import redis

    with redis.Redis.from_url(url, socket_timeout=5) as r:
        return {(e.shared.offset - DATA_START) // SLAB
                for name in r.scan_iter(match="ctxmem:*:blocks") for v in r.hvals(name)
                if (e := unpack_entry(v)) is not None and e.shared is not None
                and e.node_id == node}


def _lease_holders(url: str) -> list[str]:
    import redis

    with redis.Redis.from_url(url, socket_timeout=5) as r:
        return [v.decode().rpartition("|")[0] for k in r.scan_iter(match="ctxmem:slab:*:lease")
                if (v := r.get(k)) is not None]


def test_a_node_stopped_past_its_lease_keeps_its_slabs_and_goes_on(
        shared_pod: tuple[list[ServiceProcess], str], clients: Clients,
        tmp_path: Path) -> None:
    """Issue 26 item 2: node 1 SIGSTOPped past its slab leases (they lapse in the index,
    its heartbeat on the device stops). Node 2 writes durable blocks meanwhile: into blank
    slabs, never node 1's slabs of durable records. After SIGCONT node 1 renews its own
    leases (nothing revoked), goes on writing, and every acknowledged durable block of
    both reads back byte for byte from both nodes."""
    (n1, n2), redis_url = shared_pod
    path = tmp_path / "shared0.img"
    k1 = ctxmem.chain_hashes(range(16 * 6), 16)
    k2 = ctxmem.chain_hashes(range(5000, 5000 + 16 * 6), 16)
    k3 = ctxmem.chain_hashes(range(9000, 9000 + 16 * 6), 16)
    d1, d2, d3 = blocks(6, 1), blocks(6, 2), blocks(6, 3)

    def durable(node: ServiceProcess, keys: list[bytes], data: list[np.ndarray],
                located: int) -> None:
        ns = clients.ns(node.endpoint)
        assert ns.put(keys, data).stored == 6
        assert ns.evict(keys, "dram") == 6  # written to the shared device (durable)
        assert ns.lookup(keys).tiers == ["flash"] * 6
        wait_for(lambda: _located_entries(redis_url) == located, timeout_s=30,
                 what=f"{located} entries with a shared location")

    durable(n1, k1, d1, 6)
    owners = _slab_owners(path)
    held1 = {s for s, o in enumerate(owners) if o == "node1"}
    assert held1 and "" in owners

    assert n1.proc is not None
    n1.proc.send_signal(signal.SIGSTOP)
    try:
        # Past its lease: its leases lapsed in the index (pod.slab_lease_s 2 s), and node 2
        # has renewed (advanced its heartbeat) for two leases (a renewal every lease / 3).
        wait_for(lambda: "node1" not in _lease_holders(redis_url), timeout_s=30,
                 what="node 1's leases to lapse in the index")
        b1, b2 = _beats(path)["node1"], _beats(path)["node2"]
        wait_for(lambda: _beats(path)["node2"] >= b2 + 6, timeout_s=30,
                 what="node 2's heartbeat to advance for two leases")
        assert _beats(path)["node1"] == b1  # (stopped: its heartbeat stands still)
        durable(n2, k2, d2, 12)
        # node 2 used its spare slab: it leases another (a lease stamp) once it sees that
        wait_for(lambda: ("node2", False) in _slab_stamps(path), timeout_s=30,
                 what="node 2 to lease a spare slab again")
        now = _slab_owners(path)
        assert all(now[s] == "node1" for s in held1), f"node 1's slabs taken: {now}"
        # node 2's durable blocks went to slabs that were blank (or its own spare)
        slabs2 = _located_slabs(redis_url, "node2")
        assert slabs2 and all(now[s] == "node2" and owners[s] in ("", "node2")
                              for s in slabs2), (slabs2, owners, now)
        assert clients.get(n2.endpoint, k1, d1) == 6  # node 1's blocks, from its slabs
    finally:
        n1.proc.send_signal(signal.SIGCONT)

    # Node 1 goes on: its own leases renewed (re-created at their epochs), none revoked.
    wait_for(lambda: "node1" in _lease_holders(redis_url), timeout_s=30,
             what="node 1's leases renewed")
    durable(n1, k3, d3, 18)
    assert all(_slab_owners(path)[s] == "node1" for s in held1)
    assert "taken over" not in n1.log()
    for node in (n1, n2):
        for keys, data in ((k1, d1), (k2, d2), (k3, d3)):
            assert clients.get(node.endpoint, keys, data) == 6
    assert clients.stats(n1.endpoint)["flash_fenced_writes"] == 0
