"""Commit's check of a batch (ctxmem_dpu.store.slotcrc): split over threads and over the
slabs the slots are in, each block still gets the CRC32C of its own slot, and a wrong
client CRC in the middle of a batch drops exactly that block, as the one-thread check did."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from ctxmem_common.codecs import crc32c
from ctxmem_common.errors import ConfigError
from ctxmem_dpu.store import slotcrc
from ctxmem_dpu.store.slotcrc import SlotCrcs, crc_threads

from .storekit import open_store, payload, session, store_config

K = [i.to_bytes(8, "little") for i in range(64)]


@pytest.mark.parametrize("threads", [1, 3])
async def test_wrong_crc_mid_batch_drops_exactly_that_block(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    monkeypatch.setattr(slotcrc, "MIN_PART_BYTES", 1)  # split even this small batch
    store = await open_store(store_config(service={"commit_crc_threads": threads}), None)
    try:
        s, ns = session(store)
        keys = K[:40]  # 40 x 64 KiB: three 1 MiB slabs
        a, _ = await store.allocate(s, ns, keys)
        assert len({ref.slab for ref in a.slots}) > 1
        data = [payload(i + 1) for i in range(len(keys))]
        for ref, d in zip(a.slots, data, strict=True):
            store.dram.view(ref, ns.block_nbytes)[:] = d
        crcs = [crc32c(d) for d in data]
        crcs[23] ^= 1
        assert await store.commit(s, a.id, crcs, False) == 39
        assert store.counters["put_crc_mismatch"] == 1
        tiers = store.lookup(ns, keys, prefix=False)[1]
        assert tiers == ["dram"] * 23 + [""] + ["dram"] * 16
        per_ns = store.index[ns.digest]
        assert all(per_ns[k].crc == crc32c(d)
                   for i, (k, d) in enumerate(zip(keys, data, strict=True)) if i != 23)
    finally:
        await store.close()


async def test_slots_in_any_order_over_several_slabs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts per slab and per thread are put back in the order of ``refs``, whatever the
    order of the slots (here shuffled over four slabs) and lengths shorter than a slot."""
    monkeypatch.setattr(slotcrc, "MIN_PART_BYTES", 1)
    store = await open_store(store_config(), None)
    crcs = SlotCrcs(3)
    try:
        refs = store.dram.allocate(64 << 10, 60, owner="t")
        assert refs is not None and len({r.slab for r in refs}) == 4
        random.Random(5).shuffle(refs)
        for i, ref in enumerate(refs):
            store.dram.view(ref, 64 << 10)[:] = payload(i + 1)
        nbytes = (64 << 10) - 100
        assert await crcs.of_slots(store.dram, refs, nbytes) == [
            crc32c(payload(i + 1)[:nbytes]) for i in range(len(refs))]
        assert await crcs.of_slots(store.dram, [], nbytes) == []
    finally:
        crcs.shutdown()
        await store.close()


def test_thread_count_from_config() -> None:
    assert crc_threads(1) == 1 and crc_threads(6) == 6
    assert 1 <= crc_threads(0) <= 4
    with pytest.raises(ConfigError, match="commit_crc_threads"):
        store_config(service={"commit_crc_threads": -1})


def test_default_thread_count_follows_the_cpus_the_service_may_run_on() -> None:
    """A service pinned to one core (service.cpu_affinity) checks on one thread.
    sched_setaffinity(0) changes this test's own thread only, restored after."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        assert crc_threads(0) == 1 and crc_threads(3) == 3
    finally:
        os.sched_setaffinity(0, before)
    assert crc_threads(0) == min(4, len(before))
