"""Per-grant RDMA access, the parts that need no RDMA device: which bytes a grant's keys
cover (``coalesce``), when the store ends a grant (``on_grant_end``: commit before the
CRC, abort, release, expiry, session close), and that a grant the transport cannot key
loses nothing (its slots are freed, its blocks unpinned). The memory windows and regions
themselves are exercised on Soft-RoCE in the QEMU guest
(tests/vm/test_rdma_transport.py::test_access_ends_with_the_grant)."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ctxmem_common.config import rdma_ip
from ctxmem_common.errors import ConfigError, Unavailable
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_dpu.transport.rdma import coalesce
from tests.dpu.storekit import open_store, payload, put, session, store_config
from tests.kit import until_async

SLOT = 1 << 16


# -- which bytes a grant covers ------------------------------------------------------------


def test_coalesce_merges_only_adjacent_spans_of_one_slab() -> None:
    spans = [(0, 2 * SLOT, SLOT), (0, 0, SLOT), (0, SLOT, SLOT),  # 0..3 slots: one run
             (0, 5 * SLOT, SLOT - 512),  # short block: its slot's tail stays outside
             (0, 6 * SLOT, SLOT),  # not adjacent to the short block's end: its own run
             (1, 0, SLOT)]  # another slab: never merged
    runs, which = coalesce(spans)
    assert runs == [(0, 0, 3 * SLOT), (0, 5 * SLOT, SLOT - 512), (0, 6 * SLOT, SLOT),
                    (1, 0, SLOT)]
    assert which == [0, 0, 0, 1, 2, 3]


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 15), st.integers(1, 2 * SLOT)),
                max_size=40))
def test_coalesce_covers_exactly_the_granted_bytes(raw: list[tuple[int, int, int]]) -> None:
    spans = [(slab, i * SLOT, n) for slab, i, n in raw]
    runs, which = coalesce(spans)
    granted = {(slab, b) for slab, off, n in spans for b in range(off // 256, (off + n) // 256)}
    covered = {(slab, b) for slab, off, n in runs for b in range(off // 256, (off + n) // 256)}
    assert covered == granted  # no byte outside a granted span, every granted byte keyed
    for (slab, off, n), r in zip(spans, which, strict=True):
        r_slab, r_off, r_n = runs[r]
        assert r_slab == slab and r_off <= off and off + n <= r_off + r_n
    for a, b in itertools.pairwise(runs):  # disjoint, not even touching
        assert a[0] != b[0] or a[1] + a[2] < b[1]


# -- when a grant ends -------------------------------------------------------------------


def test_grant_ends_at_commit_before_the_crc_is_taken() -> None:
    async def run() -> None:
        store = await open_store(store_config(), None)
        s, ns = session(store)
        seen: list[tuple[int, bool, bool]] = []

        def hook(grant_id: int) -> None:
            a = store.allocations.get(grant_id)
            # At the first call the allocation is still open (not yet CRC'd, not indexed).
            seen.append((grant_id, a is not None and not a.done,
                         b"k" * 32 in store.index.get(ns.digest, {})))

        store.on_grant_end.append(hook)
        a, _ = await store.allocate(s, ns, [b"k" * 32])
        store.dram.view(a.slots[0], ns.block_nbytes)[:] = payload(1)
        assert await store.commit(s, a.id, [], False) == 1
        assert seen[0] == (a.id, True, False)
        assert {g for g, _o, _i in seen} == {a.id}
        await store.close()

    asyncio.run(run())


def test_grant_ends_at_abort_release_expiry_and_session_close() -> None:
    ended: list[int] = []

    async def run() -> None:
        store = await open_store(store_config(lease_ttl_s=0.2, allocation_ttl_s=0.2), None)
        store.on_grant_end.append(ended.append)
        s, ns = session(store)
        await put(store, s, ns, {b"a" * 32: payload(1), b"b" * 32: payload(2)})
        ended.clear()
        # abort
        a, _ = await store.allocate(s, ns, [b"c" * 32])
        await store.commit(s, a.id, [], True)
        assert ended == [a.id]
        # release
        lease, _ = await store.acquire(s, ns, [b"a" * 32])
        store.release(s, [lease.id])
        assert ended[-1] == lease.id
        # expiry (the reaper), of a lease and of an allocation
        lease, _ = await store.acquire(s, ns, [b"b" * 32])
        a, _ = await store.allocate(s, ns, [b"d" * 32])
        await until_async(lambda: {lease.id, a.id} <= set(ended), 2.5,
                          lambda: f"the reaper to end lease {lease.id} and allocation {a.id} "
                          f"(ended: {ended})", 0.05)
        assert store.counters["expired_leases"] >= 1
        # session close ends what it still holds
        lease, _ = await store.acquire(s, ns, [b"a" * 32])
        a, _ = await store.allocate(s, ns, [b"e" * 32])
        store.close_session(s)
        assert {lease.id, a.id} <= set(ended)
        await store.close()

    asyncio.run(run())


# -- a grant the transport cannot key loses nothing ----------------------------------------


def test_unkeyable_rdma_grant_frees_its_slots_and_unpins_its_blocks() -> None:
    from ctxmem_dpu.control.servicer import ContextMemoryServicer
    from ctxmem_dpu.transport.rdma import RdmaServer

    async def run() -> None:
        store = await open_store(store_config(service={
            "transports": ["rdma", "shm", "tcp"], "rdma_listen": "10.0.2.15"}), None)
        servicer = ContextMemoryServicer(store, "i", "", "", lambda: "SERVING")
        # An RDMA server whose session never attached: every grant is refused.
        servicer.rdma = RdmaServer(store, "10.0.2.15")
        plain, ns_plain = session(store, "t")
        await put(store, plain, ns_plain, {b"x" * 32: payload(3)})
        s = store.connect("t", "", "rdma", "test")
        handle, _ns = store.open_namespace(s, "model", ns_plain.layout, {})
        used = store.dram.used_bytes()
        allocate = ContextMemoryServicer.Allocate.__wrapped__  # type: ignore[attr-defined]
        with pytest.raises(Unavailable, match="no RDMA connection"):
            await allocate(servicer, pb.AllocateRequest(
                session_id=s.id, namespace_handle=handle, keys=[b"y" * 32]), None)
        assert store.dram.used_bytes() == used and not store.allocations
        acquire = ContextMemoryServicer.Acquire.__wrapped__  # type: ignore[attr-defined]
        with pytest.raises(Unavailable, match="no RDMA connection"):
            await acquire(servicer, pb.AcquireRequest(
                session_id=s.id, namespace_handle=handle, keys=[b"x" * 32]), None)
        block = store.index[ns_plain.digest][b"x" * 32]
        assert block.pins == 0 and not store.leases
        await store.close()

    asyncio.run(run())


# -- configuration -----------------------------------------------------------------------


def test_rdma_listen_is_an_ip_without_a_port() -> None:
    assert rdma_ip("10.0.2.15") == "10.0.2.15"
    assert rdma_ip("[fe80::1]") == rdma_ip("fe80::1") == "fe80::1"
    with pytest.raises(ConfigError, match="has a port; give the IP address only"):
        rdma_ip("10.0.2.15:4791")
    with pytest.raises(ConfigError, match="has a port"):
        rdma_ip("[fe80::1]:4791")
    with pytest.raises(ConfigError, match="not an IP address"):
        rdma_ip("rxe-host")
    with pytest.raises(ConfigError, match=r"service\.rdma_listen"):
        store_config(service={"transports": ["rdma"], "rdma_listen": "10.0.2.15:50053"})


def test_rdma_access_must_be_a_known_mode() -> None:
    assert store_config(service={"rdma_access": "mr"}).service.rdma_access == "mr"
    with pytest.raises(ConfigError, match="rdma_access"):
        store_config(service={"rdma_access": "slab"})
