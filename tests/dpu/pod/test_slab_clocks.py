"""Issue 26 item 2 for shared-flash slabs: no clock takes a live owner's slab. A second
pod node whose wall clock reads an hour ahead (or behind), in its process only, runs out
of room beside a live owner's slabs of durable records, across several leases, after every
lease key lapsed in the index at once (what a clock jump on the Redis host does): it
takes none of them, the owner renews its leases, and every block the owner acknowledged
reads back. The shifted node is a real child process (``podkit node``) with the pod chaos
campaign's ``clockskew/sitecustomize.py`` first on its ``PYTHONPATH``; the owner a real
BlockStore; a real redis-server."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from ctxmem_dpu.pod.shared_flash import SharedFlashSource
from ctxmem_tools.chaos.pod import SKEW_DIR
from tests.kit import until_async

from .podkit import MASTER, format_shared, node, node_process, put_durable, session
from .test_index_loss import _lost

MIB = 1 << 20
SLAB = MIB  # 64 KiB blocks: 14 per slab
LEASE_S = 3.0  # (as test_index_loss: renewals never late on a loaded 2-core machine)
PER_SLAB = 14


@pytest.mark.parametrize("skew_s", [3600.0, -3600.0], ids=["ahead", "behind"])
async def test_a_shifted_clock_never_takes_a_live_owners_slabs(
        redis_server: Any, tmp_path: Path, skew_s: float) -> None:
    path = str(tmp_path / "shared.img")
    format_shared(path, SLAB, size=MIB + 8 * SLAB)  # 8 slabs
    url = redis_server.url
    client = aioredis.Redis.from_url(url)
    try:
        async with node(url, "a", path, SLAB, LEASE_S) as a:
            dev = a.flash.devices[0]
            sa, nsa = session(a, 64)
            acked = await put_durable(a, "a", sa, nsa, [b"a%d" % i for i in range(3 * PER_SLAB)])
            assert len(acked) == 3 * PER_SLAB

            async def spare_leased() -> bool:  # (the keeper tops up on a's loop)
                return [o for o, _e in await asyncio.to_thread(dev.slab_owners)].count("a") == 4
            await until_async(spare_leased, 20 * LEASE_S, "a's spare slab", 0.05)
            owners = await asyncio.to_thread(dev.slab_owners)
            mine = {s: o for s, o in enumerate(owners) if o[0] == "a"}
            with_records = {(p.entry.shared.offset - MIB) // SLAB  # type: ignore[union-attr]
                            for p in acked}
            assert with_records < set(mine) and len(with_records) == 3

            prefix = f"ctxmem:slab:{{{dev.superblock.device_uuid.hex()}}}"
            lease_keys = [f"{prefix}:{s}:lease" for s in mine]
            assert len([k async for k in client.scan_iter(match="ctxmem:slab:*:lease")]) == 4

            # The index's clock runs far ahead too: a's lease keys lapse every 50 ms (each
            # is re-created by a's next renewal, a lease / 3 later), so while b runs a's
            # slabs mostly have no lease in the index; only the device says a lives.
            lapsed = [0]

            async def lapse() -> None:
                while True:
                    for k in lease_keys:
                        lapsed[0] += await client.pexpire(k, 1)
                    await asyncio.sleep(0.05)
            lapser = asyncio.create_task(lapse())

            # b, its wall clock an hour off, wants 6 slabs' worth over 3 rounds more than
            # a lease apart; 4 are left (a holds 3 and a spare): it is out of room past a's
            # lease, in the index and on its own clocks.
            env = {"PYTHONPATH": os.pathsep.join([str(SKEW_DIR), os.environ.get(
                       "PYTHONPATH", "")]),
                   "CTXMEM_CHAOS_CLOCK_SKEW_S": str(skew_s)}
            b_cm = node_process(url, "b", path, SLAB, LEASE_S, blocks=2 * PER_SLAB, kib=64,
                                rounds=3, pause_s=1.2 * LEASE_S, env=env,
                                check=list(acked))  # (b reads a's blocks back after)
            try:
                proc, pb = await asyncio.to_thread(b_cm.__enter__)  # (a's loop runs on)
            finally:
                lapser.cancel()
                await asyncio.gather(lapser, return_exceptions=True)
            try:
                assert pb, "b stored nothing"
                now = await asyncio.to_thread(dev.slab_owners)
                assert {s: now[s] for s in mine} == mine, f"a live owner's slab taken: {now}"
                # a's renewals re-created its lapsed leases again and again (never b)
                assert lapsed[0] >= 3 * len(mine), lapsed

                async def renewed() -> bool:
                    vals = await client.mget(lease_keys)
                    return all(v is not None and v.decode().startswith("a|") for v in vals)
                await until_async(renewed, 20 * LEASE_S, "a's lapsed leases renewed by a", 0.05)
                assert all(o[0] == "b" for s, o in enumerate(now) if s not in mine), \
                    f"b did not use every other slab (test too small): {now}"
                assert a._keeper is not None and a._keeper.revoked == 0
                # a goes on writing into its spare slab, under the same leases.
                acked += await put_durable(a, "a", sa, nsa, [b"a-more%d" % i for i in range(4)])
                assert len(acked) == 3 * PER_SLAB + 4
                assert a.counters["flash_fenced_writes"] == 0
                with SharedFlashSource([path], MASTER) as src:  # any node's read path
                    assert await _lost(src, acked) == 0
                    served = len(pb) - await _lost(src, pb)  # b's: exact or a miss
                    assert served >= 2 * PER_SLAB  # (b filled its room)
                assert {p.key for p in acked} <= set(a.index[nsa.digest])
                assert proc.poll() is None, "b exited"
            finally:
                b_cm.__exit__(None, None, None)
    finally:
        await client.aclose()
