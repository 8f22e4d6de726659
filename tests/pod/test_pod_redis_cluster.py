"""The pod's index on a real 3-master Redis Cluster (``pod.index_cluster: true``): cross-node
hits, unpublish and liveness with the namespaces' keys spread over several masters, so
every command the pod sends is proved not to cross slots."""

from __future__ import annotations

from pathlib import Path

import redis

import ctxmem
from ctxmem_dpu.pod.entries import NODES_KEY, alive_key
from ctxmem_tools.bench.security_pki import make_pki, member_cert
from ctxmem_tools.pod_launcher import LocalPod
from ctxmem_tools.redis_server import RedisClusterServers
from tests.pod.peerkit import FIXED_MASTER, index_keys, index_names
from tests.pod.podtest import Clients, blocks, wait_for

MODELS = [f"m{i}" for i in range(6)]


def test_pod_on_a_redis_cluster(tmp_path: Path, index_exe: str, clients: Clients) -> None:
    with RedisClusterServers(tmp_path / "cluster", exe=index_exe) as redis_cluster:
        _pod_on_a_cluster(tmp_path, redis_cluster, clients)


def _pod_on_a_cluster(tmp_path: Path, redis_cluster: RedisClusterServers,
                      clients: Clients) -> None:
    # The index's names are keyed by the pod's master key: a fixed one, so that where the
    # namespaces land is known (and checked) before the pod starts.
    ik = index_keys()
    owners = {redis_cluster.owner_of(index_names(ik, [], m)[0]) for m in MODELS}
    assert len(owners) > 1, "every namespace landed on one master: the test proves nothing"
    # The node keys share one slot (heartbeat pipeline, multi-key EXISTS).
    assert len({redis_cluster.owner_of(k) for k in
                (NODES_KEY, alive_key("node1"), alive_key("node3"))}) == 1
    with LocalPod(tmp_path / "pod", 3, index=redis_cluster,
                  master_key_hex=FIXED_MASTER.hex()) as pod:
        n1, n2, n3 = pod.nodes
        keys = ctxmem.chain_hashes(range(16 * 4), 16)
        data = blocks(4, 21)
        # A put on node 1 in six namespaces (spread over the masters): one publish
        # pipeline spanning slots; byte-exact hits on node 2.
        for m in MODELS:
            assert clients.put(n1.endpoint, keys, data, model=m) == 4
        for m in MODELS:
            wait_for(lambda m=m: clients.hits(n2.endpoint, keys, m) == 4,  # type: ignore[misc]
                     what=f"publish of namespace {m}")
            assert clients.get(n2.endpoint, keys, data, model=m) == 4
        assert clients.stats(n2.endpoint)["pod_fetch_blocks_peer"] == 4 * len(MODELS)
        assert clients.stats(n1.endpoint)["pod_index_errors"] == 0

        # Unpublish: deleted on the holder (the conditional-delete script in the publish
        # pipeline) is a miss on the others.
        gone = ctxmem.chain_hashes(range(9000, 9000 + 16 * 4), 16)
        assert clients.put(n1.endpoint, gone, data, model="m1") == 4
        wait_for(lambda: clients.hits(n3.endpoint, gone, "m1") == 4, what="publish")
        assert clients.ns(n1.endpoint, "m1").delete(gone[2:]) == 2
        wait_for(lambda: clients.hits(n3.endpoint, gone, "m1") == 2, what="unpublish")

        # Liveness: node 3's blocks are hits on node 1 until it is killed, then ignored.
        more = ctxmem.chain_hashes(range(7000, 7000 + 16 * 3), 16)
        assert clients.put(n3.endpoint, more, data[:3], model="m5") == 3
        wait_for(lambda: clients.hits(n1.endpoint, more, "m5") == 3, what="node 3 publish")
        n3.kill()
        wait_for(lambda: clients.hits(n1.endpoint, more, "m5") == 0, timeout_s=15,
                 what="the dead node's entries to be ignored")
        assert clients.get(n1.endpoint, more, data[:3], model="m5") == 0
        # ... and cleaned up lazily (EXISTS over the nodes' alive keys, conditional delete).
        r = redis.RedisCluster.from_url(redis_cluster.url)
        try:
            key, more_f = index_names(ik, more, "m5")
            keys_f = index_names(ik, keys, "m5")[1]
            wait_for(lambda: not any(r.hmget(key, more_f)), what="the stale entries' cleanup")
            assert all(r.hmget(key, keys_f))  # the live nodes' entries stay
        finally:
            r.close()
        for node in (n1, n2):
            assert clients.stats(node.endpoint)["pod_index_errors"] == 0


def test_pod_on_a_redis_cluster_over_tls(tmp_path: Path, clients: Clients) -> None:
    """``rediss://`` and ``pod.index_cluster`` together: a TLS-only cluster (clients and
    the cluster bus), verified against ``pod.index_ca_file``; a cross-node hit."""
    pki = make_pki(tmp_path / "pki", tenants=())
    # Server and client use: the cluster bus is mutual TLS between the masters.
    cert, key = member_cert(pki, "redis-cluster")
    with RedisClusterServers(tmp_path / "cluster", tls=(cert, key, pki.ca)) as cluster, \
            LocalPod(tmp_path / "pod", 2, index=cluster,
                     pod={"index_ca_file": str(pki.ca)}) as pod:
        assert cluster.url.startswith("rediss://")
        n1, n2 = pod.nodes
        keys = ctxmem.chain_hashes(range(16 * 3), 16)
        data = blocks(3, 23)
        for m in MODELS[:3]:
            assert clients.put(n1.endpoint, keys, data, model=m) == 3
        for m in MODELS[:3]:
            wait_for(lambda m=m: clients.hits(n2.endpoint, keys, m) == 3,  # type: ignore[misc]
                     what=f"publish of namespace {m} over TLS")
            assert clients.get(n2.endpoint, keys, data, model=m) == 3
        assert clients.stats(n2.endpoint)["pod_index_errors"] == 0
