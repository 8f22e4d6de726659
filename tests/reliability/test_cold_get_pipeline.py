"""A cold get is a pipeline (issue 27 item 4; ``FlashDevice.read_payloads`` with ``ahead``,
``ctxmem_dpu.store.promotion``): one I/O thread decrypts and checks run k of a batch's
payloads while another reads run k + 1 straight into its DRAM slots.

Pinned here, with AES-XTS and authenticators on, on real files: every block of a
many-run cold get comes back exact; the read of run k + 1 has started before run k is
checked (seen through the tiers' test trace, not timed: the check of run k waits for the
other thread to start reading k + 1, which the serial reader never did); a record
tampered with in the middle of the batch is a quarantined miss that ends the run there,
the blocks after it in the batch promoted and served; a device read error in the middle
of the pipeline cuts the run at the failed read's first block, fails the device, and
leaves no block pinned and no DRAM slot held; the store counts the runs and how each was
read, and the counts add up. The last test does a cold get through a real service.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ctxmem
from ctxmem_dpu import faults
from ctxmem_dpu.store import BlockStore
from ctxmem_dpu.tiers import flash_records
from tests.conftest import ServiceHandle
from tests.kit import blocks, byte_layout

from ..dpu.storekit import get, make_flash, open_store, payload, put, session, store_config
from .kit import patch_file, settled_audit

K = [b"pipe-%04d" % i for i in range(64)]
N = 60  # 64 KiB blocks, 15 to a 1 MiB slab: four slabs, four payload runs of 15
RUN = 15


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    faults.reset()
    yield
    faults.reset()
    flash_records.trace = None


async def _cold(tmp_path: Path, n: int = N) -> tuple[BlockStore, Any, Any, dict[bytes, bytes]]:
    """A store (AES-XTS on, two I/O threads) with ``n`` blocks on flash only, one device."""
    store = await open_store(store_config(dram_size="8MiB", encryption=True),
                             make_flash(tmp_path / "f.img", 16 << 20))
    s, ns = session(store)
    data = {K[i]: payload(i + 1) for i in range(n)}
    await put(store, s, ns, data)
    assert await store.evict(ns, list(data), "dram") == n
    return store, s, ns, data


def _no_pins(store: BlockStore, ns: Any) -> list[bytes]:
    return [k for k, b in store.index[ns.digest].items() if b.pins]


async def test_many_run_cold_get_is_exact_and_counted(tmp_path: Path) -> None:
    store, s, ns, data = await _cold(tmp_path)
    try:
        keys = list(data)
        assert await get(store, s, ns, keys) == [data[k] for k in keys]
        c = store.counters
        assert c["promoted_blocks"] == N and c["integrity_failures"] == 0
        # One checking thread (two I/O threads, one part), four runs: the first read by
        # the checking thread, each later one counted once by how it was read.
        assert c["cold_read_runs"] == N // RUN
        assert c["cold_reads_ahead"] + c["cold_reads_taken_back"] + c["cold_reads_helped"] \
            == N // RUN - 1
        assert _no_pins(store, ns) == []
        assert await settled_audit(store) == []
    finally:
        await store.close()


async def test_next_run_is_read_before_this_run_is_checked(tmp_path: Path) -> None:
    store, s, ns, data = await _cold(tmp_path)
    try:
        started = {r: threading.Event() for r in range(N // RUN)}
        seen: list[tuple[str, int, bool]] = []

        def trace(event: str, r: int) -> None:
            if event == "reading":
                started[r].set()
            elif event == "checking" and r + 1 in started:
                # Decrypting and checking run r waits (bounded) until run r + 1's read has
                # started: only a reader that hands that read to another thread gets on.
                seen.append((event, r, started[r + 1].wait(10.0)))

        flash_records.trace = trace
        keys = list(data)
        assert await get(store, s, ns, keys) == [data[k] for k in keys]
        assert seen == [("checking", r, True) for r in range(N // RUN - 1)]
    finally:
        await store.close()


async def test_tampered_record_mid_pipeline_is_a_miss_the_rest_served(tmp_path: Path) -> None:
    store, s, ns, data = await _cold(tmp_path)
    try:
        keys = list(data)
        bad = keys[22]  # in the second run
        b = store.index[ns.digest][bad]
        dev = store.flash.devices[b.flash.device]
        patch_file(dev.path, dev.payload_offset(b.flash.slot) + 4096, b"\x5a" * 16)
        assert await get(store, s, ns, keys) == [data[k] for k in keys[:22]]
        assert store.counters["integrity_failures"] == 1
        assert store.counters["quarantined_extents"] == 1
        assert store.lookup(ns, [bad], prefix=True)[0] == 0
        assert all(d.healthy for d in store.flash.devices)
        # Every other block of the batch, in runs before and after, was promoted.
        rest = keys[23:]
        assert all(store.index[ns.digest][k].dram is not None for k in rest)
        assert await get(store, s, ns, rest) == [data[k] for k in rest]
        assert _no_pins(store, ns) == []
        assert await settled_audit(store) == []
    finally:
        await store.close()


async def test_read_error_mid_pipeline_cuts_the_run_and_leaks_nothing(tmp_path: Path
                                                                       ) -> None:
    store, s, ns, data = await _cold(tmp_path)
    try:
        keys = list(data)
        dram_before = store.dram.used_bytes()

        def trace(event: str, r: int) -> None:
            if event == "reading" and r == 2:  # the third run's read fails, on its thread
                faults.configure(devices={"flash0": {"read": "eio", "count": 1}})

        flash_records.trace = trace
        assert await get(store, s, ns, keys) == [data[k] for k in keys[: 2 * RUN]]
        assert faults.injected() == {"read:eio": 1}
        assert not store.flash.devices[0].healthy
        assert store.counters["flash_read_errors"] == RUN  # the failed read's blocks
        assert store.counters["integrity_failures"] == 0
        on_dram = [k for k in keys if store.index[ns.digest][k].dram is not None]
        assert on_dram == keys[: 2 * RUN] + keys[3 * RUN:]  # the run after it was read
        assert _no_pins(store, ns) == []
        assert store.leases == {}
        # DRAM holds exactly the promoted blocks: the failed run's slots were freed.
        slot = len(store.dram.slot_view(store.index[ns.digest][keys[0]].dram))
        assert store.dram.used_bytes() - dram_before == len(on_dram) * slot
        assert await settled_audit(store) == []
    finally:
        await store.close()


LAYOUT = byte_layout(64 << 10)


def test_cold_get_through_a_service_is_exact_and_pipelined(
        service_factory: Callable[..., ServiceHandle]) -> None:
    svc = service_factory(dram_slab="8MiB", flash_slab="16MiB")  # AES-XTS on
    n = 192  # 12 MiB of 64 KiB blocks: 12 runs of 1 MiB
    with ctxmem.Client(svc.endpoint, transport="shm") as client:
        ns = client.open_namespace(LAYOUT, model_id="pipe")
        keys = ctxmem.chain_hashes(range(n), 1)
        data = blocks(n, LAYOUT.block_nbytes, 5)
        assert ns.put(keys, data).stored == n
        assert ns.evict(keys) == n
        out = [np.zeros_like(d) for d in data]
        assert ns.get(keys, out) == n
        assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
        st = client.stats()
        assert st["hits_flash"] == n and st["integrity_failures"] == 0, st
        assert st["cold_read_runs"] >= 12, st
        parts = st["cold_read_runs"] - (st["cold_reads_ahead"] + st["cold_reads_taken_back"]
                                        + st["cold_reads_helped"])
        assert 1 <= parts <= 2, st  # one pipeline per checking part and device group
