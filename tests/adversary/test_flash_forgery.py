"""Someone who can write the flash device but holds no master key (issue 25 item 1), against
the real service: encryption off (``encryption.enabled: false``, so anyone can make a
CRC32C), the master key file configured as every deployment has it. A block's payload
rewritten on the device with four bytes chosen so that its CRC32C is the committed one
passes every check before authenticators; so it does with an authenticator the attacker
made for it under the public fallback key (what authenticators are keyed with when no
master key is loaded). It must be a miss, counted, never the attacker's bytes, and the
other blocks stay exact: the service loads the master key for the authenticators
although encryption is off (``keyfile.load_service_key``)."""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Callable

import numpy as np

import ctxmem
from ctxmem_common.codecs import crc32c
from ctxmem_common.codecs.blockauth import TAG_BYTES, BlockAuthenticator
from ctxmem_common.flash_format import (
    REC_OFF_TAG,
    SECTOR,
    FlashReader,
    RecordHeader,
    header_offset,
    payload_offset,
    record_context,
)
from tests.conftest import ServiceHandle
from tests.dpu.forge import forge_crc, rehash
from tests.kit import blocks, model_layout

PUBLIC_KEY = bytes(32)  # ctxmem_dpu.keyring.PUBLIC_MASTER_KEY: known to all

LAYOUT = model_layout(128)  # 128 KiB blocks


def _record(path: str, key: bytes) -> tuple[int, int, bytes, bytes]:
    """(header offset, payload offset, header entry, device UUID) of ``key``'s record on
    the flash file: all readable by whoever can read the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        reader = FlashReader(fd)
        sb = reader.superblocks().current
        assert sb is not None
        for scan in reader.walk(sb):
            for slot, k in zip(scan.records.slot, scan.records.key, strict=True):
                if k == key:
                    hdr = header_offset(scan.slab, slot, sb.slab_size)
                    return (hdr, payload_offset(scan.slab, slot, sb.slab_size, scan.slot_size),
                            os.pread(fd, SECTOR, hdr), sb.device_uuid)
    finally:
        os.close(fd)
    raise AssertionError("record not found on the flash file")


def test_payload_forged_with_its_crc32c_is_a_counted_miss(
        service_factory: Callable[..., ServiceHandle]) -> None:
    svc = service_factory(encryption=False, dram_size="32MiB", dram_slab="4MiB",
                          flash_size="64MiB", flash_slab="4MiB")
    path = svc.config["flash"]["devices"][0]["path"]
    t = LAYOUT.tokens_per_block
    keys = ctxmem.chain_hashes(range(4 * t), t)
    data = blocks(len(keys), LAYOUT.block_nbytes, 5)
    with ctxmem.Client(svc.endpoint, transport="shm") as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        ns.put(keys, data)
        assert ns.evict(keys) == 4  # on flash only: a get reads the device
        hdr_off, off, raw, dev_uuid = _record(path, keys[1])
        hdr = RecordHeader.unpack(raw)
        assert hdr is not None and hdr.tag
        n = hdr.length
        forged = forge_crc(b"attacker" * (n // 8), crc32c(data[1].tobytes()), at=n - 4)
        tag = BlockAuthenticator.for_namespace(PUBLIC_KEY, hdr.namespace).tag(
            hdr.key, forged, record_context(dev_uuid, off, hdr.seq))
        entry = bytearray(raw)
        entry[REC_OFF_TAG:REC_OFF_TAG + TAG_BYTES] = tag
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, forged, off)
            os.pwrite(fd, rehash(bytes(entry)), hdr_off)
            os.fsync(fd)
        finally:
            os.close(fd)
        out = [np.zeros_like(d) for d in data]
        assert ns.get(keys[1:2], out[1:2]) == 0, "the forged bytes were served"
        assert not out[1].any()
        st = c.stats()
        assert st["flash_auth_failures"] == 1 and st["integrity_failures"] == 1, st
        for i in (0, 2, 3):
            assert ns.get(keys[i:i + 1], out[i:i + 1]) == 1
            assert np.array_equal(out[i], data[i])
    with urllib.request.urlopen(svc.metrics_url_for("/metrics"), timeout=10) as r:
        assert "ctxmem_flash_auth_failures_total 1.0" in r.read().decode()
