"""Issue 28 item 4: pod-aware pre-staging. A Prefetch on one node pulls the request's
remote blocks into that node's DRAM in the background, at most
``pod.prefetch_max_blocks_per_tenant`` blocks of one tenant at a time (the rest refused,
counted); the get that follows is served from DRAM with no peer fetch, and its Acquire
reports the block's source as ``remote→dram`` (a block fetched by the get itself:
``remote``; a local block: ``dram``). A prefetched copy obeys the pod's delete rule like
any copy, also when it lands while a get's index check is in flight (docs/pod.md,
"Pre-staging"). Real service processes and a real redis-server (``LocalPod``), and for the
interleavings two stores with their pod nodes in one process against a real
redis-server."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

import ctxmem
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.protoconv import TIER_DRAM, TIER_REMOTE, TIER_REMOTE_DRAM, tier_from_pb
from ctxmem_tools.pod_launcher import LocalPod
from ctxmem_tools.redis_server import RedisServer
from tests.pod.podtest import Clients, blocks, wait_for

PREFETCH = ("pod_prefetch_admitted_blocks", "pod_prefetch_done_blocks",
            "pod_prefetch_refused_blocks")


def _sources(ns: ctxmem.Namespace, keys: Sequence[bytes]) -> list[str]:
    """One Acquire of ``keys`` over gRPC (released at once): each leased block's source
    tier as the service reports it (the shim's get does not surface it)."""
    client = ns.client

    def op(s: object) -> list[str]:
        sid = s.id  # type: ignore[attr-defined]
        r = client._rpc("Acquire", pb.AcquireRequest(session_id=sid,
                                                     namespace_handle=ns.handle, keys=keys))
        client._rpc("Release", pb.ReleaseRequest(session_id=sid, lease_ids=[r.lease_id]))
        return [tier_from_pb(t) for t in r.source_tiers]

    return ns._retrying(op)


def _get(ns: ctxmem.Namespace, keys: list[bytes], data: list[np.ndarray]) -> int:
    """Get ``keys``, every delivered block checked byte for byte; returns the hits."""
    out = [np.zeros(d.nbytes, np.uint8) for d in data]
    n = ns.get(keys, out)
    for i in range(n):
        assert np.array_equal(out[i], data[i]), f"block {i}: wrong bytes"
    return n


def _delta(clients: Clients, endpoint: str, before: dict[str, float], *names: str
           ) -> list[int]:
    st = clients.stats(endpoint)
    return [int(st[n] - before[n]) for n in names]


def test_a_prefetched_remote_block_is_read_from_dram_as_remote_to_dram(
        pod: LocalPod, clients: Clients) -> None:
    n1, n2, _ = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 6), 16)
    data = blocks(6, 61)
    assert clients.put(n1.endpoint, keys, data) == 6
    wait_for(lambda: clients.hits(n2.endpoint, keys) == 6, what="publish")
    ns2 = clients.ns(n2.endpoint)
    before = clients.stats(n2.endpoint)
    ns2.prefetch(keys)
    st = clients.stats_when(n2.endpoint, lambda st: st["pod_prefetch_done_blocks"]
                            - before["pod_prefetch_done_blocks"] >= 6)
    assert [int(st[n] - before[n]) for n in PREFETCH] == [6, 6, 0]
    assert st["pod_fetch_blocks_peer"] - before["pod_fetch_blocks_peer"] == 6
    # The get: all six from this node's DRAM, none fetched now, each reported remote→dram.
    assert ns2.tiers(keys) == [TIER_DRAM] * 6
    assert _sources(ns2, keys) == [TIER_REMOTE_DRAM] * 6
    assert _delta(clients, n2.endpoint, before, "pod_fetch_blocks_peer", "hits_remote_dram",
                  "hits_remote", "hits_dram") == [6, 6, 0, 0]
    # Read again: a DRAM hit now; and the bytes are the writer's.
    assert _sources(ns2, keys) == [TIER_DRAM] * 6
    assert _get(ns2, keys, data) == 6
    # Without a Prefetch a get fetches on demand and says so: remote.
    more = ctxmem.chain_hashes(range(900, 900 + 16 * 3), 16)
    assert clients.put(n1.endpoint, more, data[:3]) == 3
    wait_for(lambda: clients.hits(n2.endpoint, more) == 3, what="publish")
    assert _sources(ns2, more) == [TIER_REMOTE] * 3
    assert _delta(clients, n2.endpoint, before, "pod_fetch_blocks_peer", "hits_remote",
                  "hits_remote_dram") == [9, 3, 6]


