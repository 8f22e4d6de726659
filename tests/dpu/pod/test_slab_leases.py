"""Slab leases against a real redis-server: one holder per slab at a time, every grant's
fencing epoch above all earlier ones, renewal and release only by the current holder
(a stateful property test over random interleavings of three nodes, expiries included),
and the index unreachable answering LeaseError within the bound."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxmem_dpu.pod.slab_leases import MARGIN_FRACTION, LeaseError, SlabLeases

UUID = bytes(range(16))
NODES = ("a", "b", "c")
OPS = st.lists(st.tuples(st.sampled_from(["grant", "renew", "release", "expire"]),
                         st.sampled_from(NODES), st.integers(0, 2)), max_size=40)


async def _run(url: str, ops: list[tuple[str, str, int]], prefix: str,
               cluster: bool = False) -> None:
    client: aioredis.Redis | aioredis.RedisCluster = (
        aioredis.RedisCluster.from_url(url) if cluster else aioredis.Redis.from_url(url))
    try:
        leases = {n: SlabLeases(client, n, 30.0, prefix=prefix) for n in NODES}
        holder: dict[int, tuple[str, int]] = {}  # the model: who holds each slab
        top: dict[int, int] = {}  # highest epoch ever granted per slab
        for op, n, slab in ops:
            key = f"{prefix}:{{{UUID.hex()}}}:{slab}:lease"
            if op == "grant":
                got = await leases[n].grant(UUID, slab)
                cur = holder.get(slab)
                if cur is not None and cur[0] != n:
                    assert got is None, f"{n} granted slab {slab} held by {cur}"
                    continue
                assert got is not None
                if cur is not None:  # its own live lease: extended, same epoch
                    assert got[0] == cur[1]
                else:
                    assert got[0] > top.get(slab, 0), "epoch did not grow"
                    top[slab] = got[0]
                holder[slab] = (n, got[0])
            elif op == "renew":
                cur = holder.get(slab)
                epoch = cur[1] if cur is not None and cur[0] == n else top.get(slab, 0)
                ok = await leases[n].renew(UUID, slab, epoch)
                if cur is None and epoch > 0:  # lost by the index: re-created
                    holder[slab] = (n, epoch)
                    assert ok is not None
                else:
                    assert (ok is not None) == (cur == (n, epoch))
            elif op == "release":
                cur = holder.get(slab)
                await leases[n].release(UUID, slab, top.get(slab, 0))
                if cur == (n, top.get(slab, 0)):
                    holder.pop(slab)
            else:  # the lease lapses (as if its TTL ran out)
                await client.delete(key)
                holder.pop(slab, None)
            live = await leases["a"].holders(UUID, [0, 1, 2])
            assert live == [holder.get(s) for s in range(3)]
    finally:
        await client.aclose()


def test_one_holder_and_growing_epochs(redis_server: Any) -> None:
    runs = iter(range(10**6))

    @settings(max_examples=60, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(OPS)
    def check(ops: list[tuple[str, str, int]]) -> None:
        asyncio.run(_run(redis_server.url, ops, f"t{next(runs)}"))

    check()


def test_leases_on_a_redis_cluster(redis_cluster: Any) -> None:
    """The same property on a 3-master Redis Cluster: the grant script's two keys and the
    batched holders read stay in the device's slot (its hash tag), while different devices
    land on different masters."""
    runs = iter(range(10**6))
    owners = {redis_cluster.owner_of(f"t0:{{{bytes([i] * 16).hex()}}}:0:lease")
              for i in range(8)}
    assert len(owners) > 1, "the devices' lease keys all landed on one master"

    @settings(max_examples=15, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(OPS)
    def check(ops: list[tuple[str, str, int]]) -> None:
        asyncio.run(_run(redis_cluster.url, ops, f"t{next(runs)}", cluster=True))

    check()


async def test_lease_expires_and_deadline_is_inside_it(redis_server: Any) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        a, b = SlabLeases(client, "a", 0.5), SlabLeases(client, "b", 0.5)
        t0 = time.monotonic()
        got = await a.grant(UUID, 7)
        assert got is not None
        epoch, deadline = got
        assert t0 < deadline <= t0 + 0.5 * (1 - MARGIN_FRACTION) + 0.01
        assert await b.grant(UUID, 7) is None
        await asyncio.sleep(0.6)
        # Lapsed in the index: the holder's renewal re-creates it at its epoch (the
        # device, not the index, says whose a slab is: SlabLeaseKeeper checked it) ...
        assert await a.renew(UUID, 7, epoch) is not None
        assert await b.grant(UUID, 7) is None
        await asyncio.sleep(0.6)
        # ... and a lapsed lease not renewed is granted to another at a higher epoch,
        # above the device's epoch too.
        again = await b.grant(UUID, 7, device_epoch=epoch + 5)
        assert again is not None and again[0] == epoch + 6
        assert await a.renew(UUID, 7, epoch) is None  # b's now
    finally:
        await client.aclose()


async def test_index_unreachable_is_a_bounded_lease_error(redis_server: Any) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        leases = SlabLeases(client, "a", 1.0)
        redis_server.stop()
        t0 = time.monotonic()
        with pytest.raises(LeaseError, match="index reachable"):
            await leases.grant(UUID, 0)
        assert time.monotonic() - t0 < 2.0
    finally:
        await client.aclose()


def test_node_id_rules() -> None:
    client = aioredis.Redis()
    for bad in ("", "a|b", "x" * 65):
        with pytest.raises(ValueError, match="node id"):
            SlabLeases(client, bad, 1.0)
