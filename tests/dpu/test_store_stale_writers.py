"""Store-level guards of issue 13: slots of an expired shared-memory allocation are held
back while its client can still write them, demotion never persists a block whose DRAM
bytes changed after commit, and a write-through commit is acknowledged only for blocks
durable on flash (every refusal names the device and errno)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ctxmem_common.errors import ResourceExhausted, Unavailable
from ctxmem_common.flash_format import DATA_START
from ctxmem_dpu import faults
from ctxmem_dpu.blocks import Session
from ctxmem_dpu.store import BlockStore
from tests.kit import until_async

from .storekit import LAYOUT, get, make_flash, open_store, payload, put, session, store_config

K = [bytes([i]) * 8 for i in range(1, 100)]
SLOTS = 16  # one 1 MiB DRAM slab of 64 KiB blocks


@pytest.fixture(autouse=True)
def _faults_off() -> Iterator[None]:
    faults.reset()
    yield
    faults.reset()


async def _expired_hold(store: BlockStore, s: Session) -> None:
    """Allocate every DRAM slot for ``s`` and wait until the reaper expires it."""
    _, ns = store.open_namespace(s, "model", LAYOUT, {})
    await store.allocate(s, ns, K[:SLOTS])
    await until_async(lambda: store.counters["expired_allocations"] >= 1, 5.0,
                      "the reaper to expire the allocation")


async def test_expired_shm_allocation_is_quarantined_until_the_connection_closes() -> None:
    store = await open_store(store_config(dram_size="1MiB", allocation_ttl_s=0.05), None)
    try:
        stale, _ = session(store)
        store.shm_attached(stale)
        await _expired_hold(store, stale)
        assert store.counters["stale_allocations"] == 1
        assert store.stats()["quarantined_slots"] == SLOTS
        other, ns = session(store)
        with pytest.raises(ResourceExhausted):  # the stale writer's slots are not reused
            await put(store, other, ns, {K[50]: payload(1)})
        store.shm_detached(stale)
        assert store.stats()["quarantined_slots"] == 0
        assert await put(store, other, ns, {K[50]: payload(1)}) == 1
        assert await get(store, other, ns, [K[50]]) == [payload(1)]
    finally:
        await store.close()


async def test_closing_the_session_frees_its_quarantined_slots() -> None:
    store = await open_store(store_config(dram_size="1MiB", allocation_ttl_s=0.05), None)
    try:
        stale, _ = session(store)
        store.shm_attached(stale)
        await _expired_hold(store, stale)
        assert store.stats()["quarantined_slots"] == SLOTS
        store.close_session(stale)
        assert store.stats()["quarantined_slots"] == 0
        other, ns = session(store)
        assert await put(store, other, ns, {K[50]: payload(1)}) == 1
    finally:
        await store.close()


async def test_expiry_without_a_mapping_and_aborts_free_slots_at_once() -> None:
    store = await open_store(store_config(dram_size="1MiB", allocation_ttl_s=0.05), None)
    try:
        unmapped, _ = session(store)  # never opened a shared-memory connection
        await _expired_hold(store, unmapped)
        assert store.counters["stale_allocations"] == 0
        assert store.stats()["quarantined_slots"] == 0
        mapped, ns = session(store)
        store.shm_attached(mapped)
        a, _ = await store.allocate(mapped, ns, K[:SLOTS])
        await store.commit(mapped, a.id, [], abort=True)  # the client says it is done
        assert store.stats()["quarantined_slots"] == 0
        assert await put(store, mapped, ns, {K[50]: payload(1)}) == 1
    finally:
        await store.close()


@pytest.mark.parametrize("encryption", [True, False])
async def test_demotion_drops_a_block_changed_in_dram_after_commit(
        tmp_path: Path, encryption: bool) -> None:
    store = await open_store(store_config(encryption=encryption),
                             make_flash(tmp_path / "f.img"))
    try:
        s, ns = session(store)
        await put(store, s, ns, {K[0]: payload(1), K[1]: payload(2)})
        b = store.index[ns.digest][K[0]]
        assert b.dram is not None
        store.dram.view(b.dram, 16)[:] = b"\x00" * 16  # a stale writer, after commit
        assert await store.evict(ns, [K[0], K[1]], "dram") == 1
        assert store.counters["dram_crc_mismatch"] == 1
        assert store.lookup(ns, [K[0], K[1]], prefix=False) == (1, ["", "flash"])
        assert await get(store, s, ns, [K[1]]) == [payload(2)]
        assert store.counters["flash_write_errors"] == 0 and store.flash.devices[0].healthy
        assert store.audit() == []
    finally:
        await store.close()
    store = await open_store(store_config(encryption=encryption),
                             make_flash(tmp_path / "f.img"))
    try:  # nothing of the changed block was persisted
        s, ns = session(store)
        assert store.lookup(ns, [K[0], K[1]], prefix=False) == (1, ["", "flash"])
    finally:
        await store.close()


async def _write_through(tmp_path: Path, size: int = 8 << 20) -> BlockStore:
    return await open_store(store_config(write_policy="write_through"),
                            make_flash(tmp_path / "f.img", size))


def _nothing_left(store: BlockStore, ns_digest: bytes, key: bytes, dram_before: float
                  ) -> None:
    assert key not in store.index.get(ns_digest, {})
    assert store.stats()["dram_used_bytes"] == dram_before  # its slot was freed
    assert store.audit() == []


async def test_write_through_on_a_failing_device_is_refused_as_unavailable(
        tmp_path: Path) -> None:
    store = await _write_through(tmp_path)
    try:
        s, ns = session(store)
        await put(store, s, ns, {K[0]: payload(1)})
        before = store.stats()["dram_used_bytes"]
        faults.configure(devices={"flash0": {"write": "eio"}})
        with pytest.raises(Unavailable) as err:
            await put(store, s, ns, {K[1]: payload(2)})
        assert "flash0" in str(err.value) and "Errno 5" in str(err.value)
        assert store.counters["write_through_failures"] == 1
        assert not store.flash.devices[0].healthy
        _nothing_left(store, ns.digest, K[1], before)
        # With no device usable the next commit is refused too, never kept in DRAM only.
        with pytest.raises(Unavailable) as err:
            await put(store, s, ns, {K[2]: payload(3)})
        assert "no flash device is usable" in str(err.value) and "flash0" in str(err.value)
        assert store.counters["write_through_failures"] == 2
        _nothing_left(store, ns.digest, K[2], before)
        assert await get(store, s, ns, [K[0]]) == [payload(1)]  # the rest still serves
    finally:
        await store.close()


async def test_write_through_on_a_full_filesystem_is_refused_as_exhausted(
        tmp_path: Path) -> None:
    store = await _write_through(tmp_path)
    try:
        s, ns = session(store)
        before = store.stats()["dram_used_bytes"]
        faults.configure(devices={"flash0": {"write": "enospc"}})
        with pytest.raises(ResourceExhausted) as err:
            await put(store, s, ns, {K[1]: payload(2)})
        assert "flash0" in str(err.value) and "Errno 28" in str(err.value)
        assert store.flash.devices[0].healthy  # full, not failed
        assert store.counters["write_through_failures"] == 1
        _nothing_left(store, ns.digest, K[1], before)
        faults.configure(devices={})
        assert await put(store, s, ns, {K[1]: payload(2)}) == 1
        assert store.index[ns.digest][K[1]].durable
    finally:
        await store.close()


async def test_write_through_with_the_flash_tier_full_is_refused_as_exhausted(
        tmp_path: Path) -> None:
    store = await _write_through(tmp_path, size=DATA_START + (1 << 20))  # one flash slab
    try:
        s, ns = session(store)
        held = []
        for i in range(64):  # fill flash with leased (unevictable) blocks
            try:
                await put(store, s, ns, {K[i]: payload(i + 1)})
            except ResourceExhausted as exc:
                assert "flash tier full" in str(exc) and "flash0" in str(exc)
                break
            lease, _ = await store.acquire(s, ns, [K[i]])
            held.append(lease.id)
        else:
            pytest.fail("one flash slab never filled up")
        assert store.counters["write_through_failures"] == 1
        assert K[i] not in store.index[ns.digest]
        store.release(s, held)
    finally:
        await store.close()


async def test_write_through_drops_a_block_changed_in_dram(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = await _write_through(tmp_path)
    try:
        s, ns = session(store)
        monkeypatch.setattr("ctxmem_dpu.store.demotion.crc32c_many",
                            lambda _buf, offsets, _lengths: [0xDEAD] * len(offsets))
        assert await put(store, s, ns, {K[0]: payload(1)}) == 0  # dropped, not an error
        assert store.counters["dram_crc_mismatch"] == 1
        assert store.counters["write_through_failures"] == 0
        assert K[0] not in store.index[ns.digest]
        assert store.audit() == []
    finally:
        await store.close()
