"""A cold get reads a batch's record headers in runs of the header tables and adjacent
payloads in one I/O each (``ctxmem_dpu.store.promotion``): over several devices and
slabs every intact block comes back exact, and a damaged, stale or foreign header is still
a counted, quarantined miss; a device read error still fails the device, through the fault
layer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from ctxmem_dpu import faults
from ctxmem_dpu.store import BlockStore
from ctxmem_dpu.tiers.flash import FlashDevice

from ..dpu.storekit import FLASH, get, make_flash, open_store, payload, put, session, store_config
from .kit import patch_file, settled_audit

K = [b"blk-%04d" % i for i in range(64)]


@pytest.fixture(autouse=True)
def _fast_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(FLASH, "probe_interval_s", 0.05)  # flash.probe_interval_s
    faults.reset()
    yield
    faults.reset()


def _flash2(tmp_path: Path) -> list[tuple[str, str]]:
    return [*make_flash(tmp_path / "a.img"), ("flash1", make_flash(tmp_path / "b.img")[0][1])]


async def _on_two_devices(store: BlockStore, n: int) -> tuple[Any, Any, dict[bytes, bytes]]:
    """``n`` blocks on flash only, half on each device, each half over two slabs (15 64 KiB
    slots per 1 MiB slab: halves of 30 fill two slabs, so the second half goes to the
    device with more free slabs, the other one)."""
    s, ns = session(store)
    data = {K[i]: payload(i + 1) for i in range(n)}
    keys = list(data)
    for half in (keys[: n // 2], keys[n // 2:]):  # the allocator picks the emptier device
        await put(store, s, ns, {k: data[k] for k in half})
        assert await store.evict(ns, half, "dram") == len(half)
    where = {(store.index[ns.digest][k].flash.device, store.index[ns.digest][k].flash.slot.slab)
             for k in keys}
    assert len({d for d, _ in where}) == 2 and len(where) >= 4, where
    return s, ns, data


def _reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    seen: list[tuple[str, int]] = []
    real = FlashDevice._pread

    def counting(self: FlashDevice, buf: object, offset: int) -> None:
        seen.append((self.name, offset))
        real(self, buf, offset)

    monkeypatch.setattr(FlashDevice, "_pread", counting)
    return seen


@pytest.mark.parametrize("encryption", [True, False])
async def test_batch_promote_serves_exact_bytes_in_few_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, encryption: bool) -> None:
    store = await open_store(store_config(dram_size="8MiB", encryption=encryption),
                             _flash2(tmp_path))
    try:
        s, ns, data = await _on_two_devices(store, 60)
        keys = list(data)
        order = [k for pair in zip(keys[:30], keys[30:], strict=True) for k in pair]
        reads = _reads(monkeypatch)
        assert await get(store, s, ns, order) == [data[k] for k in order]
        # One read per header and one per payload would be 120 reads. Each I/O thread gets
        # 15 blocks of each device, in one slab: one header run and one payload run each.
        assert len(reads) == 8, reads
        assert store.counters["promoted_blocks"] == 60
        assert await settled_audit(store) == []
    finally:
        await store.close()


async def test_batch_promote_damaged_stale_foreign_headers(tmp_path: Path) -> None:
    store = await open_store(store_config(dram_size="8MiB"), _flash2(tmp_path))
    try:
        s, ns, data = await _on_two_devices(store, 60)
        keys = list(data)

        def loc(k: bytes) -> tuple[FlashDevice, Any]:
            b = store.index[ns.digest][k]
            return store.flash.devices[b.flash.device], b.flash.slot

        # Damaged (a flipped key bit: header CRC fails), on device 0.
        dev, slot = loc(keys[3])
        off = dev.header_offset(slot) + 40
        with open(dev.path, "rb") as f:
            f.seek(off)
            byte = f.read(1)[0]
        patch_file(dev.path, off, bytes([byte ^ 0x04]))
        # Stale (valid header, an older sequence number), on device 1.
        dev, slot = loc(keys[40])
        hdr = dev.read_header(slot)
        assert hdr is not None
        patch_file(dev.path, dev.header_offset(slot),
               dataclasses.replace(hdr, seq=hdr.seq - 1).pack())
        # Foreign (another block's record header), on device 1, other slab.
        dev, slot = loc(keys[52])
        other = dev.read_header(loc(keys[45])[1])
        assert other is not None
        patch_file(dev.path, dev.header_offset(slot), other.pack())
        bad = {keys[3], keys[40], keys[52]}

        got = await get(store, s, ns, keys)
        assert got == [data[k] for k in keys[:3]]  # the run ends at the first miss
        assert store.counters["integrity_failures"] == 3
        assert store.counters["quarantined_extents"] == 3
        assert store.stats()["flash_quarantined_slots"] == 3
        assert all(d.healthy for d in store.flash.devices)
        for k in keys:
            if k in bad:
                assert store.lookup(ns, [k], prefix=True)[0] == 0
                assert await get(store, s, ns, [k]) == []
            else:  # promoted by the same batch, exact
                assert store.index[ns.digest][k].dram is not None
                assert await get(store, s, ns, [k]) == [data[k]]
        # The foreign and stale slots were not this block's records: left as they were.
        dev, slot = loc(keys[45])
        assert dev.read_header(slot) == other
        assert await settled_audit(store) == []
    finally:
        await store.close()


async def test_batch_promote_read_error_fails_the_device_via_fault_layer(
        tmp_path: Path) -> None:
    store = await open_store(store_config(dram_size="8MiB"), _flash2(tmp_path))
    try:
        s, ns, data = await _on_two_devices(store, 60)
        keys = list(data)
        on1 = [k for k in keys if store.index[ns.digest][k].flash.device == 1]
        faults.configure(devices={"flash0": {"read": "eio", "count": 1}})
        assert await get(store, s, ns, keys) == []  # the first block is on flash0
        assert faults.injected() == {"read:eio": 1}
        assert not store.flash.devices[0].healthy
        assert store.counters["flash_read_errors"] >= 1
        assert store.counters["integrity_failures"] == 0  # an I/O error is no bad record
        # flash1's blocks were promoted by the same batch and are served exact.
        assert await get(store, s, ns, on1) == [data[k] for k in on1]
    finally:
        await store.close()
