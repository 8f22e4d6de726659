"""Authenticated flash records (issue 25 item 1): a record that was not made by a holder of
its namespace's key, for exactly this key, these bytes, this place and this sequence
number, is a miss, never data; the rebuild still finds every sound record.

The attacker writes the flash file behind the service's back. Encryption is off, so the
CRC32C is the attacker's to forge: a payload rewritten with four bytes chosen so that its
CRC32C is the original one passes every check of the record format before
authenticators (header, index, CRC32C). In-process BlockStore on real files.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ctxmem_common.codecs import crc32c
from ctxmem_common.flash_format import REC_OFF_CRC, SECTOR
from ctxmem_dpu import faults
from ctxmem_dpu.check import check_devices
from ctxmem_dpu.store import BlockStore

from ..dpu.forge import forge_crc, rehash, v1_header
from ..dpu.storekit import MASTER, get, make_flash, open_store, payload, put, session, store_config
from .kit import patch_file, settled_audit

K = [bytes([i]) * 8 for i in range(1, 40)]


@pytest.fixture(autouse=True)
def _reset_faults() -> None:
    faults.reset()


def read(path: Path, off: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(off)
        return f.read(n)


async def durable(store: BlockStore, n: int) -> tuple[object, object, dict[bytes, bytes]]:
    s, ns = session(store)
    data = {K[i]: payload(i + 1) for i in range(n)}
    await put(store, s, ns, data)
    assert await store.evict(ns, list(data), "dram") == n  # on flash only
    return s, ns, data


def where(store: BlockStore, ns: object, key: bytes) -> tuple[int, int]:
    b = store.index[ns.digest][key]  # type: ignore[attr-defined]
    assert b.flash is not None
    dev = store.flash.devices[b.flash.device]
    return dev.header_offset(b.flash.slot), dev.payload_offset(b.flash.slot)


async def test_forged_payload_with_matching_crc_is_a_miss_live_and_after_restart(
        tmp_path: Path) -> None:
    img = tmp_path / "f.img"
    flash = make_flash(img)
    cfg = store_config(encryption=False)
    store = await open_store(cfg, flash)
    try:
        s, ns, data = await durable(store, 4)
        _hdr, pay = where(store, ns, K[1])
        n = len(data[K[1]])
        forged = forge_crc(b"attacker bytes!!" * (n // 16), crc32c(data[K[1]]), at=n - 4)
        patch_file(img, pay, forged)
        assert await get(store, s, ns, [K[1]]) == []  # the CRC32C holds: still a miss
        assert store.counters["flash_auth_failures"] == 1
        assert store.counters["integrity_failures"] == 1
        for k in (K[0], K[2], K[3]):
            assert await get(store, s, ns, [k]) == [data[k]]
        assert await settled_audit(store) == []
    finally:
        await store.close()
    # The attacker writes it again (the service may have zeroed nothing: the key was not
    # confirmed); a rebuild indexes it (headers only), the read refuses it.
    patch_file(img, pay, forged)
    store = await open_store(cfg, flash)
    try:
        s, ns = session(store)
        assert await get(store, s, ns, [K[1]]) == []
        assert store.counters["flash_auth_failures"] == 1
        assert await get(store, s, ns, [K[0], K[2], K[3]]) == [data[K[0]], data[K[2]],
                                                                data[K[3]]]
    finally:
        await store.close()


async def test_record_moved_to_another_slot_or_key_is_a_miss(tmp_path: Path) -> None:
    """A whole record (header and payload, CRC32Cs sound) moved to another slot, and a
    record relabelled as another key in that key's place: both misses after a restart
    (the rebuild trusts the headers; the authenticator binds place and key)."""
    img = tmp_path / "f.img"
    flash = make_flash(img)
    cfg = store_config(encryption=False)
    store = await open_store(cfg, flash)
    try:
        _s, ns, data = await durable(store, 6)
        h0, p0 = where(store, ns, K[0])
        h5, p5 = where(store, ns, K[5])
        h1, p1 = where(store, ns, K[1])
        _h2, p2 = where(store, ns, K[2])
        n = len(data[K[0]])
    finally:
        await store.close()
    rec0 = read(img, h0, SECTOR)
    # K[0]'s record moved to K[5]'s slot (K[5] gone, as if deleted).
    patch_file(img, h5, rec0)
    patch_file(img, p5, read(img, p0, n))
    patch_file(img, h0, bytes(SECTOR))
    # K[1]'s place now holds K[2]'s bytes, labelled K[1] (key, CRC32C and header CRC
    # rewritten: everything the format checked before authenticators).
    hdr1 = bytearray(read(img, h1, SECTOR))
    hdr1[REC_OFF_CRC:REC_OFF_CRC + 4] = crc32c(data[K[2]]).to_bytes(4, "little")
    patch_file(img, h1, rehash(bytes(hdr1)))
    patch_file(img, p1, read(img, p2, n))
    store = await open_store(cfg, flash)
    try:
        s, ns = session(store)
        assert await get(store, s, ns, [K[0]]) == []
        assert await get(store, s, ns, [K[1]]) == []
        assert store.counters["flash_auth_failures"] == 2
        assert await get(store, s, ns, [K[2], K[3], K[4]]) == [data[K[2]], data[K[3]],
                                                                data[K[4]]]
        assert await settled_audit(store) == []
    finally:
        await store.close()


@pytest.mark.parametrize("mode", ["plain", "xts", "device_encrypted"])
async def test_zeroed_authenticator_is_a_miss(tmp_path: Path, mode: str) -> None:
    """On every encryption layer: none, ctxmem's AES-XTS, and a device whose storage layer
    encrypts (an SPDK crypto bdev or a BlueField: ctxmem writes plaintext, the service
    still makes and checks the authenticators)."""
    from ctxmem_common.flash_format import REC_OFF_TAG, RecordHeader

    img = tmp_path / "f.img"
    flash = make_flash(img)
    encryption = mode == "xts"
    cfg = store_config(encryption=mode != "plain")
    store = BlockStore(cfg, flash, MASTER,
                       software_crypto_off=["flash0"] if mode == "device_encrypted" else ())
    await store.start()
    try:
        s, ns, data = await durable(store, 3)
        hdr, _pay = where(store, ns, K[1])
        raw = bytearray(read(img, hdr, SECTOR))
        h = RecordHeader.unpack(bytes(raw))
        assert h is not None and (h.encrypted, h.device_encrypted) == (
            encryption, mode == "device_encrypted")
        assert any(raw[REC_OFF_TAG:REC_OFF_TAG + 28])
        raw[REC_OFF_TAG:REC_OFF_TAG + 28] = bytes(28)
        patch_file(img, hdr, rehash(bytes(raw)))
        assert await get(store, s, ns, [K[1]]) == []
        assert store.counters["flash_auth_failures"] == 1
        assert await get(store, s, ns, [K[0], K[2]]) == [data[K[0]], data[K[2]]]
        assert await settled_audit(store) == []
    finally:
        await store.close()
    if encryption:  # the key was confirmed (key check, CRC32C): the record is zeroed
        assert read(img, hdr, SECTOR) == bytes(SECTOR)


async def test_old_format_records_are_counted_misses_and_the_rest_rebuilds(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Records of format version 1 (CRC32C only) after an upgrade: not served, counted in
    flash_legacy_records and logged once; their slots are reused; every record of the
    current format is rebuilt and served."""
    img = tmp_path / "f.img"
    flash = make_flash(img)
    cfg = store_config()
    store = await open_store(cfg, flash)
    try:
        _s, ns, data = await durable(store, 8)
        old = [where(store, ns, k)[0] for k in K[:3]]
    finally:
        await store.close()
    for h in old:  # as the previous release wrote them: version 1, CRC32C at offset 125
        patch_file(img, h, v1_header(read(img, h, SECTOR)))
    caplog.set_level(logging.WARNING, "ctxmem_dpu.store")
    store = await open_store(cfg, flash)
    try:
        assert store.counters["flash_legacy_records"] == 3
        assert store.counters["recovered_blocks"] == 5
        assert sum("format version 1" in r.getMessage() for r in caplog.records) == 1
        s, ns = session(store)
        assert await get(store, s, ns, K[:3]) == []
        assert await get(store, s, ns, K[3:8]) == [data[k] for k in K[3:8]]
        # Their slots are free: new blocks take them (the table entries are overwritten).
        more = {K[10 + i]: payload(50 + i) for i in range(3)}
        await put(store, s, ns, more)
        assert await store.evict(ns, list(more), "dram") == 3
        assert await get(store, s, ns, list(more)) == list(more.values())
        assert await settled_audit(store) == []
    finally:
        await store.close()


