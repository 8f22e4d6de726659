"""BlockStore's lifetime: a start that fails half way closes what it opened, in reverse
(issue 31: ``BlockStore.__aenter__`` leaked on a failed start: the flash device stayed
locked with its owner record, and the I/O threads ran on; the store now registers each
thing's close on an exit stack as it starts)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from ctxmem_dpu.pod.slab_leases import SlabLeaseKeeper, SlabLeases
from ctxmem_dpu.store import BlockStore
from ctxmem_dpu.tiers.flash import FlashDevice
from ctxmem_dpu.tiers.flash_fence import SlabFence
from ctxmem_dpu.tiers.flash_owner import OWNER_OFFSET, SECTOR, OwnerRecord
from tests.dpu.pod.podkit import DEVICE, format_shared, pod_config
from tests.dpu.storekit import MASTER, make_flash, store_config

MIB = 1 << 20


def _owner(path: Path) -> OwnerRecord | None:
    with open(path, "rb") as f:
        f.seek(OWNER_OFFSET)
        return OwnerRecord.unpack(f.read(SECTOR))


def _open_fds(path: str) -> list[str]:
    """This process's file descriptors open on ``path``."""
    fds, real = [], os.path.realpath(path)
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") == real:
                fds.append(fd)
    return fds


async def test_a_failed_start_closes_what_it_opened(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "flash0.img"
    flash = make_flash(path, 16 << 20)
    cfg = store_config()
    threads = set(threading.enumerate())
    tasks = asyncio.all_tasks()
    store = BlockStore(cfg, flash, MASTER)

    async def broken() -> None:  # after the devices are open and the owner record written
        assert _owner(path) is not None
        raise OSError(errno.EIO, "index rebuild failed (test)")

    monkeypatch.setattr(store._recovery, "rebuild", broken)
    with pytest.raises(OSError, match="index rebuild failed"):
        async with store:
            pytest.fail("the body ran after a failed start")
    assert _owner(path) is None, "the device's owner record outlived the failed start"
    assert not _open_fds(str(path)), "the failed store left the device open"
    assert asyncio.all_tasks() == tasks, "a task of the failed store is left"
    assert not [t for t in threading.enumerate() if t not in threads and t.is_alive()], \
        "threads of the failed store still run"
    async with BlockStore(cfg, flash, MASTER) as again:  # not "in use" by the failed one
        assert again.stats()["flash_devices_healthy"] == 1


async def test_a_start_failing_after_the_keeper_leased_closes_it_before_the_devices(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_server: Any) -> None:
    """Shared flash: the keeper's first top-up leases a spare slab, then fails. What
    started is closed in reverse: the keeper gives the empty slab back (on the device and
    in the index: possible only while the device is still open), then the threads, then
    the device (its owner record); no task is left."""
    path = str(tmp_path / "shared.img")
    uuid = format_shared(path, MIB, size=MIB + 4 * MIB)  # four slabs
    cfg = pod_config(path, MIB, lease_s=30.0, spare=1)
    real = SlabLeaseKeeper.top_up

    async def leased_then_failed(keeper: SlabLeaseKeeper, more: int = 0) -> int:
        assert await real(keeper, more) == 1  # the spare slab
        raise OSError(errno.EIO, "slab top-up failed (test)")

    client = aioredis.Redis.from_url(redis_server.url)
    try:
        leases = SlabLeases(client, "n1", 30.0)
        threads = set(threading.enumerate())
        tasks = asyncio.all_tasks()
        store = BlockStore(cfg, [(DEVICE, path)], MASTER, slab_leases=leases)
        monkeypatch.setattr(SlabLeaseKeeper, "top_up", leased_then_failed)
        with pytest.raises(OSError, match="slab top-up failed"):
            async with store:
                pytest.fail("the body ran after a failed start")
        monkeypatch.undo()
        assert await leases.holders(uuid, [0, 1, 2, 3]) == [None] * 4, \
            "the keeper's spare slab was not given back"
        assert not _open_fds(path), "the failed store left the device open"
        probe = FlashDevice(0, DEVICE, path, MIB, True, False, SlabFence(DEVICE, "probe"))
        try:  # the lease stamp on the slab header blanked too
            assert [owner for owner, _epoch in probe.slab_owners()] == [""] * 4
        finally:
            probe.close()
        assert asyncio.all_tasks() == tasks, "a task of the failed store is left"
        assert not [t for t in threading.enumerate() if t not in threads and t.is_alive()], \
            "threads of the failed store still run"
        async with BlockStore(cfg, [(DEVICE, path)], MASTER, slab_leases=leases) as again:
            assert again.stats()["flash_devices_healthy"] == 1
    finally:
        await client.aclose()
