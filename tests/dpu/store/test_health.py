"""``store/health.py``: when a flash device is taken out (failed, slow, taken over) or
kept (a full filesystem), what is counted, and how the probe brings it back, where it was
or where its locator says it is now. One 8 MiB flash file (``parts.py``)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from ctxmem_dpu.tiers.flash import FlashIOError

from .parts import Parts, parts


def _state(p: Parts) -> tuple[bool, str]:
    dev = p.ctx.flash.devices[0]
    return dev.healthy, dev.health_reason


async def test_a_failed_device_is_counted_once_and_probed_back(tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        h = p.health
        h.mark_unhealthy(0, FlashIOError(errno.EIO, "boom"))
        h.mark_unhealthy(0, FlashIOError(errno.EIO, "again"), reason="slow")
        assert _state(p) == (False, "failed")  # the first reason stays
        assert not h.usable()
        assert p.ctx.counters["flash_device_failures"] == 1
        await h.revive()
        assert _state(p) == (True, "")
        assert h.usable()
        assert p.ctx.counters["flash_device_recoveries"] == 1
        await h.revive()  # healthy: nothing to do
        assert p.ctx.counters["flash_device_recoveries"] == 1


async def test_a_full_filesystem_keeps_the_device_an_io_error_fails_it(tmp_path: Path
                                                                      ) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        h = p.health
        assert h.write_failed(0, FlashIOError(errno.ENOSPC, "no space")) is True
        assert (_state(p), h.full, p.ctx.counters["flash_full"]) == ((True, ""), {0}, 1)
        h.wrote([0])
        assert h.full == set()
        assert h.write_failed(0, FlashIOError(errno.EIO, "bad sector")) is False
        assert _state(p) == (False, "failed")
        assert (h.full, p.ctx.counters["flash_full"],
                p.ctx.counters["flash_device_failures"]) == (set(), 1, 1)


async def test_a_slow_call_takes_the_device_out_once_per_slow_call(tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img", flash={"slow_io_s": 0.5}) as p:
        h, dev = p.health, p.ctx.flash.devices[0]
        h.check_slow([0])
        assert _state(p) == (True, "")  # no slow call yet
        dev.slow_ios = 1
        h.check_slow([0])
        assert _state(p) == (False, "slow")
        dev.slow_ios = 2  # another slow call while it was out
        await h.revive()
        assert _state(p) == (True, "")
        h.check_slow([0])  # slow calls from before the recovery: not again
        assert _state(p) == (True, "")
        dev.slow_ios = 3
        h.check_slow([0])
        assert _state(p) == (False, "slow")
        assert p.ctx.counters["flash_device_failures"] == 2


async def test_a_device_taken_over_is_never_probed_back(tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        p.health.mark_unhealthy(0, FlashIOError(errno.EBUSY, "taken"), reason="taken over")
        await p.health.revive()
        assert _state(p) == (False, "taken over")
        assert p.ctx.counters["flash_device_recoveries"] == 0


async def test_a_device_that_moved_is_reopened_where_its_locator_finds_it(tmp_path: Path
                                                                         ) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        h, dev = p.health, p.ctx.flash.devices[0]
        moved = tmp_path / "moved.img"
        shutil.copyfile(dev.path, moved)  # the same device, come back under a new name
        os.truncate(dev.path, 4096)  # the old name: too short, its probe fails
        h.mark_unhealthy(0, FlashIOError(errno.EIO, "gone"))
        where: list[str | None] = [None]
        h.locators[dev.name] = lambda: where[0]
        await h.revive()  # not found yet
        assert _state(p) == (False, "failed")
        where[0] = dev.path
        await h.revive()  # found where it was: nothing to reopen
        assert _state(p) == (False, "failed")
        where[0] = str(moved)
        await h.revive()
        assert _state(p) == (True, "")
        assert dev.path == str(moved)
        assert (p.ctx.counters["flash_device_reopened"],
                p.ctx.counters["flash_device_recoveries"]) == (1, 1)
