"""``store/devices.py``: every configured flash file opened, in order, each with the
config's ``flash.slow_io_s``; when one cannot be opened, the ones already open are closed
again (their locks and owner records released), and a shared device without a pod index
is refused naming what to set."""

from __future__ import annotations

from pathlib import Path

import pytest

from ctxmem_common.errors import InvalidArgument
from ctxmem_dpu.store.context import IOPool
from ctxmem_dpu.store.devices import open_devices
from ctxmem_dpu.tiers.flash import FlashDevice, FlashIOError

from ..storekit import make_flash, store_config


async def test_every_device_opens_in_order_with_the_configs_slow_threshold(
        tmp_path: Path) -> None:
    cfg = store_config(flash={"slow_io_s": 0.25})
    paths = [*make_flash(tmp_path / "a.img"), ("flash1", make_flash(tmp_path / "b.img")[0][1])]
    io = IOPool(1)
    try:
        devices, keeper = await open_devices(cfg, io, paths, None)
        try:
            assert [(d.index, d.name, d.path, d.slow_io_s) for d in devices] == [
                (0, "flash0", str(tmp_path / "a.img"), 0.25),
                (1, "flash1", str(tmp_path / "b.img"), 0.25)]
            assert keeper is None
        finally:
            for d in devices:
                d.close()
    finally:
        io.shutdown()


async def test_a_device_that_fails_to_open_closes_those_before_it(tmp_path: Path) -> None:
    cfg = store_config()
    good = make_flash(tmp_path / "a.img")
    io = IOPool(1)
    try:
        with pytest.raises(FlashIOError, match=r"flash device 'flash1': cannot open .*missing"):
            await open_devices(cfg, io, [*good, ("flash1", str(tmp_path / "missing.img"))],
                               None)
        # flash0 was closed: its lock and owner record are free for the next opener.
        with FlashDevice(0, "flash0", good[0][1], cfg.flash.slab_size, True) as again:
            assert again.owner is not None and again.owner.held
    finally:
        io.shutdown()


async def test_a_shared_device_needs_a_pod_index(tmp_path: Path) -> None:
    path = make_flash(tmp_path / "a.img")[0][1]
    cfg = store_config(flash={"devices": [{"name": "flash0", "backend": "local",
                                           "path": path, "shared": True}]})
    io = IOPool(1)
    try:
        with pytest.raises(InvalidArgument, match=r"flash device 'flash0' is shared "
                                                  r".*set pod.index_url and pod.node_id"):
            await open_devices(cfg, io, [("flash0", path)], None)
    finally:
        io.shutdown()
