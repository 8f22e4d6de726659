"""Block groups across a pod (issue 29, item 1): a group get on one node pulls every
member's blocks from the nodes that hold them, and is a whole miss when one member's
holder is dead, never a part of the group. Real processes: Redis and three services."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import ctxmem
from ctxmem_tools.pod_launcher import LocalPod
from ctxmem_tools.redis_server import RedisServer
from tests.kit import blocks, model_layout
from tests.pod.podtest import Clients, wait_for

KV = model_layout(num_layers=4)
STATE = model_layout(num_layers=1, num_kv_heads=1, head_dim=256)


def _members(clients: Clients, endpoint: str) -> tuple[ctxmem.Namespace, ctxmem.Namespace]:
    c = clients.client(endpoint)
    return (c.open_namespace(KV, model_id="hybrid", tags={"pool": "kv"}),
            c.open_namespace(STATE, model_id="hybrid", tags={"pool": "mamba"}))


def _group_get(clients: Clients, endpoint: str, keys: list[bytes],
               want: list[list[np.ndarray]]) -> int:
    kv, state = _members(clients, endpoint)
    group = clients.client(endpoint).open_group([kv, state])
    out = [[np.zeros(KV.block_nbytes, np.uint8) for _ in keys],
           [np.zeros(STATE.block_nbytes, np.uint8) for _ in keys]]
    n = group.get(keys, out)
    for member, expect in zip(out, want, strict=True):
        for i in range(n):
            assert np.array_equal(member[i], expect[i]), f"block {i}: wrong bytes"
    return n


def _group_hits(clients: Clients, endpoint: str, keys: list[bytes]) -> int:
    kv, state = _members(clients, endpoint)
    return clients.client(endpoint).open_group([kv, state]).lookup(keys).num_hits


def test_a_group_member_whose_holder_died_is_a_whole_miss(pod: LocalPod,
                                                          clients: Clients) -> None:
    n1, n2, n3 = pod.nodes
    # Control: a group stored on n1 is fetched whole by n3.
    ka = [bytes([0xA0, i]) * 16 for i in range(4)]
    da = [blocks(4, KV.block_nbytes, 1), blocks(4, STATE.block_nbytes, 2)]
    kv1, st1 = _members(clients, n1.endpoint)
    assert clients.client(n1.endpoint).open_group([kv1, st1]).put(ka, da).stored == 8
    wait_for(lambda: _group_hits(clients, n3.endpoint, ka) == 4, what="publish")
    assert _group_get(clients, n3.endpoint, ka, da) == 4
    # The case: n1 holds the KV member of these keys, n2 their state member.
    kb = [bytes([0xB0, i]) * 16 for i in range(4)]
    db = [blocks(4, KV.block_nbytes, 3), blocks(4, STATE.block_nbytes, 4)]
    assert kv1.put(kb, db[0]).stored == 4
    _kv2, st2 = _members(clients, n2.endpoint)
    assert st2.put(kb, db[1]).stored == 4
    wait_for(lambda: _group_hits(clients, n3.endpoint, kb) == 4, what="publish")
    n2.kill()  # the state member's holder dies
    assert _group_get(clients, n3.endpoint, kb, db) == 0  # a whole miss, never the KV part
    # The KV member alone is still served from n1: only the group is a miss.
    kv3, _st3 = _members(clients, n3.endpoint)
    out = [np.zeros(KV.block_nbytes, np.uint8) for _ in kb]
    assert kv3.get(kb, out) == 4
    assert all(np.array_equal(a, b) for a, b in zip(out, db[0], strict=True))
    assert clients.stats(n3.endpoint)["pod_fetch_bad"] == 0
    # Once the dead node's entries are ignored, Lookup counts no group hit either.
    wait_for(lambda: _group_hits(clients, n3.endpoint, kb) == 0, timeout_s=15,
             what="the dead holder's entries to be ignored")
    assert _group_get(clients, n3.endpoint, kb, db) == 0


def test_a_copy_adopted_between_group_members_is_not_leased(tmp_path: Path) -> None:
    """The window docs/pod.md named ("Pre-staging", deletes): a group Acquire on node B
    leases its members one after another and awaits the promotion of member 1's flash
    block in between. Meanwhile another get's pull on B, whose index entry was read before
    A's Delete and re-put returned (held after its fetch by a hook), adopts A's old bytes
    over the copy of member 2 the group's own check fetched. The group must not lease
    that copy: the sweep of unchecked copies runs again right before each member is
    looked at, so member 2 is a miss (the whole group a miss), never the old bytes. In
    process: two stores with their pod nodes, a real redis-server, B's flash a real file;
    the hooks hold the pull and the promotion (no timing)."""
    from ctxmem_common.config import config_from_dict
    from ctxmem_dpu.pod.node import PodNode
    from ctxmem_dpu.store import BlockStore
    from ctxmem_tools.launcher import free_port
    from tests.dpu.storekit import make_flash, payload, put, session
    from tests.kit import byte_layout

    master = bytes(range(32))
    state = byte_layout(4096)

    def cfg(url: str, node: str) -> Any:
        port = free_port()
        return config_from_dict({
            "dram": {"size": "4MiB", "slab_size": "1MiB"},
            "flash": {"slab_size": "1MiB"},
            "pod": {"enabled": True, "index_url": url, "node_id": node,
                    "advertise": f"127.0.0.1:{port}", "listen": f"127.0.0.1:{port}",
                    "pod_token": "t" * 32, "publish_interval_ms": 5}})

    async def run(url: str) -> None:
        ca, cb = cfg(url, "a"), cfg(url, "b")
        async with BlockStore(ca) as sa, \
                BlockStore(cb, make_flash(tmp_path / "b.flash"), master) as sb:
            na, nb = PodNode(ca, sa, master), PodNode(cb, sb, master)
            await na.start()
            await nb.start()
            try:
                (s_a, _kv_a), (s_b, kv_b) = session(sa), session(sb)
                _, st_a = sa.open_namespace(s_a, "model", state, {"pool": "state"})
                _, st_b = sb.open_namespace(s_b, "model", state, {"pool": "state"})
                assert st_a.digest == st_b.digest
                k = b"G" * 32
                # Member 1 (kv) is B's own block, on flash only: the group get promotes it.
                assert await put(sb, s_b, kv_b, {k: payload(7)}) == 1
                await sb.evict(kv_b, [k], "dram")
                assert sb.index[kv_b.digest][k].dram is None
                # Member 2 (state) is A's: B fetches it.
                old, new = payload(1, state.block_nbytes), payload(2, state.block_nbytes)
                assert await put(sa, s_a, st_a, {k: old}) == 1
                await na.publisher.flush()
                if "a" not in nb.index.live:
                    await nb._heartbeat_once()
                assert "a" in nb.index.live
                # Another get on B reads the index now (the old entry) and fetches the old
                # bytes, then is held before adopting them.
                fetched, go = asyncio.Event(), asyncio.Event()
                peer_fetch = nb.peer.fetch_into

                async def held_fetch(ns_digest: bytes, entries: Sequence[Any],
                                     views: Sequence[memoryview]) -> list[bool]:
                    got = await peer_fetch(ns_digest, entries, views)
                    fetched.set()
                    await go.wait()
                    return got

                nb.peer.fetch_into = held_fetch  # type: ignore[method-assign]
                other_get = asyncio.create_task(nb.fetch.pull(st_b, [k]))
                await asyncio.wait_for(fetched.wait(), 15)
                nb.peer.fetch_into = peer_fetch  # type: ignore[method-assign]
                # A deletes and re-puts other bytes; both returned (confirmed, published).
                assert await sa.delete(st_a, [k]) == 1
                await na.confirm_delete(st_a.digest, [k])
                assert await put(sa, s_a, st_a, {k: new}) == 1
                await na.publisher.flush()
                # The group get on B: its pull checks the index (the new entry) and adopts
                # the new bytes; while member 1 is promoted, the other get adopts the old.
                recheck = await nb.fetch.pull_group([kv_b, st_b], [k])
                assert bytes(sb.dram.view(sb.index[st_b.digest][k].dram, state.block_nbytes)  # type: ignore[arg-type]
                             ) == new
                promotion = sb._gets._promotion
                promote = promotion.promote_fitting

                async def promote_while_adopting(ns: Any, cold: Any, *args: Any) -> Any:
                    promotion.promote_fitting = promote  # type: ignore[method-assign]
                    assert ns is kv_b and cold, "member 1 is not being promoted"
                    go.set()
                    await asyncio.wait_for(other_get, 15)
                    assert bytes(sb.dram.view(sb.index[st_b.digest][k].dram,  # type: ignore[arg-type]
                                              state.block_nbytes)) == old, \
                        "the other get did not adopt over the group's copy"
                    return await promote(ns, cold, *args)

                promotion.promote_fitting = promote_while_adopting  # type: ignore[method-assign]
                unchecked = sb.counters["pod_copies_unchecked"]
                leases, tiers = await sb.acquire_group(s_b, [kv_b, st_b], [k], recheck)
                assert other_get.done() and promotion.promote_fitting == promote
                served = [bytes(sb.dram.view(b.dram, b.length)) for b in leases[1].blocks
                          if b.dram is not None]
                sb.release(s_b, [lease.id for lease in leases])
                assert old not in served, "the group leased bytes A deleted (re-put since)"
                assert served == [] and tiers == [], served  # a whole miss
                assert [len(lease.blocks) for lease in leases] == [0, 0]
                assert sb.counters["pod_copies_unchecked"] == unchecked + 1
            finally:
                await nb.close()
                await na.close()

    with RedisServer(tmp_path / "redis") as server:
        asyncio.run(run(server.url))
