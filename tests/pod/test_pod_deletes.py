"""Issue 26 item 3: deletes reach every copy. Real service processes and a real
redis-server: blocks another node fetched are copies, served only while the cluster index
still names the entry they were fetched under, and the writer's Delete returns only once
the index no longer names its blocks. So once a Delete has returned, no node serves the
deleted bytes: not at once (every check below runs right after the call returns, no
waiting), not after a re-put of other bytes under the same keys, not after a restart,
not while the index is unreachable (docs/pod.md, "Deletes and re-puts across nodes")."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import redis

import ctxmem
from ctxmem_common.config import PodConfig
from ctxmem_common.podkeys import PodKeys
from ctxmem_dpu.pod.entries import RemoteEntry, node_prefix, pack_entry
from ctxmem_dpu.pod.index import ClusterIndex
from ctxmem_dpu.pod.publisher import Publisher
from ctxmem_dpu.pod.redis_conn import connect
from ctxmem_tools.pod_launcher import LocalPod
from ctxmem_tools.redis_server import RedisServer
from tests.pod.peerkit import index_names, pod_keys
from tests.pod.podtest import Clients, blocks, wait_for


# The two places that know how the index names a namespace's hash and its fields (raw
# namespace digest and block keys here; keyed hashes where the index is keyed).
def _values(pod: LocalPod, keys: list[bytes]) -> list[bytes | None]:
    """The index's values for ``keys`` of the namespace the pod tests use (the index
    names them by keyed hashes: tests/pod/peerkit.py)."""
    name, fields = index_names(pod_keys(pod), keys)
    r = redis.Redis.from_url(pod.redis.url)
    try:
        return r.hmget(name, fields)
    finally:
        r.close()


async def _value(index: ClusterIndex, ns_digest: bytes, key: bytes) -> bytes | None:
    """The value ``index``'s Redis holds for ``key`` of namespace ``ns_digest``."""
    r = connect(index.pod)
    try:
        return await r.hget(  # type: ignore[no-any-return]
            index.blocks_key(ns_digest), index.keys.index_fields(ns_digest, [key])[0])
    finally:
        await r.aclose()


def _copies_on(clients: Clients, pod: LocalPod, keys: list[bytes], data: list[np.ndarray],
               *nodes: int) -> None:
    """Put ``keys`` on node 1; each of ``nodes`` gets them (so holds fetched copies)."""
    n1 = pod.nodes[0]
    assert clients.put(n1.endpoint, keys, data) == len(keys)
    for i in nodes:
        ep = pod.nodes[i].endpoint
        wait_for(lambda ep=ep: clients.hits(ep, keys) == len(keys), what="publish")
        assert clients.get(ep, keys, data) == len(keys)
        st = clients.stats(ep)
        assert st["pod_fetch_blocks_peer"] >= len(keys)


def test_a_delete_reaches_every_fetched_copy_and_a_re_put_replaces_them(
        pod: LocalPod, clients: Clients) -> None:
    n1, n2, n3 = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 8), 16)
    old, new = blocks(8, 41), blocks(8, 42)
    _copies_on(clients, pod, keys, old, 1, 2)
    # The copies are local hits now (no fetch): a second get fetches nothing.
    before = clients.stats(n2.endpoint)["pod_fetch_blocks_peer"]
    assert clients.get(n2.endpoint, keys, old) == 8
    assert clients.stats(n2.endpoint)["pod_fetch_blocks_peer"] == before
    assert clients.ns(n1.endpoint).delete(keys) == 8
    for n in (n2, n3):  # right after the Delete returned: misses, no waiting
        assert clients.hits(n.endpoint, keys) == 0
        assert clients.get(n.endpoint, keys, old) == 0
    assert clients.stats(n2.endpoint)["pod_copies_dropped"] == 8
    # Other bytes under the same keys: never the old ones, the new ones once published.
    assert clients.put(n1.endpoint, keys, new) == 8
    for n in (n2, n3):
        assert clients.get(n.endpoint, keys, new) in range(9)  # byte-checked vs new
        wait_for(lambda n=n: clients.get(n.endpoint, keys, new) == 8, what="re-put")
    # Deleted again after the new copies were fetched: misses again at once.
    assert clients.ns(n1.endpoint).delete(keys) == 8
    assert clients.get(n2.endpoint, keys, new) == 0
    assert clients.get(n3.endpoint, keys, new) == 0


