"""The pod tier's counters on ``/metrics`` (docs/pod.md, "Operations"): every
``pod_*`` counter the store keeps is exported as ``ctxmem_pod_*_total``, with the value
Stats reports. Real processes: Redis and three services; node 2 fetches node 1's blocks."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

import ctxmem
from ctxmem_dpu.metrics import POD_COUNTER_HELP
from ctxmem_dpu.store.stats import COUNTERS
from ctxmem_tools.pod_launcher import LocalPod
from tests.pod.podtest import Clients, blocks, wait_for


def _metrics(listen: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{listen}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.name: float(s.value) for fam in text_string_to_metric_families(text)
            for s in fam.samples if not s.labels}


def test_every_pod_counter_is_exported() -> None:
    assert set(POD_COUNTER_HELP) == {c for c in COUNTERS if c.startswith("pod_")}


def test_pod_counters_are_on_metrics_with_the_stats_values(pod: LocalPod,
                                                           clients: Clients) -> None:
    n1, n2, _n3 = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 6), 16)
    data = blocks(6, 11)
    assert clients.put(n1.endpoint, keys, data) == 6
    wait_for(lambda: clients.hits(n2.endpoint, keys) == 6, what="publish")
    assert clients.get(n2.endpoint, keys, data) == 6  # fetched from node 1
    st1 = clients.stats_when(n1.endpoint, lambda st: st["pod_served_blocks"] >= 6)
    st2 = clients.stats(n2.endpoint)
    m1, m2 = _metrics(n1.metrics_listen), _metrics(n2.metrics_listen)
    assert st2["pod_fetch_blocks_peer"] == 6 and st1["pod_served_blocks"] == 6
    assert m2["ctxmem_pod_fetch_blocks_peer_total"] == 6
    assert m2["ctxmem_pod_fetch_bytes_peer_total"] == st2["pod_fetch_bytes_peer"] > 0
    assert m1["ctxmem_pod_served_blocks_total"] == 6
    assert m2["ctxmem_pod_lookup_hits_total"] >= 6
    # Every pod counter, on both nodes, as Stats says (nothing moves between the reads:
    # no traffic, and the publishers are idle once the entries were found).
    for name in POD_COUNTER_HELP:
        for st, m, node in ((st1, m1, "node1"), (st2, m2, "node2")):
            assert m[f"ctxmem_{name}_total"] == st[name], (node, name)
