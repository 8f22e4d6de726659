"""Stopping a pod node is quiet (issue 26 item 5): SIGTERM while peers hold peer-fetch
connections to it, and while clients hold sessions, ends with exit status 0 and no
traceback in its log. Before, each open peer connection logged an asyncio
``CancelledError`` traceback (the peer server cancels its connections at close, and
Python 3.11's stream server logs a cancelled connection task), so alerts on tracebacks
fired for an ordinary stop."""

from __future__ import annotations

import ctxmem
from ctxmem_tools.pod_launcher import LocalPod
from tests.pod.podtest import Clients, blocks, wait_for


def test_sigterm_with_open_peer_connections_logs_no_traceback(pod: LocalPod,
                                                              clients: Clients) -> None:
    holder, *fetchers = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 8), 16)
    data = blocks(len(keys), 11)
    assert clients.put(holder.endpoint, keys, data) == 8
    for node in fetchers:
        wait_for(lambda n=node: clients.hits(n.endpoint, keys) == 8, what="publish")
        assert clients.get(node.endpoint, keys, data) == 8  # over a peer connection
    served = clients.stats(holder.endpoint)["pod_served_blocks"]
    assert served >= 16, "the other nodes did not fetch from the holder"
    # The fetchers keep their peer connections to the holder; the clients keep their
    # sessions (and Hold calls) on every node.
    for node in pod.nodes:
        assert node.stop() == 0
        log = node.log_path.read_text(errors="replace")
        assert "Traceback" not in log and "CancelledError" not in log, \
            f"{node.log_path}:\n{log[-4000:]}"
