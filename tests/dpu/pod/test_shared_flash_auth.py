"""Shared flash trusts nothing until it verifies (issue 25 item 1): the device is written by
every node of the pod and reachable by its storage target, so a record rewritten there
by anyone without the pod's master key, copied to another place, relabelled as another
key, stripped of its authenticator or written in the previous format is a miss of
:class:`SharedFlashSource`, never bytes, even when the index entry it is read for was
forged to match (the index only says where to look).

A pod node on a shared file with a real redis-server; encryption off, so the CRC32C is the
attacker's to forge; and once with encryption on (the default), where the authenticator
is checked after decryption."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from ctxmem_common.codecs import crc32c
from ctxmem_common.config import EncryptionConfig
from ctxmem_common.flash_format import REC_OFF_CRC, SECTOR, RecordHeader
from ctxmem_dpu.pod.shared_flash import SharedFlashSource
from ctxmem_dpu.pod.slab_leases import SlabLeases
from ctxmem_dpu.store import BlockStore
from ctxmem_dpu.tiers.flash import FlashDevice

from ..forge import forge_crc, rehash, v1_header
from .podkit import (
    DEVICE,
    MASTER,
    Published,
    block_bytes,
    format_shared,
    pod_config,
    put_durable,
    session,
)

MIB = 1 << 20
SLAB = MIB  # 64 KiB blocks: 14 per slab


@pytest.fixture
def shared(tmp_path: Path) -> str:
    path = str(tmp_path / "shared.img")
    format_shared(path, SLAB, size=MIB + 4 * SLAB)
    return path


@contextlib.asynccontextmanager
async def node(url: str, path: str, encryption: bool) -> AsyncIterator[BlockStore]:
    """Pod node "a" on the shared device (podkit.node, with encryption on or off)."""
    cfg = pod_config(path, SLAB, 5.0)
    cfg = dataclasses.replace(cfg, encryption=EncryptionConfig(enabled=encryption))
    client = aioredis.Redis.from_url(url)
    try:
        store = BlockStore(cfg, [(DEVICE, path)], MASTER,
                           slab_leases=SlabLeases(client, "a", 5.0))
        async with store:
            yield store
    finally:
        await client.aclose()


def header_at(path: str, offset: int) -> int:
    """The record header's offset for the payload at ``offset`` (from the slab header)."""
    with FlashDevice(0, "x", path, SLAB, True, lock=False) as raw:
        slab = (offset - MIB) // raw.slab_size
        cap = raw.reader.slab_header(slab, raw.slab_size)
        assert cap is not None
        base = MIB + slab * raw.slab_size
        index = (offset - base - SECTOR - cap.slots * SECTOR) // cap.slot_size
        return base + SECTOR + index * SECTOR


def rw(path: str, off: int, data: bytes | None = None, n: int = SECTOR) -> bytes:
    fd = os.open(path, os.O_RDWR)
    try:
        if data is not None:
            os.pwrite(fd, data, off)
            os.fsync(fd)
            return data
        return os.pread(fd, n, off)
    finally:
        os.close(fd)


async def fetch(src: SharedFlashSource, p: Published) -> bytes | None:
    return (await src.fetch(p.ns, [p.entry], [p.key]))[0]


async def published(url: str, shared: str, encryption: bool, n: int) -> list[Published]:
    async with node(url, shared, encryption) as a:
        s, ns = session(a, 64)
        pubs = await put_durable(a, "a", s, ns, [b"k%d" % i for i in range(n)])
    assert len(pubs) == n
    return pubs


