"""Issue 25 item 4: the pod peer-fetch port is bounded before a peer proves itself.

A pod of two real service processes and a real redis-server on loopback. 300
connections to node 1's peer-fetch port that never send a hello (reopened as they are
cut) used to fill its connection cap, counted at accept: every cross-node get of a
tenant through node 2 then missed (0/8). Now the connections without a proven hello are
capped apart (in total and per peer IP, the oldest closed to admit a new one) and cut
at ``pod.hello_timeout_s``, so node 2's fetches are served during the flood.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import ctxmem
from ctxmem_common.netaddr import split_hostport
from ctxmem_tools.pod_launcher import LocalPod
from tests.adversary.floods import Flood, established
from tests.pod.podtest import LAYOUT, Clients, blocks, wait_for

ROUNDS = 8


def test_a_silent_flood_on_the_peer_port_leaves_cross_node_gets_served(
        tmp_path: Path) -> None:
    with LocalPod(tmp_path / "pod", 2, pod={"hello_timeout_s": 3.0}) as pod:
        n1, n2 = pod.nodes
        host, port = split_hostport(n1.config["pod"]["listen"], "pod.listen")
        clients = Clients()
        served = held = 0
        flood = Flood(host, port, 300, source="127.0.0.2", reopen_s=1.0, max_s=60)
        try:
            with flood:
                wait_for(lambda: flood.opened >= 300, 10, "the flood")
                for i in range(ROUNDS):
                    held = max(held, established(port, "127.0.0.2"))
                    keys = ctxmem.chain_hashes(range(1000 * i, 1000 * i + 16), 16)
                    data = blocks(1, i)
                    assert clients.put(n1.endpoint, keys, data) == 1
                    ns2 = clients.ns(n2.endpoint)
                    wait_for(lambda: ns2.lookup(keys).num_hits == 1,  # noqa: B023
                             what="publish")
                    out = [np.zeros(LAYOUT.block_nbytes, np.uint8)]
                    if ns2.get(keys, out) == 1:
                        assert np.array_equal(out[0], data[0]), "wrong bytes"
                        served += 1
        finally:
            clients.close()
        print(f"\nflood figures: held_by_service_max={held} attacker_open_max="
              f"{flood.held_max} opened={flood.opened} "
              f"cut={flood.cut} cross-node gets {served}/{ROUNDS}")
        assert served == ROUNDS, f"{served} of {ROUNDS} cross-node gets served under a flood"
