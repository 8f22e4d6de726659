"""The on-flash format: self-describing, so the index can be rebuilt from the device.

Device layout (all offsets and sizes multiples of 4 KiB; every I/O is O_DIRECT)::

    0          superblock (4 KiB): magic "CTXMEMSB", version, slab size, slab count,
               device UUID, CRC32C
    1 MiB      slab 0 | slab 1 | ... (flash.slab_size each)

    slab:      slab header (4 KiB): magic "CTXSLAB1", version, slot size, slot count, CRC
               record-header table: slot count x 4 KiB (one header per slot)
               payload area: slot count x slot size

    record header (first bytes of its 4 KiB entry, little-endian):
        magic "CTXREC01" | version u16 | flags u16 (bit 0: payload encrypted) | pad u32 |
        namespace digest 16 B | key length u8 | key 64 B | payload length u64 |
        CRC32C of the plaintext payload u32 | sequence number u64 | commit time ns u64 |
        CRC32C of everything before it u32

Why the headers sit in a table and not in front of each payload: a warm restart reads
one contiguous table per slab instead of one 4 KiB read per block (1M blocks is 4 GiB of
tables, read at device speed). A record is *durable* once its payload and its header have
been written and the device flushed (``fdatasync``); the two writes need no ordering
because a header whose payload is torn fails the payload CRC on read and is a miss.
A header whose own CRC fails is an empty slot. Delete writes a zero header.
"""

from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass

from ctxmem_common.codecs import crc32c

SECTOR = 4096
DATA_START = 1 << 20
FORMAT_VERSION = 1

SB_MAGIC = b"CTXMEMSB"
SLAB_MAGIC = b"CTXSLAB1"
REC_MAGIC = b"CTXREC01"

_SB = struct.Struct("<8sIQI16s")  # magic, version, slab_size, num_slabs, uuid
_SLAB = struct.Struct("<8sIQI")  # magic, version, slot_size, slots
_REC = struct.Struct("<8sHHI16sB64sQIQQ")
_CRC = struct.Struct("<I")
FLAG_ENCRYPTED = 1


@dataclass(frozen=True, slots=True)
class Superblock:
    slab_size: int
    num_slabs: int
    device_uuid: bytes

    def pack(self) -> bytes:
        body = _SB.pack(SB_MAGIC, FORMAT_VERSION, self.slab_size, self.num_slabs, self.device_uuid)
        return (body + _CRC.pack(crc32c(body))).ljust(SECTOR, b"\0")

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> Superblock | None:
        body = bytes(raw[: _SB.size])
        magic, version, slab_size, num_slabs, dev_uuid = _SB.unpack(body)
        (crc,) = _CRC.unpack_from(raw, _SB.size)
        if magic != SB_MAGIC or crc != crc32c(body) or version != FORMAT_VERSION:
            return None
        return cls(slab_size, num_slabs, dev_uuid)

    @classmethod
    def new(cls, slab_size: int, device_bytes: int) -> Superblock:
        num = max(0, (device_bytes - DATA_START) // slab_size)
        return cls(slab_size, num, uuid.uuid4().bytes)

    @property
    def tweak_id(self) -> int:
        """The device part of the XTS tweak: moving ciphertext between devices breaks it."""
        return int.from_bytes(self.device_uuid[:8], "little")


@dataclass(frozen=True, slots=True)
class SlabHeader:
    slot_size: int
    slots: int

    def pack(self) -> bytes:
        body = _SLAB.pack(SLAB_MAGIC, FORMAT_VERSION, self.slot_size, self.slots)
        return (body + _CRC.pack(crc32c(body))).ljust(SECTOR, b"\0")

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> SlabHeader | None:
        body = bytes(raw[: _SLAB.size])
        magic, version, slot_size, slots = _SLAB.unpack(body)
        (crc,) = _CRC.unpack_from(raw, _SLAB.size)
        if magic != SLAB_MAGIC or crc != crc32c(body) or version != FORMAT_VERSION:
            return None
        return cls(slot_size, slots)


def slots_per_slab(slab_size: int, slot_size: int) -> int:
    """Slots of ``slot_size`` that fit in a slab with its header and header table."""
    if slot_size <= 0 or slot_size % SECTOR:
        return 0
    return max(0, (slab_size - SECTOR) // (SECTOR + slot_size))


@dataclass(frozen=True, slots=True)
class RecordHeader:
    namespace: bytes
    key: bytes
    length: int
    crc: int
    seq: int
    encrypted: bool
    committed_ns: int = 0

    def pack(self) -> bytes:
        body = _REC.pack(
            REC_MAGIC,
            FORMAT_VERSION,
            FLAG_ENCRYPTED if self.encrypted else 0,
            0,
            self.namespace,
            len(self.key),
            self.key,
            self.length,
            self.crc,
            self.seq,
            self.committed_ns,
        )
        return (body + _CRC.pack(crc32c(body))).ljust(SECTOR, b"\0")

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> RecordHeader | None:
        """The header in ``raw``, or ``None`` for an empty, torn or foreign entry."""
        if bytes(raw[:8]) != REC_MAGIC:
            return None
        body = bytes(raw[: _REC.size])
        (crc,) = _CRC.unpack_from(raw, _REC.size)
        if crc != crc32c(body):
            return None
        _m, version, flags, _pad, ns, klen, key, length, dcrc, seq, ts = _REC.unpack(body)
        if version != FORMAT_VERSION or not 1 <= klen <= 64:
            return None
        return cls(ns, key[:klen], length, dcrc, seq, bool(flags & FLAG_ENCRYPTED), ts)
