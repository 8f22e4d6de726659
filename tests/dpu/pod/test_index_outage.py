"""Write-through on shared flash while the cluster index (Redis) is down or restarting
(docs/reliability.md, "Write-through while the index restarts"). A node whose slab
leases cannot be renewed in the index renews them on the device alone while the slab
header still names it at its epoch and its heartbeat advances: no other node can take
such a slab (a taker needs the heartbeat stopped for a whole lease), so write-through
commits go on; where the heartbeat cannot be written they are refused, naming the lease.
Real BlockStores (pod nodes) on one shared file, a real redis-server stopped and started
again empty; every refused put is counted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ctxmem_common.errors import Unavailable
from ctxmem_dpu import faults
from ctxmem_dpu.blocks import Namespace, Session
from ctxmem_dpu.pod.entries import RemoteEntry
from ctxmem_dpu.pod.shared_flash import SharedFlashSource
from ctxmem_dpu.store import BlockStore
from tests.dpu.storekit import put
from tests.kit import until_async

from .podkit import MASTER, Published, block_bytes, format_shared, node, session
from .test_index_loss import _lost

MIB = 1 << 20
SLAB = MIB  # 64 KiB blocks: 14 per slab
KIB = 64
# As test_index_loss: long enough that a renewal round is never late on a loaded 2-core
# machine (the heartbeat's deadline is 0.75 of it; rounds run every third).
LEASE_S = 3.0
ROUNDS = 8  # puts during the outage, LEASE_S / 3 apart: past 2 leases without the index


@pytest.fixture(autouse=True)
def _no_faults() -> Iterator[None]:
    faults.reset()
    yield
    faults.reset()


async def _put_through(store: BlockStore, node_id: str, s: Session, ns: Namespace,
                       keys: list[bytes]) -> list[Published] | None:
    """A write-through put of ``keys``: what the index would publish for each, or None
    when the commit was refused (Unavailable)."""
    try:
        n = await put(store, s, ns, {k: block_bytes(k, KIB << 10) for k in keys})
    except Unavailable:
        return None
    assert n == len(keys)
    out = []
    for k in keys:
        b = store.index[ns.digest][k]
        loc = store.shared_location(b)
        assert b.durable and loc is not None, f"{k!r} acknowledged but not durable"
        out.append(Published(ns.digest, k, RemoteEntry(node_id, "flash", b.seq, b.length,
                                                        b.crc, loc)))
    return out


async def test_write_through_goes_on_while_the_index_is_down_and_restarts(
        redis_server: Any, tmp_path: Path) -> None:
    """The pod campaign's only refusals (0.59% of its puts, docs/reliability.md) were
    write-through commits while the index restarted. Two nodes, Redis stopped for more
    than two leases, then started again empty: every put of both nodes acknowledged (0
    refused), each node's leases renewed on the device alone meanwhile, and every
    acknowledged block reads back exactly, also after both nodes restart."""
    path = str(tmp_path / "shared.img")
    format_shared(path, SLAB, size=MIB + 8 * SLAB)  # 8 slabs
    url = redis_server.url
    acked: list[Published] = []
    refused = 0
    async with node(url, "a", path, SLAB, LEASE_S, write_policy="write_through") as a, \
            node(url, "b", path, SLAB, LEASE_S, write_policy="write_through") as b:
        nodes = [("a", a, *session(a, KIB)), ("b", b, *session(b, KIB))]
        for who, st, s, ns in nodes:
            got = await _put_through(st, who, s, ns, [b"%s-first%d" % (who.encode(), i)
                                                      for i in range(4)])
            assert got is not None
            acked += got

        def spares() -> bool:  # each holds its partial slab and one free leased slab
            return all(len(st.flash.devices[0].fence.slabs()) >= 2 for _w, st, _s, _n in nodes)
        await until_async(spares, 20 * LEASE_S, "each node's spare slab", 0.05)
        renewed = {who: st._keeper.device_renewals for who, st, _s, _n in nodes}  # type: ignore[union-attr]
        assert renewed == {"a": 0, "b": 0}

        redis_server.stop()  # the index unreachable: no renewal, no grant can reach it
        down = time.monotonic()
        for r in range(ROUNDS):
            await asyncio.sleep(LEASE_S / 3)
            for who, st, s, ns in nodes:
                got = await _put_through(st, who, s, ns, [b"%s-%d-%d" % (who.encode(), r, i)
                                                          for i in range(2)])
                if got is None:
                    refused += 1
                else:
                    acked += got
        outage = time.monotonic() - down
        # Past two leases: without renewals on the device every lease had lapsed here.
        assert outage > 2 * LEASE_S, outage
        assert refused == 0, (f"{refused} of {2 * ROUNDS} write-through puts refused while "
                              f"the index was down")
        for who, st, _s, _n in nodes:
            assert st._keeper is not None and st._keeper.device_renewals > 0, who
            assert st._keeper.revoked == 0, who
        redis_server.start()  # empty (no persistence): every lease key is gone
        for r in range(2):
            await asyncio.sleep(LEASE_S / 3)
            for who, st, s, ns in nodes:
                got = await _put_through(st, who, s, ns, [b"%s-after%d-%d" % (
                    who.encode(), r, i) for i in range(2)])
                if got is None:
                    refused += 1
                else:
                    acked += got
        assert refused == 0, f"{refused} write-through puts refused after the index restart"
        assert len(acked) == 2 * (4 + 2 * ROUNDS + 4)
        for who, st, _s, _n in nodes:
            assert st.counters["flash_fenced_writes"] == 0, who
            assert st.counters["write_through_failures"] == 0, who
            assert st.audit() == [], who
        with SharedFlashSource([path], MASTER) as src:
            assert await _lost(src, acked) == 0
    # Both restart: each finds its own blocks on the device, every one.
    async with node(url, "a", path, SLAB, LEASE_S, write_policy="write_through") as a, \
            node(url, "b", path, SLAB, LEASE_S, write_policy="write_through") as b:
        for who, st in (("a", a), ("b", b)):
            _s, ns = session(st, KIB)
            mine = {p.key for p in acked if p.entry.node_id == who}
            assert set(st.index[ns.digest]) == mine, who
        with SharedFlashSource([path], MASTER) as src:
            assert await _lost(src, acked) == 0


async def test_without_its_heartbeat_a_node_refuses_write_through_and_names_the_lease(
        redis_server: Any, tmp_path: Path) -> None:
    """The device alone renews nothing when the node's heartbeat cannot be written (the
    ``lease.before_beat`` fault point failing every beat): with the index down too, the
    leases lapse and every write-through put is refused, naming the lease; the device
    stays in service, and the puts go through again once the heartbeat is written."""
    path = str(tmp_path / "shared.img")
    format_shared(path, SLAB, size=MIB + 4 * SLAB)
    async with node(redis_server.url, "a", path, SLAB, LEASE_S,
                    write_policy="write_through") as a:
        s, ns = session(a, KIB)
        assert await _put_through(a, "a", s, ns, [b"first"]) is not None
        faults.configure(points="lease.before_beat:eio@1+")
        redis_server.stop()
        await asyncio.sleep(LEASE_S + 0.2)  # past the lease: no renewal of any kind
        refused = 0
        for i in range(3):
            try:
                await put(a, s, ns, {b"k%d" % i: block_bytes(b"k%d" % i, KIB << 10)})
            except Unavailable as exc:
                refused += 1
                text = str(exc)
                assert "Errno 110" in text and "no current lease" in text, text
        assert refused == 3
        assert a._keeper is not None and a._keeper.device_renewals == 0
        assert faults.hits().get("lease.before_beat", 0) >= 2
        dev = a.flash.devices[0]
        assert dev.healthy
        faults.reset()  # the heartbeat is written again (the index still down)

        async def stored() -> bool:
            return await _put_through(a, "a", s, ns, [b"again"]) is not None
        await until_async(stored, 20 * LEASE_S,
                          "a put to be stored again once the heartbeat is written", 0.2)
        assert a._keeper.device_renewals > 0
        redis_server.start()
