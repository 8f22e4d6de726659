"""Shared flash on the host: two (or three) pod nodes on one shared file with a real
redis-server: disjoint leased slabs, reads of any node's records straight from the
device, a killed writer's blocks still served, its slabs taken over after its lease and
then a stale pointer a miss, forged headers misses, the fence, restarts."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from ctxmem_common.errors import Unavailable
from ctxmem_common.flash_format import OWNER_OFFSET, SECTOR, OwnerRecord, RecordHeader
from ctxmem_dpu import faults
from ctxmem_dpu.pod.shared_flash import SharedFlashSource
from ctxmem_dpu.pod.slab_leases import SlabLeases
from ctxmem_dpu.tiers import flash_owner
from ctxmem_dpu.tiers.flash import FlashDevice, FlashIOError
from ctxmem_dpu.tiers.flash_owner import SHARED_INSTANCE, DeviceOwner
from tests.dpu.storekit import get, put
from tests.kit import until_async

from .podkit import (
    MASTER,
    Published,
    block_bytes,
    format_shared,
    node,
    node_process,
    put_durable,
    session,
)

MIB = 1 << 20
SLAB = MIB  # 64 KiB blocks: 14 per slab
LEASE_S = 1.0


@pytest.fixture
def shared(tmp_path: Path) -> str:
    path = str(tmp_path / "shared.img")
    format_shared(path, SLAB, size=MIB + 4 * SLAB)  # 4 slabs
    return path


async def _read(src: SharedFlashSource, pubs: list[Published], keys: bool = True
                ) -> list[bytes | None]:
    assert len({p.ns for p in pubs}) <= 1
    return await src.fetch(pubs[0].ns, [p.entry for p in pubs],
                           [p.key for p in pubs] if keys else None)


def _exact(pubs: list[Published], got: list[bytes | None]) -> list[bool | None]:
    """Per block: True exact, None miss; a wrong block fails the test at once."""
    out: list[bool | None] = []
    for p, g in zip(pubs, got, strict=True):
        if g is None:
            out.append(None)
            continue
        assert bytes(g) == block_bytes(p.key, p.entry.nbytes), f"WRONG bytes for {p.key!r}"
        out.append(True)
    return out


async def _holders(url: str, uuid: bytes, slabs: list[int]) -> list[tuple[str, int] | None]:
    client = aioredis.Redis.from_url(url)
    try:
        return await SlabLeases(client, "probe", 1.0).holders(uuid, slabs)
    finally:
        await client.aclose()


async def test_two_nodes_write_disjoint_leased_slabs_and_read_each_other(
        redis_server: Any, shared: str) -> None:
    url = redis_server.url
    async with node(url, "a", shared, SLAB, 5.0) as a, node(url, "b", shared, SLAB, 5.0) as b:
        sa, nsa = session(a, 64)
        sb, nsb = session(b, 64)
        pa = await put_durable(a, "a", sa, nsa, [b"a%d" % i for i in range(10)])
        pb = await put_durable(b, "b", sb, nsb, [b"b%d" % i for i in range(10)])
        assert len(pa) == len(pb) == 10
        slabs_a = {b_.flash.slot.slab for b_ in a.index[nsa.digest].values() if b_.flash}
        slabs_b = {b_.flash.slot.slab for b_ in b.index[nsb.digest].values() if b_.flash}
        assert slabs_a and slabs_b and not slabs_a & slabs_b
        uuid = a.flash.devices[0].superblock.device_uuid
        holders = await _holders(url, uuid, sorted(slabs_a | slabs_b))
        assert {h[0] for h in holders if h} == {"a", "b"}
        for s_ in slabs_a:  # the slab header names its owner at its epoch
            owner, epoch = a.flash.devices[0].slab_owner(s_)
            assert owner == "a" and epoch == a.flash.devices[0].fence.epoch(s_) > 0
        with SharedFlashSource([shared], MASTER) as src:
            assert _exact(pa, await _read(src, pa)) == [True] * 10
            assert _exact(pb, await _read(src, pb)) == [True] * 10
            assert _exact(pa, await _read(src, pa, keys=False)) == [True] * 10
        assert a.audit() == [] and b.audit() == []


async def test_forged_or_stale_entries_are_misses(redis_server: Any, shared: str) -> None:
    async with node(redis_server.url, "a", shared, SLAB, 5.0) as a:
        s, ns = session(a, 64)
        pubs = await put_durable(a, "a", s, ns, [b"k%d" % i for i in range(4)])
    p = pubs[0]
    e, loc = p.entry, p.entry.shared
    assert loc is not None

    def variant(**kw: Any) -> Published:
        return dataclasses.replace(p, entry=dataclasses.replace(e, **kw))

    forged = [
        variant(seq=e.seq + 1),  # an older/newer version's pointer
        variant(crc32c=e.crc32c ^ 1),
        variant(nbytes=e.nbytes - 4096),
        variant(shared=dataclasses.replace(loc, offset=loc.offset + 64 * 1024)),  # next slot
        variant(shared=dataclasses.replace(loc, offset=loc.offset + 4096)),  # not a slot
        variant(shared=dataclasses.replace(loc, device_uuid="00" * 16)),  # unknown device
        dataclasses.replace(p, key=b"another-key"),
    ]
    with SharedFlashSource([shared], MASTER) as src:
        for f in forged:
            assert await _read(src, [f]) == [None], f
        other_ns = dataclasses.replace(p, ns=bytes(16))
        assert await _read(src, [other_ns]) == [None]  # another namespace (and its key)
        assert _exact([p], await _read(src, [p])) == [True]
        assert src.counters["stale"] >= 7 and src.counters["unknown_device"] == 1
    with SharedFlashSource([shared], bytes(32)) as src:  # another pod's master key
        assert await _read(src, [p]) == [None]
    # A header forged in place (the record names another key): a miss, never its bytes.
    with FlashDevice(0, "x", shared, SLAB, True, lock=False) as raw:
        slab = (loc.offset - MIB) // raw.slab_size
        cap = raw.reader.slab_header(slab, raw.slab_size)
        assert cap is not None
        base = MIB + slab * raw.slab_size
        index = (loc.offset - base - SECTOR - cap.slots * SECTOR) // cap.slot_size
        hdr_at = base + SECTOR + index * SECTOR
        fd = os.open(shared, os.O_RDWR)
        try:
            hdr = RecordHeader.unpack(os.pread(fd, SECTOR, hdr_at))
            assert hdr is not None and hdr.key == p.key
            os.pwrite(fd, dataclasses.replace(hdr, key=b"forged").pack(), hdr_at)
        finally:
            os.close(fd)
    with SharedFlashSource([shared], MASTER) as src:
        assert await _read(src, [p]) == [None]


async def test_killed_writer_served_then_taken_over_and_stale_pointer_is_a_miss(
        redis_server: Any, shared: str) -> None:
    url = redis_server.url
    with node_process(url, "a", shared, SLAB, LEASE_S, blocks=8, kib=64) as (proc, pa):
        assert len(pa) == 8
        proc.kill()
        proc.wait(10)
    src = SharedFlashSource([shared], MASTER)
    try:
        assert _exact(pa, await _read(src, pa)) == [True] * 8  # served after the kill
        slab_a = (pa[0].entry.shared.offset - MIB) // SLAB  # type: ignore[union-attr]
        async with node(url, "b", shared, SLAB, LEASE_S) as b:
            dev = b.flash.devices[0]
            uuid = dev.superblock.device_uuid

            async def lapsed() -> bool:
                h = (await _holders(url, uuid, [slab_a]))[0]
                return h is None or h[0] != "a"

            await until_async(lapsed, 20 * LEASE_S, "a's lease to lapse", 0.1)
            # b leases blank slabs first (each new slot size assigns one), a's slab last;
            # until b reuses it, a's blocks are served.
            pb: list[Published] = []
            for kib in (32, 16, 8, 4):
                if dev.slab_owner(slab_a)[0] == "b":
                    break
                assert _exact(pa, await _read(src, pa)) == [True] * 8
                s, ns = session(b, kib, f"m{kib}")
                got = await put_durable(b, "b", s, ns, [b"k%d-%d" % (kib, i) for i in range(5)])
                assert len(got) == 5
                pb += got
            assert dev.slab_owner(slab_a) == ("b", dev.fence.epoch(slab_a))
            assert b.counters["evictions_flash"] == 0  # leased slabs, never evictions
            assert await _read(src, pa) == [None] * 8  # stale pointers: misses
            for p in pb:
                assert _exact([p], await src.fetch(p.ns, [p.entry], [p.key])) == [True]
            assert b.audit() == []
    finally:
        src.shutdown()


async def test_fence_stops_writes_when_lease_taken_over_or_not_renewed(
        redis_server: Any, shared: str) -> None:
    url = redis_server.url
    async with node(url, "a", shared, SLAB, LEASE_S) as a:
        s, ns = session(a, 64)
        assert len(await put_durable(a, "a", s, ns, [b"first"])) == 1
        dev = a.flash.devices[0]
        slab = a.index[ns.digest][b"first"].flash.slot.slab  # type: ignore[union-attr]
        uuid = dev.superblock.device_uuid
        # Another node takes the slab over behind a's back (a's lease deleted as if it
        # had lapsed) and writes its header at its higher epoch, as a new owner does.
        client = aioredis.Redis.from_url(url)
        try:
            await client.delete(f"ctxmem:slab:{{{uuid.hex()}}}:{slab}:lease")
            grant = await SlabLeases(client, "x", 30.0).grant(uuid, slab)
        finally:
            await client.aclose()
        assert grant is not None and grant[0] > dev.fence.epoch(slab)
        with FlashDevice(0, "x", shared, SLAB, True, lock=False) as raw:
            h = raw.reader.slab_header(slab, SLAB)
            assert h is not None
            fd = os.open(shared, os.O_RDWR)
            try:
                os.pwrite(fd, h.owned_by("x", grant[0]).pack(), MIB + slab * SLAB)
            finally:
                os.close(fd)
        before = dev.slab_owner(slab)
        with open(shared, "rb") as f:
            f.seek(MIB + slab * SLAB)
            image = f.read(SLAB)
        # a's next write batch into that slab (same class: the partial slab) is fenced:
        # nothing written, the block stays in DRAM.
        a_s = await put_durable(a, "a", s, ns, [b"second"])
        assert a_s == [] and a.counters["flash_fenced_writes"] >= 1
        with open(shared, "rb") as f:
            f.seek(MIB + slab * SLAB)
            assert f.read(SLAB) == image, "a wrote into a slab it no longer owns"
        assert dev.slab_owner(slab) == before
        # The renewal finds the lease gone: revoked, never written again.
        await until_async(lambda: dev.fence.lost(slab), 10 * LEASE_S,
                          "the renewal to find the lease gone", 0.1)
        # The index unreachable and the heartbeat not written (so the device alone renews
        # nothing either: tests/dpu/pod/test_index_outage.py): the leases lapse locally
        # and nothing is written.
        faults.configure(points="lease.before_beat:eio@1+")
        try:
            redis_server.stop()
            await asyncio.sleep(LEASE_S)
            fenced = a.counters["flash_fenced_writes"]
            assert await put_durable(a, "a", s, ns, [b"third"]) == []
            assert a.counters["flash_fenced_writes"] > fenced or not dev.fence.slabs()
        finally:
            faults.reset()
        redis_server.start()


async def test_restart_rebuilds_only_own_slabs(redis_server: Any, shared: str) -> None:
    url = redis_server.url
    async with node(url, "a", shared, SLAB, LEASE_S) as a, \
            node(url, "b", shared, SLAB, LEASE_S) as b:
        sa, nsa = session(a, 64)
        sb, nsb = session(b, 64)
        await put_durable(a, "a", sa, nsa, [b"a%d" % i for i in range(5)])
        await put_durable(b, "b", sb, nsb, [b"b%d" % i for i in range(5)])
        epochs = {s_: b.flash.devices[0].fence.epoch(s_) for s_ in
                  b.flash.devices[0].fence.slabs()}
    await asyncio.sleep(2 * LEASE_S)  # b's leases lapse: its restart is granted new epochs
    async with node(url, "b", shared, SLAB, LEASE_S) as b:
        _s, ns = session(b, 64)
        assert sorted(b.index[ns.digest]) == sorted(b"b%d" % i for i in range(5))
        dev = b.flash.devices[0]
        for blk in b.index[ns.digest].values():
            assert blk.flash is not None
            s_ = blk.flash.slot.slab
            assert dev.fence.epoch(s_) > epochs[s_] and dev.slab_owner(s_) == (
                "b", dev.fence.epoch(s_))
        s, ns = session(b, 64)
        lease, _ = await b.acquire(s, ns, [b"b%d" % i for i in range(5)])
        assert len(lease.blocks) == 5
        for blk in lease.blocks:
            assert blk.dram is not None
            assert bytes(b.dram.view(blk.dram, blk.length)) == block_bytes(blk.key, blk.length)
        b.release(s, [lease.id])


async def test_exclusive_and_shared_attach_refuse_each_other(
        redis_server: Any, shared: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flash_owner, "LEASE_S", 0.5)  # the pod's marker lapses quickly
    async with node(redis_server.url, "a", shared, SLAB, 5.0):
        with pytest.raises(FlashIOError) as e:  # the flock
            FlashDevice(0, "solo", shared, SLAB, True)
        assert e.value.errno == errno.EBUSY
        fd = os.open(shared, os.O_RDWR)  # another path to the bytes: the owner record
        try:
            rec = OwnerRecord.unpack(os.pread(fd, SECTOR, OWNER_OFFSET))
            assert rec is not None and rec.instance == SHARED_INSTANCE
            with pytest.raises(FlashIOError, match="shared: true") as e:
                DeviceOwner("solo", shared).claim(fd, os.fstat(fd).st_size)
            assert e.value.errno == errno.EBUSY
        finally:
            os.close(fd)
    # Closed: the marker is taken only once its heartbeat has not advanced for a whole
    # lease, watched on this process's monotonic clock (no wall clock decides).
    t0 = time.monotonic()
    with FlashDevice(0, "solo", shared, SLAB, True):  # a non-shared service owns it now
        assert time.monotonic() - t0 >= 0.5
        with pytest.raises(FlashIOError) as e:
            async with node(redis_server.url, "a", shared, SLAB, 5.0):
                pass
        assert e.value.errno == errno.EBUSY


async def test_shared_device_is_never_formatted_implicitly(redis_server: Any,
                                                           tmp_path: Path) -> None:
    path = tmp_path / "blank.img"
    with open(path, "wb") as f:
        f.truncate(4 * MIB)
    with pytest.raises(FlashIOError, match="ctxmem check --format"):
        async with node(redis_server.url, "a", str(path), SLAB, 5.0):
            pass
    image = path.read_bytes()  # no superblock, no slab: only the owner sector written
    assert image[:OWNER_OFFSET] == bytes(OWNER_OFFSET)
    assert image[OWNER_OFFSET + SECTOR:] == bytes(4 * MIB - OWNER_OFFSET - SECTOR)


async def test_a_delete_under_a_lapsed_lease_waits_and_keeps_the_device_in_service(
        redis_server: Any, shared: str) -> None:
    """Found by a 1,000-fault `ctxmem chaos pod` run: after an index restart, a delete's
    header zeroing under a slab lease that had lapsed meanwhile marked the whole shared
    device failed, which took every write off it until a probe (write-through puts
    refused, where free slabs could take them). Now the zeroing waits for the lease (the
    extents parked), the device stays in service, and once the lease is renewed the
    headers are zeroed and the extents freed."""
    url = redis_server.url
    async with node(url, "a", shared, SLAB, LEASE_S) as a:
        s, ns = session(a, 64)
        keys = [b"k1", b"k2"]
        assert len(await put_durable(a, "a", s, ns, keys)) == 2
        dev = a.flash.devices[0]
        where = [a.index[ns.digest][k].flash for k in keys]
        slab = where[0].slot.slab  # type: ignore[union-attr]
        redis_server.stop()  # renewals cannot reach the index: the lease lapses here
        dev.fence.grant(slab, dev.fence.epoch(slab), time.monotonic() - 1.0)
        assert await a.delete(ns, keys) == 2
        assert dev.healthy, "a lapsed lease marked the shared device failed"
        parked = sum(len(v) for v in a._invalidator.parked.values())
        assert parked == 2, parked
        redis_server.start()  # the keeper renews the lease; the reaper zeroes the headers
        await until_async(lambda: not a._invalidator.parked, 20 * LEASE_S,
                          "the parked headers to be zeroed", 0.1)
        assert dev.healthy
        for ext in where:
            assert ext is not None
            with open(shared, "rb") as f:
                f.seek(dev.header_offset(ext.slot))
                assert f.read(SECTOR) == bytes(SECTOR), "a deleted record's header lives"
        assert len(await put_durable(a, "a", s, ns, [b"after"])) == 1  # writes go on


async def test_a_write_through_commit_under_a_lapsed_lease_names_the_lease(
        redis_server: Any, shared: str) -> None:
    """With the index gone and the node's heartbeat not written (so the device alone
    renews nothing: tests/dpu/pod/test_index_outage.py) the node's slab leases lapse: a
    write-through Commit is refused (nothing is acknowledged that a new owner could
    overwrite), saying it is the lease, not a failed device: the device stays in service
    and the same put succeeds once the index is back."""
    url = redis_server.url
    async with node(url, "a", shared, SLAB, LEASE_S, write_policy="write_through") as a:
        s, ns = session(a, 64)
        assert await put(a, s, ns, {b"first": block_bytes(b"first", 64 << 10)}) == 1
        faults.configure(points="lease.before_beat:eio@1+")
        try:
            redis_server.stop()
            await asyncio.sleep(LEASE_S + 0.2)  # past the lease: renewals failed meanwhile
            with pytest.raises(Unavailable) as err:
                await put(a, s, ns, {b"second": block_bytes(b"second", 64 << 10)})
        finally:
            faults.reset()
        text = str(err.value)
        assert "Errno 110" in text and "no current lease" in text, text
        assert "out of service until a probe" not in text, text
        assert a.flash.devices[0].healthy
        redis_server.start()
        await until_async(lambda: a.flash.devices[0].fence.slabs(), 20 * LEASE_S,
                          "the node to hold a slab lease again", 0.1)

        async def stored() -> bool:
            try:
                return await put(a, s, ns, {b"second": block_bytes(b"second", 64 << 10)}) == 1
            except Unavailable:
                return False
        await until_async(stored, 20 * LEASE_S, "a put to be stored with the index back", 0.2)
        assert await get(a, s, ns, [b"second"]) == [block_bytes(b"second", 64 << 10)]
