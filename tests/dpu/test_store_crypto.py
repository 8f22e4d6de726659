"""Encryption at rest per device: a device whose storage backend encrypts in hardware (SPDK
crypto bdev) gets plaintext records with the encrypted flag clear; every other device of
the same store still gets AES-XTS ciphertext. Both read back byte-exact, before and after a
restart (rebuild)."""

from __future__ import annotations

from pathlib import Path

from ctxmem_common.flash_format import slots_per_slab
from ctxmem_dpu.blocks import Block
from ctxmem_dpu.store import BlockStore

from .storekit import LAYOUT, MASTER, get, make_flash, payload, put, session, store_config

# One flash slab's worth of blocks per batch: the tier puts each batch on the device with
# the most free slabs, so the two batches land on different devices.
PER_SLAB = slots_per_slab(1 << 20, LAYOUT.block_nbytes)
K = [bytes([i]) * 8 for i in range(2 * PER_SLAB)]


def _on_device(store: BlockStore, path: Path, b: Block) -> tuple[bytes, bool, bool]:
    """(the payload bytes as stored on the device, the header's encrypted and
    device-encrypted flags)."""
    assert b.flash is not None
    dev = store.flash.devices[b.flash.device]
    hdr = dev.read_header(b.flash.slot)
    assert hdr is not None
    with open(path, "rb") as f:
        f.seek(dev.payload_offset(b.flash.slot))
        return f.read(b.length), hdr.encrypted, hdr.device_encrypted


async def test_hardware_encrypted_device_gets_plaintext_others_ciphertext(tmp_path: Path
                                                                          ) -> None:
    paths = {"flash0": tmp_path / "f0.img", "flash1": tmp_path / "f1.img"}
    flash = [("flash0", str(paths["flash0"])), ("flash1", str(paths["flash1"]))]
    for p in paths.values():
        make_flash(p)
    cfg = store_config()
    data = {k: payload(i + 1) for i, k in enumerate(K)}
    store = BlockStore(cfg, flash, MASTER, software_crypto_off=["flash1"])
    await store.start()
    try:
        s, ns = session(store)
        for i in range(0, len(K), PER_SLAB):
            batch = {k: data[k] for k in K[i:i + PER_SLAB]}
            await put(store, s, ns, batch)
            assert await store.evict(ns, list(batch), "dram") == len(batch)
        seen = set()
        for k in K:
            b = store.index[ns.digest][k]
            assert b.flash is not None
            name = store.flash.devices[b.flash.device].name
            seen.add(name)
            stored, encrypted, by_device = _on_device(store, paths[name], b)
            if name == "flash1":  # the hardware layer encrypts: no second, software pass
                assert stored == data[k] and not encrypted and by_device
            else:
                assert stored != data[k] and encrypted and not by_device
        assert seen == {"flash0", "flash1"}
        assert await get(store, s, ns, K) == [data[k] for k in K]  # promoted from flash
        assert store.counters["integrity_failures"] == 0
    finally:
        await store.close()
    async with BlockStore(cfg, flash, MASTER, software_crypto_off=["flash1"]) as store:
        assert store.counters["recovered_blocks"] == len(K)
        s, ns = session(store)
        assert await get(store, s, ns, K) == [data[k] for k in K]
        assert store.counters["integrity_failures"] == 0
        assert store.audit() == []


async def test_store_is_an_async_context_manager(tmp_path: Path) -> None:
    flash = make_flash(tmp_path / "f.img")
    async with BlockStore(store_config(), flash, MASTER) as store:
        s, ns = session(store)
        await put(store, s, ns, {K[0]: payload(1)})
    async with BlockStore(store_config(), flash, MASTER) as again:  # exit flushed it to flash
        s, ns = session(again)
        assert await get(again, s, ns, [K[0]]) == [payload(1)]