def test_the_tenant_bound_refuses_past_its_limit_and_spares_other_tenants(
        tmp_path: Path, clients: Clients) -> None:
    """Tenant x's blocks sit on node 1, frozen (SIGSTOP) while x's prefetches on node 2
    pull from it: with a bound of 4, a Prefetch of 6 remote blocks admits 4 and refuses 2,
    a second one (2 more) finds x at its bound and is refused whole; tenant y (its blocks
    on node 3) prefetches and gets meanwhile as if x were idle. Once node 1 runs again,
    x's 4 are in DRAM (remote→dram) and the refused ones are fetched by the get
    (remote)."""
    with LocalPod(tmp_path / "pod", 3, pod={
            "prefetch_max_blocks_per_tenant": 4, "fetch_timeout_s": 60.0,
            "connect_timeout_s": 30.0, "node_ttl_s": 60.0}) as pod:
        n1, n2, n3 = pod.nodes
        kx = ctxmem.chain_hashes(range(16 * 9), 16)
        ky = ctxmem.chain_hashes(range(5000, 5000 + 16 * 5), 16)
        dx, dy = blocks(9, 62), blocks(5, 63)
        x1, x2 = clients.ns(n1.endpoint, tenant="x"), clients.ns(n2.endpoint, tenant="x")
        y3, y2 = clients.ns(n3.endpoint, tenant="y"), clients.ns(n2.endpoint, tenant="y")
        assert x1.put(kx, dx).stored == 9 and y3.put(ky, dy).stored == 5
        wait_for(lambda: x2.lookup(kx).num_hits == 9 and y2.lookup(ky).num_hits == 5,
                 what="publish")
        # A connection from node 2 to node 1 exists before node 1 freezes (kx[8]).
        assert _get(x2, kx[8:], dx[8:]) == 1
        before = clients.stats(n2.endpoint)
        proc = n1.proc
        assert proc is not None
        proc.send_signal(signal.SIGSTOP)
        try:
            x2.prefetch(kx[:6])
            clients.stats_when(n2.endpoint, lambda st: st["pod_prefetch_refused_blocks"]
                               - before["pod_prefetch_refused_blocks"] >= 2)
            st = clients.stats(n2.endpoint)
            # x: 4 admitted and still in flight (node 1 is frozen), 2 refused.
            assert [int(st[n] - before[n]) for n in PREFETCH] == [4, 0, 2]
            # x at its bound: the next Prefetch is refused whole, the index not asked.
            x2.prefetch(kx[6:8])
            assert clients.stats(n2.endpoint)["pod_prefetch_refused_calls"] \
                - before["pod_prefetch_refused_calls"] == 1  # the RPC counts it before answering
            # y meanwhile: its Prefetch is admitted in full and lands, its gets are served.
            y2.prefetch(ky[:2])
            st = clients.stats_when(n2.endpoint, lambda st: st["pod_prefetch_done_blocks"]
                                    - before["pod_prefetch_done_blocks"] >= 2)
            assert [int(st[n] - before[n]) for n in PREFETCH] == [6, 2, 2]
            assert _sources(y2, ky) == [TIER_REMOTE_DRAM] * 2 + [TIER_REMOTE] * 3
            assert _get(y2, ky, dy) == 5
        finally:
            proc.send_signal(signal.SIGCONT)
        st = clients.stats_when(n2.endpoint, lambda st: st["pod_prefetch_done_blocks"]
                                - before["pod_prefetch_done_blocks"] >= 6, timeout_s=60)
        assert [int(st[n] - before[n]) for n in PREFETCH] == [6, 6, 2]
        fetched = st["pod_fetch_blocks_peer"]
        assert _sources(x2, kx[:4]) == [TIER_REMOTE_DRAM] * 4
        assert clients.stats(n2.endpoint)["pod_fetch_blocks_peer"] == fetched
        assert _sources(x2, kx[:8]) == [TIER_DRAM] * 4 + [TIER_REMOTE] * 4
        assert clients.stats(n2.endpoint)["pod_fetch_blocks_peer"] == fetched + 4
        assert _get(x2, kx, dx) == 9