async def test_forged_payload_with_matching_crc_is_a_miss(redis_server: Any, shared: str
                                                          ) -> None:
    pubs = await published(redis_server.url, shared, False, 3)
    p = pubs[1]
    loc = p.entry.shared
    assert loc is not None
    with SharedFlashSource([shared], MASTER, encrypt=False) as src:
        assert await fetch(src, p) == block_bytes(p.key, loc.length)
    n = loc.length
    rw(shared, loc.offset, forge_crc(b"attacker" * (n // 8), p.entry.crc32c, at=n - 4))
    with SharedFlashSource([shared], MASTER, encrypt=False) as src:
        assert await fetch(src, p) is None  # header, entry and CRC32C all match: a miss
        assert src.counters["unauthenticated"] == 1
        for q in (pubs[0], pubs[2]):
            assert await fetch(src, q) == block_bytes(q.key, n)


async def test_record_relabelled_or_moved_with_a_forged_entry_is_a_miss(
        redis_server: Any, shared: str) -> None:
    """k1's place rewritten with k0's bytes, labelled k1 (key, CRC32C, sequence number as
    the entry says), and an entry forged to match; k0's whole record copied to a free
    slot, and an entry pointing there: both misses."""
    pubs = await published(redis_server.url, shared, False, 3)
    p0, p1 = pubs[0], pubs[1]
    l0, l1 = p0.entry.shared, p1.entry.shared
    assert l0 is not None and l1 is not None
    n = l0.length
    h0, h1 = header_at(shared, l0.offset), header_at(shared, l1.offset)
    # Relabel: k1's header names k0's CRC32C; its payload is k0's bytes.
    hdr1 = bytearray(rw(shared, h1))
    hdr1[REC_OFF_CRC:REC_OFF_CRC + 4] = p0.entry.crc32c.to_bytes(4, "little")
    rw(shared, h1, rehash(bytes(hdr1)))
    rw(shared, l1.offset, rw(shared, l0.offset, n=n))
    relabelled = dataclasses.replace(p1, entry=dataclasses.replace(
        p1.entry, crc32c=p0.entry.crc32c))
    # Move: k0's record (header and payload) copied to the slot after k2's.
    free = dataclasses.replace(l0, offset=pubs[2].entry.shared.offset + n)  # type: ignore[union-attr]
    rw(shared, header_at(shared, free.offset), rw(shared, h0))
    rw(shared, free.offset, rw(shared, l0.offset, n=n))
    moved = dataclasses.replace(p0, entry=dataclasses.replace(p0.entry, shared=free))
    hdr = RecordHeader.unpack(rw(shared, header_at(shared, free.offset)))
    assert hdr is not None and hdr.key == p0.key and hdr.crc == p0.entry.crc32c
    with SharedFlashSource([shared], MASTER, encrypt=False) as src:
        assert await fetch(src, relabelled) is None
        assert await fetch(src, moved) is None
        assert src.counters["unauthenticated"] == 2
        assert await fetch(src, p0) == block_bytes(p0.key, n)  # the original still reads


@pytest.mark.parametrize("encryption", [False, True])
async def test_stripped_authenticator_and_old_format_are_misses(
        redis_server: Any, shared: str, encryption: bool) -> None:
    pubs = await published(redis_server.url, shared, encryption, 3)
    from ctxmem_common.flash_format import REC_OFF_TAG

    h0 = header_at(shared, pubs[0].entry.shared.offset)  # type: ignore[union-attr]
    h1 = header_at(shared, pubs[1].entry.shared.offset)  # type: ignore[union-attr]
    raw = bytearray(rw(shared, h0))
    raw[REC_OFF_TAG:REC_OFF_TAG + 28] = bytes(28)
    rw(shared, h0, rehash(bytes(raw)))
    rw(shared, h1, v1_header(rw(shared, h1)))
    with SharedFlashSource([shared], MASTER, encrypt=encryption) as src:
        got = await src.fetch(pubs[0].ns, [p.entry for p in pubs], [p.key for p in pubs])
        assert got[:2] == [None, None]
        assert bytes(got[2] or b"") == block_bytes(pubs[2].key, pubs[2].entry.nbytes)
        assert src.counters["unauthenticated"] == 1 and src.counters["hits"] == 1


async def test_another_pods_master_key_with_encryption_off_is_a_miss(
        redis_server: Any, shared: str) -> None:
    """Encryption off, the records are plaintext: only the authenticator tells a node
    with the pod's master key from one without."""
    pubs = await published(redis_server.url, shared, False, 2)
    with SharedFlashSource([shared], bytes(31) + b"\x01", encrypt=False) as src:
        assert await src.fetch(pubs[0].ns, [p.entry for p in pubs]) == [None, None]
    with SharedFlashSource([shared], MASTER, encrypt=False) as src:
        got = await src.fetch(pubs[0].ns, [p.entry for p in pubs])
        assert [bytes(g or b"") for g in got] == [block_bytes(p.key, p.entry.nbytes)
                                                  for p in pubs]
    assert crc32c(block_bytes(pubs[0].key, pubs[0].entry.nbytes)) == pubs[0].entry.crc32c
