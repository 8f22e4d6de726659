"""BlockStore's lifetime: a start that fails half way closes what it opened (issue 31:
``BlockStore.__aenter__`` leaked on a failed start: the flash device stayed locked with its
owner record, and the I/O threads ran on)."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest

from ctxmem_dpu.store import BlockStore
from ctxmem_dpu.tiers.flash_owner import OWNER_OFFSET, SECTOR, OwnerRecord
from tests.dpu.storekit import MASTER, make_flash, store_config


def _owner(path: Path) -> OwnerRecord | None:
    with open(path, "rb") as f:
        f.seek(OWNER_OFFSET)
        return OwnerRecord.unpack(f.read(SECTOR))


async def test_a_failed_start_closes_what_it_opened(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "flash0.img"
    flash = make_flash(path, 16 << 20)
    cfg = store_config()
    threads = set(threading.enumerate())
    store = BlockStore(cfg, flash, MASTER)

    async def broken() -> None:  # after the devices are open and the owner record written
        assert _owner(path) is not None
        raise OSError(errno.EIO, "index rebuild failed (test)")

    monkeypatch.setattr(store._recovery, "rebuild", broken)
    with pytest.raises(OSError, match="index rebuild failed"):
        async with store:
            pytest.fail("the body ran after a failed start")
    assert _owner(path) is None, "the device's owner record outlived the failed start"
    assert not [t for t in threading.enumerate() if t not in threads and t.is_alive()], \
        "threads of the failed store still run"
    async with BlockStore(cfg, flash, MASTER) as again:  # not "in use" by the failed one
        assert again.stats()["flash_devices_healthy"] == 1