def test_a_delete_sent_to_another_node_drops_only_its_copy(pod: LocalPod,
                                                           clients: Clients) -> None:
    """The weaker rule that holds for a Delete not sent to the writer: it drops that
    node's copy (and its own blocks); the writer's block stays a hit everywhere."""
    n1, n2, _ = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 4), 16)
    data = blocks(4, 43)
    _copies_on(clients, pod, keys, data, 1)
    assert clients.ns(n2.endpoint).delete(keys) == 4  # n2's copies
    assert clients.hits(n2.endpoint, keys) == 4  # remote again: the writer's entry
    assert clients.get(n2.endpoint, keys, data) == 4
    assert clients.get(n1.endpoint, keys, data) == 4


def test_no_stale_copy_after_a_restart(pod: LocalPod, clients: Clients) -> None:
    """Copies stay in DRAM: an Evict does not write them to flash, so a restart of the
    node that fetched them cannot bring them back as its own blocks."""
    n1, n2, _ = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 6), 16)
    old, new = blocks(6, 44), blocks(6, 45)
    _copies_on(clients, pod, keys, old, 1)
    clients.ns(n2.endpoint).evict(keys)  # what the demoter does in time, now
    assert clients.ns(n1.endpoint).delete(keys) == 6
    clients.drop(n2.endpoint)
    n2.restart()
    assert clients.hits(n2.endpoint, keys) == 0
    assert clients.get(n2.endpoint, keys, old) == 0
    assert clients.put(n1.endpoint, keys, new) == 6
    wait_for(lambda: clients.get(n2.endpoint, keys, new) == 6, what="re-put")
    clients.drop(n2.endpoint)
    n2.restart(kill=True)
    assert clients.get(n2.endpoint, keys, new) in range(7)  # byte-checked vs new


def test_index_unreachable_copies_are_misses_own_blocks_served(pod: LocalPod,
                                                               clients: Clients) -> None:
    n1, n2, _ = pod.nodes
    theirs = ctxmem.chain_hashes(range(16 * 5), 16)
    mine = ctxmem.chain_hashes(range(5000, 5000 + 16 * 3), 16)
    data, own = blocks(5, 46), blocks(3, 47)
    _copies_on(clients, pod, theirs, data, 1)
    assert clients.put(n2.endpoint, mine, own) == 3
    pod.redis.stop()
    assert clients.hits(n2.endpoint, theirs) == 0
    assert clients.get(n2.endpoint, theirs, data) == 0
    assert clients.get(n2.endpoint, mine, own) == 3
    assert clients.get(n1.endpoint, theirs, data) == 5  # the writer serves its own
    pod.redis.start()  # empty: the nodes republish
    wait_for(lambda: clients.get(n2.endpoint, theirs, data) == 5, timeout_s=15,
             what="republish")


def test_a_delete_the_index_does_not_confirm_fails_and_is_retried(pod: LocalPod,
                                                                  clients: Clients) -> None:
    """The index frozen (SIGSTOP, it keeps its entries): the Delete deletes on the
    writer but answers UNAVAILABLE, saying to retry; the retry, once the index answers,
    returns, and then no node serves the bytes."""
    n1, n2, _ = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 4), 16)
    data = blocks(4, 48)
    _copies_on(clients, pod, keys, data, 1)
    proc = pod.redis.proc
    assert proc is not None
    proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(ctxmem.Unavailable, match="cluster index did not confirm"):
            clients.ns(n1.endpoint).delete(keys)
    finally:
        proc.send_signal(signal.SIGCONT)
    assert clients.get(n1.endpoint, keys, data) == 0  # deleted on the writer
    assert clients.ns(n1.endpoint).delete(keys) == 0  # the retry: confirmed
    assert clients.hits(n2.endpoint, keys) == 0
    assert clients.get(n2.endpoint, keys, data) == 0


