"""Issue 26 items 1-2: slab ownership lives on the device, so the cluster index (Redis)
losing its state loses no acknowledged durable block and blocks no write that free slabs
could take, and a paused node's slabs are not taken while blank ones remain. Two real
BlockStores (pod nodes) on one shared file, a real redis-server."""

from __future__ import annotations

import asyncio
import shutil
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from ctxmem_dpu.pod.shared_flash import SharedFlashSource

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
# Long enough that a renewal is never late on a loaded 2-core machine (with 1 s, a
# renewal timing out under load fenced writes and the "every put durable" counts failed
# at random); the cases take 5 leases each.
LEASE_S = 3.0


async def _lost(src: SharedFlashSource, pubs: list[Published]) -> int:
    """How many of ``pubs`` are not served exactly (a wrong byte fails at once)."""
    lost = 0
    for p in pubs:
        got = (await src.fetch(p.ns, [p.entry], [p.key]))[0]
        if got is None:
            lost += 1
        else:
            assert bytes(got) == block_bytes(p.key, p.entry.nbytes), f"WRONG bytes {p.key!r}"
    return lost


async def _lease_keys(url: str) -> list[bytes]:
    client = aioredis.Redis.from_url(url)
    try:
        return [k async for k in client.scan_iter(match="ctxmem:slab:*:lease")]
    finally:
        await client.aclose()


async def _redis(url: str, *cmd: Any) -> Any:
    client = aioredis.Redis.from_url(url)
    try:
        return await client.execute_command(*cmd)
    finally:
        await client.aclose()


async def _index_loss(redis_server: Any, tmp_path: Path,
                      lose: Callable[[], Awaitable[None]],
                      before: Callable[[], Awaitable[None]] | None = None) -> None:
    path = str(tmp_path / "shared.img")
    format_shared(path, SLAB, size=MIB + 8 * SLAB)  # 8 slabs
    url = redis_server.url
    async with node(url, "a", path, SLAB, LEASE_S) as a, \
            node(url, "b", path, SLAB, LEASE_S) as b:
        sa, nsa = session(a, 64)
        sb, nsb = session(b, 64)
        acked = await put_durable(a, "a", sa, nsa, [b"a%d" % i for i in range(20)])
        acked += await put_durable(b, "b", sb, nsb, [b"b%d" % i for i in range(20)])
        assert len(acked) == 40
        if before is not None:
            await before()  # (a snapshot): then the pod moves on, more slabs leased
            acked += await put_durable(a, "a", sa, nsa, [b"a-s%d" % i for i in range(14)])
            acked += await put_durable(b, "b", sb, nsb, [b"b-s%d" % i for i in range(14)])
            assert len(acked) == 68
        await lose()
        # Both keep running across several renewal rounds; both keep writing durable
        # blocks (free slabs remain: 8 slabs, 4 of them hold the first 40 blocks).
        for r in range(3):
            await asyncio.sleep(LEASE_S)
            more_a = await put_durable(a, "a", sa, nsa, [b"a%d-%d" % (r, i) for i in range(4)])
            more_b = await put_durable(b, "b", sb, nsb, [b"b%d-%d" % (r, i) for i in range(4)])
            assert len(more_a) == len(more_b) == 4, "a write blocked while free slabs exist"
            acked += more_a + more_b
        await asyncio.sleep(2 * LEASE_S)
        with SharedFlashSource([path], MASTER) as src:
            assert await _lost(src, acked) == 0
        assert a.audit() == [] and b.audit() == []
        assert a.counters["flash_fenced_writes"] == b.counters["flash_fenced_writes"] == 0
    # Both restart (the index as it is now): each finds its own slabs on the device.
    async with node(url, "a", path, SLAB, LEASE_S) as a, \
            node(url, "b", path, SLAB, LEASE_S) as b:
        with SharedFlashSource([path], MASTER) as src:
            assert await _lost(src, acked) == 0
        for st, ns, who in ((a, nsa, b"a"), (b, nsb, b"b")):
            mine = {p.key for p in acked if p.key.startswith(who)}
            assert set(st.index[ns.digest]) == mine


async def test_flushall_loses_no_durable_block(redis_server: Any, tmp_path: Path) -> None:
    async def lose() -> None:
        assert await _redis(redis_server.url, "FLUSHALL")
    await _index_loss(redis_server, tmp_path, lose)


async def test_index_restarted_empty_loses_no_durable_block(redis_server: Any,
                                                            tmp_path: Path) -> None:
    async def lose() -> None:
        redis_server.stop()  # no persistence: it comes back empty
        redis_server.start()
        assert await _lease_keys(redis_server.url) == []
    await _index_loss(redis_server, tmp_path, lose)


async def test_old_snapshot_restored_loses_no_durable_block(redis_server: Any,
                                                            tmp_path: Path) -> None:
    """SAVE once both nodes hold blocks, more slabs leased after it, then the RDB
    restored: the index's epoch counters go back below the device's epochs, and it knows
    nothing of the slabs leased since."""
    snap = tmp_path / "old.rdb"

    async def save() -> None:
        assert await _redis(redis_server.url, "SAVE")
        shutil.copy(redis_server.workdir / "dump.rdb", snap)

    async def lose() -> None:
        redis_server.stop()
        shutil.copy(snap, redis_server.workdir / "dump.rdb")
        redis_server.start()
    await _index_loss(redis_server, tmp_path, lose, save)


