"""Issue 14, parts 1-3 together: two real service processes with the pod tier on, one
shared flash file and a real redis-server. A block node 1 demoted onto the shared device
is read by node 2 straight from flash (not through node 1), also after node 1 is killed."""

from __future__ import annotations

import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import ctxmem
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
