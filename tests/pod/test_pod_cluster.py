"""Issue 14: three real service processes and a real redis-server on loopback."""

from __future__ import annotations

import numpy as np

import ctxmem
from ctxmem_tools.locate_http import locate_http
from ctxmem_tools.pod_launcher import LocalPod
from tests.pod.podtest import LAYOUT, Clients, blocks, wait_for


def test_put_on_one_node_is_byte_exact_hit_on_the_others(pod: LocalPod,
                                                         clients: Clients) -> None:
    n1, n2, n3 = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 12), 16)
    data = blocks(len(keys), 1)
    with ctxmem.Client(n1.endpoint) as c1:
        ns1 = c1.open_namespace(LAYOUT, model_id="m")
        assert ns1.put(keys, data).stored == 12
    for node in (n2, n3):
        with ctxmem.Client(node.endpoint) as c:
            ns = c.open_namespace(LAYOUT, model_id="m")
            wait_for(lambda: ns.lookup(keys).num_hits == 12, what="publish")  # noqa: B023
            assert ns.lookup(keys).tiers == ["remote"] * 12
            out = [np.zeros_like(d) for d in data]
            assert ns.get(keys, out) == 12
            assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
            assert ns.lookup(keys).tiers == ["dram"] * 12  # stored locally now
        st = clients.stats(node.endpoint)
        assert st["pod_fetch_blocks_peer"] == 12 and st["pod_fetch_bad"] == 0
    assert clients.stats(n1.endpoint)["pod_served_blocks"] == 24


def test_other_tenant_and_model_never_see_the_blocks(pod: LocalPod, clients: Clients) -> None:
    n1, n2, _ = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 4), 16)
    with ctxmem.Client(n1.endpoint) as c1:
        c1.open_namespace(LAYOUT, model_id="m", tenant="alice").put(keys, blocks(4, 2))
    with ctxmem.Client(n2.endpoint) as c:
        alice = c.open_namespace(LAYOUT, model_id="m", tenant="alice")
        wait_for(lambda: alice.lookup(keys).num_hits == 4, what="publish")
        bob = c.open_namespace(LAYOUT, model_id="m", tenant="bob")
        assert bob.lookup(keys).num_hits == 0
        assert bob.get(keys, [np.zeros(LAYOUT.block_nbytes, np.uint8) for _ in keys]) == 0
        other = c.open_namespace(LAYOUT, model_id="other", tenant="alice")
        assert other.lookup(keys).num_hits == 0


def test_prefetch_pulls_remote_blocks_ahead_of_need(pod: LocalPod, clients: Clients) -> None:
    n1, n2, _ = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 8), 16)
    data = blocks(8, 9)
    assert clients.put(n1.endpoint, keys, data) == 8
    ns2 = clients.ns(n2.endpoint)
    wait_for(lambda: ns2.lookup(keys).num_hits == 8, what="publish")
    ns2.prefetch(keys)
    wait_for(lambda: ns2.lookup(keys).tiers == ["dram"] * 8, what="the prefetch")
    served = clients.stats(n1.endpoint)["pod_served_blocks"]
    assert clients.get(n2.endpoint, keys, data) == 8  # from node 2's own DRAM now
    assert clients.stats(n1.endpoint)["pod_served_blocks"] == served == 8


def test_locate_names_the_holding_node_of_each_leading_block(pod: LocalPod) -> None:
    """Issue 29 item 3: a router asks any node where a request's prefix is held, over gRPC
    and as JSON on the metrics port (POST /v1/locate)."""
    n1, n2, n3 = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 8), 16)
    data = blocks(len(keys), 5)
    with ctxmem.Client(n1.endpoint) as c1, ctxmem.Client(n2.endpoint) as c2, \
            ctxmem.Client(n3.endpoint) as c3:
        assert c1.open_namespace(LAYOUT, model_id="m").put(keys[:4], data[:4]).stored == 4
        assert c2.open_namespace(LAYOUT, model_id="m").put(keys[4:6], data[4:6]).stored == 2
        ns3 = c3.open_namespace(LAYOUT, model_id="m")
        wait_for(lambda: ns3.lookup(keys).num_hits == 6, what="publish")
        id1 = c1.open_namespace(LAYOUT, model_id="m").locate(keys[:1]).node_id
        id2 = c2.open_namespace(LAYOUT, model_id="m").locate(keys[:1]).node_id
        assert id1 and id2 and id1 != id2
        loc = ns3.locate(keys)
        assert loc.num_hits == 6 and loc.node_id not in (id1, id2, "")
        assert loc.nodes == [id1] * 4 + [id2] * 2
        assert loc.tiers == ["dram"] * 6
        # The same answer as JSON on node 3's metrics port, from the same cluster index.
        s3 = ns3._open()
        status, got = locate_http(n3.metrics_listen, s3.id, s3.token, ns3.handle, keys)
        assert status == 200, got
        assert got == {"num_hits": 6, "tiers": ["dram"] * 6, "nodes": [id1] * 4 + [id2] * 2,
                       "node_id": loc.node_id}
        assert ns3.lookup(keys).tiers == ["remote"] * 6, "Locate fetched nothing"
        # node 3 holds the first two itself once it has read them
        out = [np.zeros_like(d) for d in data[:2]]
        assert ns3.get(keys[:2], out) == 2
        assert ns3.locate(keys).nodes[:3] == [loc.node_id, loc.node_id, id1]
