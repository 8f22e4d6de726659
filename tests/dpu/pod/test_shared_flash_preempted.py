"""A pod node whose NVMe reservation key was preempted (another node judged it dead and
took its slabs) stops acknowledging durable writes and says why (issue 26 item 1).

On the host there is no NVMe target: the device write fails the way the block layer
reports a Reservation Conflict (``EBADE``), injected by the service's fault layer
(``devices: {write: ebade}``), on a real shared file with a real redis-server. The real
preemption, on SPDK's NVMe-oF target, is tests/vm/test_nvme_resv_vm.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ctxmem_common.errors import Unavailable
from ctxmem_dpu import faults
from ctxmem_dpu.metrics import StoreCollector
from tests.dpu.storekit import get, put
from tests.kit import until_async

from .podkit import DEVICE, block_bytes, format_shared, node, session

MIB = 1 << 20
SLAB = MIB
LEASE_S = 1.0


@pytest.fixture(autouse=True)
def _no_faults() -> Iterator[None]:
    faults.reset()
    yield
    faults.reset()


@pytest.fixture
def shared(tmp_path: Path) -> str:
    path = str(tmp_path / "shared.img")
    format_shared(path, SLAB, size=MIB + 4 * SLAB)
    return path


async def test_a_preempted_node_refuses_durable_writes_and_says_why(
        redis_server: Any, shared: str) -> None:
    async with node(redis_server.url, "a", shared, SLAB, LEASE_S,
                    write_policy="write_through") as a:
        dev = a.flash.devices[0]
        assert dev.fencing == "epoch_only"  # a file: no reservations, the epoch fences
        s, ns = session(a, 64)
        first = block_bytes(b"first", 64 << 10)
        assert await put(a, s, ns, {b"first": first}) == 1
        # A spare slab leased (and stamped) beside the one holding the block: a clean stop
        # would give it back (blank its stamp), which a preempted node may not do.
        await until_async(lambda: dev.alloc.free_slab_ids(), 20 * LEASE_S,
                          "a spare slab leased", 0.05)
        faults.configure(devices={DEVICE: {"write": "ebade"}})
        with pytest.raises(Unavailable) as err:
            await put(a, s, ns, {b"second": block_bytes(b"second", 64 << 10)})
        text = str(err.value)
        assert "preempted" in text and "restart the service" in text, text
        assert b"second" not in a.index[ns.digest], "a refused put was indexed"
        assert dev.fencing == "preempted" and dev.fence is not None
        assert "reservation" in dev.fence.stopped
        assert faults.injected().get("write:ebade", 0) >= 1
        # The device is not failed (nothing is wrong with it), but this node writes
        # nothing more there, fault or not: the reason stays until a restart.
        faults.reset()
        assert dev.healthy
        with pytest.raises(Unavailable) as err:
            await put(a, s, ns, {b"third": block_bytes(b"third", 64 << 10)})
        assert "preempted" in str(err.value)
        assert faults.injected() == {}, "the device was written after the preemption"
        # What it acknowledged before stays served.
        assert await get(a, s, ns, [b"first"]) == [first]
        image = Path(shared).read_bytes()
        assert a.counters["write_through_failures"] >= 2
        # Visible in the metrics (ctxmem status reads them): one-hot, this device.
        fam = {m.name: m for m in StoreCollector(a).collect()}["ctxmem_flash_shared_fencing"]
        assert {(x.labels["mode"], x.value) for x in fam.samples} == {
            ("reservation", 0.0), ("epoch_only", 0.0), ("preempted", 1.0)}
    # A clean stop writes nothing either (its empty slabs' lease stamps stay: it may not
    # write there; the others take them once it is dead).
    assert Path(shared).read_bytes() == image, "the preempted node wrote at its stop"


async def test_a_file_is_fenced_by_the_epoch_alone_and_the_metrics_say_so(
        redis_server: Any, shared: str) -> None:
    async with node(redis_server.url, "a", shared, SLAB, LEASE_S) as a:
        fam = {m.name: m for m in StoreCollector(a).collect()}["ctxmem_flash_shared_fencing"]
        assert {(x.labels["device"], x.labels["mode"], x.value) for x in fam.samples} == {
            (DEVICE, "reservation", 0.0), (DEVICE, "epoch_only", 1.0),
            (DEVICE, "preempted", 0.0)}
        assert "not a block device" in a.flash.devices[0].resv_absent