def test_copies_are_never_republished_and_outlive_the_writers_republish(
        pod: LocalPod, clients: Clients) -> None:
    """The index restarted empty: every node republishes what it holds, node 2 not its
    copies (else node 1's Delete, which removes only node 1's entries, would leave them
    named). Node 1 republishes under a new epoch: node 2's copies are the same blocks and
    stay hits without a new fetch."""
    n1, n2, n3 = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 6), 16)
    data = blocks(6, 50)
    _copies_on(clients, pod, keys, data, 1)
    own = ctxmem.chain_hashes(range(7000, 7000 + 16), 16)
    assert clients.put(n2.endpoint, own, data[:1]) == 1
    probe = ctxmem.chain_hashes(range(8000, 8000 + 16), 16)  # node 1's, never fetched
    assert clients.put(n1.endpoint, probe, data[:1]) == 1
    pod.redis.stop()
    pod.redis.start()  # empty
    # n2's republish is one pipeline (7 updates): its own block's entry, and its copies'
    # if it republished them; node 1's entries too.
    wait_for(lambda: None not in _values(pod, [*own, *keys]), timeout_s=15,
             what="the republish")
    assert all(v.startswith(node_prefix("node1"))
               for v in _values(pod, keys)), "a copy was republished"
    # Node 2 sees node 1 alive again (a Lookup of a key that is no copy: the copies are
    # not looked at before the next line).
    wait_for(lambda: clients.hits(n2.endpoint, probe) == 1, timeout_s=15, what="liveness")
    fetched = clients.stats(n2.endpoint)["pod_fetch_blocks_peer"]
    assert clients.get(n2.endpoint, keys, data) == 6
    assert clients.stats(n2.endpoint)["pod_fetch_blocks_peer"] == fetched  # kept
    assert clients.ns(n1.endpoint).delete(keys) == 6
    assert clients.get(n2.endpoint, keys, data) == 0
    assert clients.get(n3.endpoint, keys, data) == 0


def test_copies_of_a_dead_holder_are_misses(pod: LocalPod, clients: Clients) -> None:
    """A copy is served only while the index names its entry: once the holder's entries
    are ignored (it died), the copies fetched from it are misses too."""
    n1, n2, _ = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 4), 16)
    data = blocks(4, 49)
    _copies_on(clients, pod, keys, data, 1)
    n1.kill()
    wait_for(lambda: clients.hits(n2.endpoint, keys) == 0, timeout_s=15,
             what="the dead holder's entries to be ignored")
    assert clients.get(n2.endpoint, keys, data) == 0


def test_a_re_put_over_a_pending_removal_is_published_at_once(tmp_path: Path) -> None:
    """The publisher on its own, against a real redis-server: a key re-put while its
    earlier removal is still pending is sent by ``send_urgent`` (what a Commit awaits),
    a Delete's ``send_now`` drops this node's entry even when nothing is pending, and a
    backlog overflow drops pending entries (republished in full) but keeps removals."""
    ns, k = bytes(range(16)), b"k" * 32
    others = [bytes([i]) * 32 for i in range(4)]

    async def run(url: str) -> None:
        pod = PodConfig(enabled=True, index_url=url, node_id="me", advertise="127.0.0.1:1",
                        publish_backlog=4)
        index = ClusterIndex(pod, connect(pod), PodKeys(bytes(range(32))))
        held: dict[bytes, RemoteEntry] = {}
        pub = Publisher(pod, index, lambda: [(ns, key, e) for key, e in held.items()],
                        Counter())
        old, new = RemoteEntry("me", "dram", 1, 4096, 11), RemoteEntry("me", "dram", 2, 4096, 22)
        try:
            pub.note(ns, k, old)
            await pub.flush()
            assert await _value(index, ns, k) == pack_entry(old)
            pub.note(ns, k, None)  # evicted: the removal pending
            await pub.send_urgent(ns, [k])  # not re-put: nothing urgent, nothing sent
            assert await _value(index, ns, k) == pack_entry(old)
            pub.note(ns, k, new)  # re-put before the index confirmed the removal
            await pub.send_urgent(ns, [k])
            assert await _value(index, ns, k) == pack_entry(new)
            assert pub.backlog == 0
            await pub.send_now(ns, [k])  # a Delete: nothing pending, the entry goes
            assert await _value(index, ns, k) is None
            # Overflow: the entries pending are dropped, the removal is kept.
            pub.note(ns, k, old)
            await pub.flush()
            pub.note(ns, k, None)
            for key in others:
                held[key] = new
                pub.note(ns, key, new)
            assert pub.backlog <= 4
            await pub.flush()  # the removal, and the full republish
            assert await _value(index, ns, k) is None
            assert [await _value(index, ns, o) for o in others] == [pack_entry(new)] * 4
        finally:
            await index.close()

    with RedisServer(tmp_path / "redis") as server:
        asyncio.run(run(server.url))


