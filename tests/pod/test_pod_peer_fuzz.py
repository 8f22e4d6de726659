"""Issue 25: the peer port's new messages (hello, challenge proof, request with its
namespace proof), fuzzed against a real node: seeded cases of random bytes, truncated and
mutated handshakes, and, after a correct handshake, mutated requests. Each case closes
its connection once sent, so every one ends at once (no case waits out a timeout).

After the campaign: the node is alive and answers Stats; it served no block to any case
(none proved the namespace's key); its log has no traceback; a cross-node get through
another node is byte-exact."""

from __future__ import annotations

import random
from collections import Counter

import ctxmem
from ctxmem_common.keys import namespace_digest
from ctxmem_tools.fuzz.peer import KINDS, PeerTarget
from ctxmem_tools.pod_launcher import LocalPod
from tests.pod.peerkit import pod_keys
from tests.pod.podtest import LAYOUT, Clients, blocks, wait_for

CASES = 300


def test_the_peer_port_survives_fuzzed_handshakes_and_requests(
        pod: LocalPod, clients: Clients) -> None:
    """The cases are ``ctxmem fuzz``'s peer target's (:mod:`ctxmem_tools.fuzz.peer`)."""
    n1, n2, _ = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 3), 16)
    data = blocks(3, 41)
    assert clients.put(n1.endpoint, keys, data) == 3
    digest = namespace_digest("default", "m", LAYOUT)
    host, port = n1.config["pod"]["listen"].rsplit(":", 1)
    target = PeerTarget((host, int(port)), "node1", pod_keys(pod), digest, keys,
                        [d.tobytes()[:512] for d in data], random.Random(25))
    kinds = dict.fromkeys(KINDS, 0)
    labels = Counter[str]()
    for _ in range(CASES):
        label = target.case()  # raises when the node's challenge or proof is wrong
        kinds[label.split(":")[0]] += 1
        labels[label] += 1
    assert all(kinds.values()), kinds
    assert not any("conn_" in label for label in labels), labels  # every case connected
    assert target.unproven_served == 0, "a block went to a fuzz case"
    st = clients.stats(n1.endpoint)
    assert st.get("pod_served_blocks", 0) == 0, st
    assert st["pod_peer_refused"] >= 1
    wait_for(lambda: clients.hits(n2.endpoint, keys) == 3, what="publish")
    assert clients.get(n2.endpoint, keys, data) == 3  # byte-checked, through node 1
    assert "Traceback" not in n1.log()
