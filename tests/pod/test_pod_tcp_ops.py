"""The TCP control fast path in a pod: Lookup and Acquire need the cluster's index, so a
pod node does not offer it (Health ``tcp_ops`` false), answers a LOOKUP or ACQUIRE frame
UNSUPPORTED, and a client that sends them anyway falls back to gRPC with the same
answers (remote hits found, fetched byte-exact)."""

from __future__ import annotations

import numpy as np
import pytest

import ctxmem
from ctxmem.transport.base import FastPathUnsupported
from ctxmem.transport.tcp import TcpChannel
from ctxmem_common.shm_ops import decode_allocate_reply, encode_commit, encode_keys_request
from ctxmem_common.wire import SHM_OP_ACQUIRE, SHM_OP_ALLOCATE, SHM_OP_COMMIT, SHM_OP_LOOKUP
from ctxmem_tools.pod_launcher import LocalPod
from ctxmem_tools.rawclient import RawSession
from tests.pod.podtest import LAYOUT, Clients, blocks, wait_for


def test_pod_nodes_answer_lookup_and_acquire_unsupported_and_clients_use_grpc(
        pod: LocalPod, clients: Clients) -> None:
    n1, n2, _ = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 6), 16)
    data = blocks(6, 5)
    with ctxmem.Client(n1.endpoint, transport="tcp") as c1:
        assert not c1.health().tcp_ops, "a pod node offered the TCP fast path"
        assert c1.open_namespace(LAYOUT, model_id="m").put(keys, data).stored == 6
    with ctxmem.Client(n2.endpoint, transport="tcp") as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        ch = c._sessions["default"].channel
        assert isinstance(ch, TcpChannel) and not ch.ops
        ch.ops = True  # a client that sends the ops anyway: UNSUPPORTED, then gRPC
        wait_for(lambda: ns.lookup(keys).num_hits == 6, what="publish")
        assert ns.tiers(keys) == ["remote"] * 6
        out = [np.zeros_like(d) for d in data]
        assert ns.get(keys, out) == 6
        assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
    st = clients.stats(n2.endpoint)
    assert st["tcp_ops_lookup"] >= 2 and st["tcp_ops_acquire"] >= 1  # answered UNSUPPORTED
    assert st["pod_fetch_blocks_peer"] == 6
    with RawSession(n2.endpoint, LAYOUT, transport="tcp", model_id="m") as r:
        assert isinstance(r.data, TcpChannel)
        for op, lookup in ((SHM_OP_LOOKUP, True), (SHM_OP_ACQUIRE, None)):
            with pytest.raises(FastPathUnsupported):
                r.data.call(op, encode_keys_request(r.handle, b"".join(keys), 32, lookup))
        # Allocate and Commit need only this node: served on the fast path in a pod too
        fresh = ctxmem.chain_hashes(range(16), 16, salt=b"fresh")
        a = decode_allocate_reply(r.data.call(SHM_OP_ALLOCATE, encode_keys_request(
            r.handle, b"".join(fresh), 32)), 1, LAYOUT.block_nbytes)
        assert a.exists == [False]
        r.data.call(SHM_OP_COMMIT, [encode_commit(a.allocation_id, [], abort=True)])