def test_a_prefetched_copy_obeys_deletes_and_re_puts(pod: LocalPod,
                                                     clients: Clients) -> None:
    """Blocks node 2 pre-staged are misses right after node 1's Delete returns; after a
    re-put of other bytes, a Prefetch stages the new ones and only they are served."""
    n1, n2, _ = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 5), 16)
    old, new = blocks(5, 64), blocks(5, 65)
    ns1, ns2 = clients.ns(n1.endpoint), clients.ns(n2.endpoint)
    assert clients.put(n1.endpoint, keys, old) == 5
    wait_for(lambda: ns2.lookup(keys).num_hits == 5, what="publish")
    before = clients.stats(n2.endpoint)
    ns2.prefetch(keys)
    clients.stats_when(n2.endpoint, lambda st: st["pod_prefetch_done_blocks"]
                       - before["pod_prefetch_done_blocks"] >= 5)
    assert ns2.tiers(keys) == [TIER_DRAM] * 5  # staged
    assert ns1.delete(keys) == 5
    assert ns2.lookup(keys).num_hits == 0  # right after the Delete returned
    assert _get(ns2, keys, old) == 0
    assert clients.put(n1.endpoint, keys, new) == 5
    wait_for(lambda: ns2.lookup(keys).num_hits == 5, what="the re-put's publish")
    ns2.prefetch(keys)
    clients.stats_when(n2.endpoint, lambda st: st["pod_prefetch_done_blocks"]
                       - before["pod_prefetch_done_blocks"] >= 10)
    assert _sources(ns2, keys) == [TIER_REMOTE_DRAM] * 5
    assert _get(ns2, keys, new) == 5