async def test_every_lease_lapsing_at_once_loses_no_durable_block(
        redis_server: Any, tmp_path: Path) -> None:
    """What a clock jump on the Redis host does: every lease key expires at once."""
    async def lose() -> None:
        keys = await _lease_keys(redis_server.url)
        assert keys
        for k in keys:  # each lapses now (1 ms); a renewal may re-create it right after
            assert await _redis(redis_server.url, "PEXPIRE", k, 1) == 1
    await _index_loss(redis_server, tmp_path, lose)


async def test_a_paused_node_keeps_its_slabs_however_long_it_is_stopped(
        redis_server: Any, tmp_path: Path) -> None:
    """b attaches first (every slab blank then), a fills a slab and is SIGSTOPped past its
    lease. a runs on this host and its process lives: b takes the blank slabs and then
    makes room among its own, but a's slab is never taken (issue 26: a lease that lapses
    while its owner lives is renewed, never taken), so a's blocks stay served."""
    path = str(tmp_path / "shared.img")
    format_shared(path, SLAB, size=MIB + 6 * SLAB)  # 6 slabs
    url = redis_server.url
    async with node(url, "b", path, SLAB, LEASE_S) as b:
        dev = b.flash.devices[0]
        # (started on a thread: b's loop keeps renewing meanwhile)
        a_cm = node_process(url, "a", path, SLAB, LEASE_S, blocks=8, kib=64)
        proc, pa = await asyncio.to_thread(a_cm.__enter__)
        try:
            assert len(pa) == 8
            slab_a = (pa[0].entry.shared.offset - MIB) // SLAB  # type: ignore[union-attr]
            owner_a = dev.slab_owner(slab_a)
            proc.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                await asyncio.sleep(2 * LEASE_S)  # a's lease lapses in the index
                src = SharedFlashSource([path], MASTER)
                try:
                    for kib in (32, 16, 8, 4, 12, 20, 24, 28, 36, 40):
                        s, ns = session(b, kib, f"m{kib}")
                        await put_durable(b, "b", s, ns, [b"k%d-%d" % (kib, i)
                                                          for i in range(3)])
                        assert dev.slab_owner(slab_a) == owner_a, "a's slab was taken"
                        assert await _lost(src, pa) == 0  # a's blocks still served
                    # b was out of blank slabs (it evicted its own blocks to make room,
                    # or had puts refused) for more than a lease after a stopped.
                    blank = [s_ for s_ in range(dev.num_slabs) if not dev.slab_owner(s_)[0]]
                    assert not blank, f"b never needed more than the blank slabs: {blank}"
                    assert time.monotonic() - stopped > LEASE_S
                    assert b.counters["flash_fenced_writes"] == 0
                finally:
                    src.shutdown()
            finally:
                proc.send_signal(signal.SIGCONT)
        finally:
            a_cm.__exit__(None, None, None)


async def test_a_killed_nodes_records_wait_out_the_grace(redis_server: Any,
                                                         tmp_path: Path) -> None:
    """Found by a 600-fault `ctxmem chaos pod` run: a node killed (and about to restart)
    counts as dead at once, and a node out of room took its slabs with records at once:
    292 acknowledged durable blocks lost. Now such a slab is taken only once its node has
    been dead for ``pod.dead_slab_grace_s`` (an hour here): b uses every blank slab and
    makes room among its own blocks, a's slab keeps a's blocks, all served."""
    path = str(tmp_path / "shared.img")
    format_shared(path, SLAB, size=MIB + 6 * SLAB)  # 6 slabs
    url = redis_server.url
    async with node(url, "b", path, SLAB, LEASE_S, dead_grace_s=3600.0) as b:
        dev = b.flash.devices[0]
        a_cm = node_process(url, "a", path, SLAB, LEASE_S, blocks=8, kib=64)
        proc, pa = await asyncio.to_thread(a_cm.__enter__)
        try:
            assert len(pa) == 8
            slab_a = (pa[0].entry.shared.offset - MIB) // SLAB  # type: ignore[union-attr]
            owner_a = dev.slab_owner(slab_a)
            proc.kill()  # kill -9: its process is gone, dead at once to b
            proc.wait(10)
            await asyncio.sleep(2 * LEASE_S)  # and its leases lapse in the index
            src = SharedFlashSource([path], MASTER)
            try:
                for kib in (32, 16, 8, 4, 12, 20, 24, 28, 36, 40):
                    s, ns = session(b, kib, f"m{kib}")
                    await put_durable(b, "b", s, ns, [b"k%d-%d" % (kib, i) for i in range(3)])
                    assert dev.slab_owner(slab_a) == owner_a, "a's slab taken in its grace"
                blank = [s_ for s_ in range(dev.num_slabs) if not dev.slab_owner(s_)[0]]
                assert not blank, f"b never needed more than the blank slabs: {blank}"
                assert await _lost(src, pa) == 0  # every acknowledged block of a served
            finally:
                src.shutdown()
        finally:
            a_cm.__exit__(None, None, None)