async def test_check_reports_authenticator_failures(tmp_path: Path) -> None:
    """``ctxmem check`` verifies every record's authenticator: a forged payload (CRC32C
    matching) is a record_auth error, an old-format record a warning, repaired (zeroed)."""
    img = tmp_path / "f.img"
    flash = make_flash(img)
    store = await open_store(store_config(encryption=False), flash)
    try:
        _s, ns, data = await durable(store, 4)
        _hdr, pay = where(store, ns, K[2])
        old_hdr, _p = where(store, ns, K[3])
    finally:
        await store.close()
    clean = check_devices(flash, MASTER)
    assert clean.clean and clean.payloads_verified == 4, clean
    n = len(data[K[2]])
    patch_file(img, pay, forge_crc(bytes(n), crc32c(data[K[2]])))
    patch_file(img, old_hdr, v1_header(read(img, old_hdr, SECTOR)))
    lines: list[str] = []
    rep = check_devices(flash, MASTER, log=lines)
    kinds = sorted(p.kind for d in rep.devices for p in d.problems)
    assert kinds == ["record_auth", "record_old_format"], lines
    assert not rep.clean and rep.errors == 1 and rep.warnings == 1
    # Unencrypted: a wrong master key would look the same, so --repair leaves it.
    rep = check_devices(flash, MASTER, repair=True)
    assert [p.repaired for d in rep.devices for p in d.problems
            if p.kind == "record_old_format"] == [True]
    assert [p.repaired for d in rep.devices for p in d.problems
            if p.kind == "record_auth"] == [False]
    # Without the master key the authenticators cannot be checked: said, as a warning.
    rep = check_devices(flash, None)
    assert [p.kind for d in rep.devices for p in d.problems] == ["record_auth_unverified"]
    assert "3 records" in rep.devices[0].problems[0].detail
    assert rep.clean