@pytest.mark.parametrize("then", ["deleted", "re-put"])
def test_a_copy_prefetched_while_a_gets_check_is_in_flight_is_not_served(
        tmp_path: Path, then: str) -> None:
    """The interleaving a Prefetch makes possible, pinned down in process: node B's
    Prefetch has fetched A's block (its entry read before A's Delete) and adopts it while
    a get on B, sent after the Delete (and in the second case a re-put of other bytes)
    returned, awaits its own index check. That get must not serve the adopted copy: its
    check never saw it (deleted: a miss; re-put: the new bytes, fetched by the get)."""
    from ctxmem_common.config import config_from_dict
    from ctxmem_dpu.pod.node import PodNode
    from ctxmem_dpu.store import BlockStore
    from ctxmem_tools.launcher import free_port
    from tests.dpu.storekit import payload, put, session

    master = bytes(range(32))

    def cfg(url: str, node: str) -> object:
        port = free_port()
        return config_from_dict({
            "dram": {"size": "4MiB", "slab_size": "1MiB"},
            "pod": {"enabled": True, "index_url": url, "node_id": node,
                    "advertise": f"127.0.0.1:{port}", "listen": f"127.0.0.1:{port}",
                    "pod_token": "t" * 32, "publish_interval_ms": 5}})

    async def run(url: str) -> None:
        ca, cb = cfg(url, "a"), cfg(url, "b")
        async with BlockStore(ca) as sa, BlockStore(cb) as sb:  # type: ignore[arg-type]
            na = PodNode(ca, sa, master)  # type: ignore[arg-type]
            nb = PodNode(cb, sb, master)  # type: ignore[arg-type]
            await na.start()
            await nb.start()
            try:
                (s_a, ns_a), (s_b, ns_b) = session(sa), session(sb)
                assert ns_a.digest == ns_b.digest
                k = b"K" * 32
                assert await put(sa, s_a, ns_a, {k: payload(1)}) == 1
                await na.publisher.flush()
                if "a" not in nb.index.live:
                    await nb._heartbeat_once()
                assert "a" in nb.index.live
                # B's Prefetch fetches the old block, then holds before adopting it.
                fetched, go = asyncio.Event(), asyncio.Event()
                peer_fetch = nb.peer.fetch_into

                async def held_fetch(ns_digest: bytes, entries: Sequence[object],
                                     views: Sequence[memoryview]) -> list[bool]:
                    got = await peer_fetch(ns_digest, entries, views)  # type: ignore[arg-type]
                    fetched.set()
                    await go.wait()
                    return got

                nb.peer.fetch_into = held_fetch  # type: ignore[assignment,method-assign]
                nb.prefetch(ns_b, [k])
                await asyncio.wait_for(fetched.wait(), 15)
                nb.peer.fetch_into = peer_fetch  # type: ignore[method-assign]
                assert await sa.delete(ns_a, [k]) == 1
                await na.confirm_delete(ns_a.digest, [k])  # what the Delete RPC awaits
                if then == "re-put":
                    assert await put(sa, s_a, ns_a, {k: payload(2)}) == 1
                    await na.publisher.flush()
                # The get on B: while its index check is in flight, the Prefetch adopts.
                lookup = nb.fetch.lookup

                async def lookup_while_adopting(ns_digest: bytes, keys: Sequence[bytes]
                                                ) -> list[bytes | None]:
                    got = await lookup(ns_digest, keys)
                    go.set()
                    await asyncio.wait_for(asyncio.gather(*nb._tasks), 15)
                    assert k in sb.index[ns_b.digest], "the prefetch did not adopt"
                    return got

                nb.fetch.lookup = lookup_while_adopting  # type: ignore[method-assign]
                await nb.fetch.pull(ns_b, [k])  # what the Acquire RPC does, then leases
                lease, sources = await sb.acquire(s_b, ns_b, [k])
                nb.fetch.lookup = lookup  # type: ignore[method-assign]
                served = [bytes(sb.dram.view(b.dram, b.length)) for b in lease.blocks
                          if b.dram is not None]
                sb.release(s_b, [lease.id])
                if then == "deleted":
                    assert served == [] and sources == []
                    assert sb.counters["pod_copies_unchecked"] == 1
                else:
                    assert served == [payload(2)] and sources == [TIER_REMOTE]
                assert sb.counters["pod_prefetch_done_blocks"] == 1
            finally:
                await nb.close()
                await na.close()

    with RedisServer(tmp_path / "redis") as server:
        asyncio.run(run(server.url))


def test_the_vllm_connectors_lookahead_stages_remote_blocks(pod: LocalPod,
                                                            clients: Clients) -> None:
    """The engines' lookahead needs no change: the vLLM connector's scheduler side sends
    Prefetch for a new request's blocks (``on_new_request``), and on a pod node that
    pulls the ones another node holds; the load that follows reads them from DRAM."""
    from ctxmem.integrations.vllm_core import SchedulerCore
    from ctxmem.integrations.vllm_types import Namespaces, NamespaceSpec, block_keys
    from tests.pod.podtest import LAYOUT

    n1, n2, _ = pod.nodes
    spec = NamespaceSpec(model_id="tiny", tenant="default", tp_size=1,
                         tags={"engine": "vllm"}, layout_for_rank=lambda _rank: LAYOUT)
    hashes = ctxmem.chain_hashes(range(16 * 4), 16)
    keys = block_keys(hashes)
    data = blocks(4, 66)
    ns1 = Namespaces(clients.client(n1.endpoint), spec).get(0, None)
    ns2 = Namespaces(clients.client(n2.endpoint), spec).get(0, None)
    assert ns1.put(keys, data).stored == 4
    wait_for(lambda: ns2.lookup(keys).num_hits == 4, what="publish")
    before = clients.stats(n2.endpoint)
    sched = SchedulerCore(clients.client(n2.endpoint), spec, 16)
    try:
        sched.on_new_request("req-1", hashes, None)
        st = clients.stats_when(n2.endpoint, lambda st: st["pod_prefetch_done_blocks"]
                                - before["pod_prefetch_done_blocks"] >= 4)
    finally:
        sched.shutdown()
    assert [int(st[n] - before[n]) for n in PREFETCH] == [4, 4, 0]
    assert _sources(ns2, keys) == [TIER_REMOTE_DRAM] * 4
    assert _get(ns2, keys, data) == 4