def test_a_commit_re_putting_an_evicted_key_is_published_before_it_returns(
        tmp_path: Path) -> None:
    """A store and its pod node in process (no flash: DRAM evicts by dropping), against a
    real redis-server, batches held back (``publish_interval_ms`` of a minute): key K is
    published, evicted as its last copy (the removal pending, the index still naming the
    old block), then put again with other bytes: when the Commit returns, the index names
    the new block (the store's ``commit_hook``); other keys wait for their batch."""
    from ctxmem_common.config import config_from_dict
    from ctxmem_dpu.pod.entries import unpack_entry
    from ctxmem_dpu.pod.node import PodNode
    from ctxmem_dpu.store import BlockStore
    from ctxmem_tools.launcher import free_port
    from tests.dpu.storekit import payload, put, session

    async def run(url: str) -> None:
        port = free_port()
        cfg = config_from_dict({
            "dram": {"size": "4MiB", "slab_size": "1MiB"},
            "pod": {"enabled": True, "index_url": url, "node_id": "me",
                    "advertise": f"127.0.0.1:{port}", "listen": f"127.0.0.1:{port}",
                    "pod_token": "t" * 32, "publish_interval_ms": 60_000}})
        async with BlockStore(cfg) as store:
            node = PodNode(cfg, store, bytes(range(32)))
            await node.start()
            try:
                s, ns = session(store)
                k = b"K" * 32
                await node.publisher.flush()
                assert await put(store, s, ns, {k: payload(1)}) == 1
                await node.publisher.flush()
                old = await _value(node.index, ns.digest, k)
                assert old is not None
                others = {bytes([i, 200]) * 16: payload(i + 2) for i in range(80)}
                for part in (dict(list(others.items())[:40]), dict(list(others.items())[40:])):
                    assert await put(store, s, ns, part) == 40  # DRAM holds 64: K dropped
                assert k not in store.index[ns.digest]
                assert await _value(node.index, ns.digest, k) == old  # removal pending
                assert await put(store, s, ns, {k: payload(99)}) == 1
                now = await _value(node.index, ns.digest, k)
                e_old, e_now = unpack_entry(old), unpack_entry(now)
                assert e_old is not None and e_now is not None
                assert e_now.seq == store.index[ns.digest][k].seq != e_old.seq
                assert await _value(node.index, ns.digest, bytes([79, 200]) * 16) is None
                # Again with the index frozen at the re-put: the Commit fails, the block
                # is not stored; the put retried once the index answers is confirmed.
                k2 = b"L" * 32
                assert await put(store, s, ns, {k2: payload(3)}) == 1
                await node.publisher.flush()
                old2 = await _value(node.index, ns.digest, k2)
                more = {bytes([i, 201]) * 16: payload(i + 200) for i in range(80)}
                for part in (dict(list(more.items())[:40]), dict(list(more.items())[40:])):
                    assert await put(store, s, ns, part) == 40
                assert k2 not in store.index[ns.digest]
                assert server.proc is not None
                server.proc.send_signal(signal.SIGSTOP)
                try:
                    with pytest.raises(ctxmem.Unavailable, match="not stored"):
                        await put(store, s, ns, {k2: payload(98)})
                finally:
                    server.proc.send_signal(signal.SIGCONT)
                assert k2 not in store.index[ns.digest]
                # (The index may have applied the timed-out HSET once it resumed: then it
                # names a block this node no longer has, a miss for peers, until the
                # removal now pending reaches it.)
                assert old2 is not None
                assert await put(store, s, ns, {k2: payload(98)}) == 1
                e2 = unpack_entry(await _value(node.index, ns.digest, k2))
                assert e2 is not None and e2.seq == store.index[ns.digest][k2].seq
            finally:
                await node.close()

    with RedisServer(tmp_path / "redis") as server:
        asyncio.run(run(server.url))
