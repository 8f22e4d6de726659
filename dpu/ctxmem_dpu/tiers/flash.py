"""The flash tier: one or more block devices or files, O_DIRECT, slab-allocated extents.

This module does the I/O; the format is in :mod:`flash_format`. Functions that touch the
device are plain blocking calls meant to run on the service's I/O threads (``os.pread``
and ``os.pwrite`` release the GIL); they never touch the index.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from ctxmem_common.codecs import XtsCipher, crc32c, xts_tweak
from ctxmem_dpu.alloc import Slab, SlabAllocator, SlotRef
from ctxmem_dpu.tiers.flash_format import (
    DATA_START,
    SECTOR,
    RecordHeader,
    SlabHeader,
    Superblock,
    slots_per_slab,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Extent:
    device: int
    slot: SlotRef


class FlashIOError(OSError):
    """A device read or write failed; carries the device name and errno."""


class ReadFailure(Exception):
    """A record failed a check on read (header, namespace, key, CRC): serve a miss."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Staging(threading.local):
    """Per-thread page-aligned buffers for O_DIRECT (headers, ciphertext)."""

    def __init__(self) -> None:
        self.header = mmap.mmap(-1, SECTOR)
        self.payload: mmap.mmap | None = None

    def payload_buf(self, n: int) -> mmap.mmap:
        if self.payload is None or len(self.payload) < n:
            self.payload = mmap.mmap(-1, max(n, 1 << 20))
        return self.payload


_staging = _Staging()


def _aligned(n: int) -> mmap.mmap:
    return mmap.mmap(-1, max(SECTOR, (n + SECTOR - 1) // SECTOR * SECTOR))


class FlashDevice:
    """One device or file, formatted with a superblock and cut into slabs."""

    def __init__(self, index: int, name: str, path: str, slab_size: int, o_direct: bool) -> None:
        self.index = index
        self.name = name
        self.path = path
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if o_direct else 0)
        try:
            self.fd = os.open(path, flags)
        except OSError as exc:
            hint = (
                "the filesystem does not support O_DIRECT (tmpfs?): put the file on ext4/xfs "
                "or a block device, or set flash.o_direct: false"
                if exc.errno == errno.EINVAL
                else "check that the device exists and the service may open it"
            )
            raise FlashIOError(
                exc.errno, f"flash device {name!r}: cannot open {path}: {exc.strerror}; {hint}"
            ) from None
        self.size = os.lseek(self.fd, 0, os.SEEK_END)
        self.healthy = True
        self.superblock = self._load_or_format(slab_size)
        self.slab_size = self.superblock.slab_size
        self.alloc = SlabAllocator(
            self.superblock.num_slabs,
            slots_per_slab=lambda slot: slots_per_slab(self.slab_size, slot),
            on_assign=self._write_slab_header,
        )

    # -- layout -------------------------------------------------------------------------
    def _load_or_format(self, slab_size: int) -> Superblock:
        buf = _aligned(SECTOR)
        if self.size >= SECTOR and os.preadv(self.fd, [buf], 0) == SECTOR:
            sb = Superblock.unpack(memoryview(buf))
            if sb is not None and DATA_START + sb.num_slabs * sb.slab_size <= self.size:
                if sb.slab_size != slab_size:
                    log.warning(
                        "flash device %s keeps its formatted slab size %d (config asks %d)",
                        self.name, sb.slab_size, slab_size,
                    )
                return sb
        if self.size < DATA_START + slab_size:
            raise FlashIOError(
                errno.ENOSPC,
                f"flash device {self.name!r} ({self.path}) has {self.size} bytes; it needs at "
                f"least {DATA_START + slab_size} (1 MiB + one slab of flash.slab_size)",
            )
        sb = Superblock.new(slab_size, self.size)
        buf[:] = sb.pack()
        os.pwritev(self.fd, [buf], 0)
        os.fdatasync(self.fd)
        log.info("formatted flash device %s: %d slabs of %d bytes", self.name, sb.num_slabs,
                 slab_size)
        return sb

    def slab_base(self, slab: int) -> int:
        return DATA_START + slab * self.slab_size

    def header_offset(self, slot: SlotRef) -> int:
        return self.slab_base(slot.slab) + SECTOR + slot.index * SECTOR

    def payload_offset(self, slot: SlotRef) -> int:
        s = self.alloc.slabs[slot.slab]
        return self.slab_base(slot.slab) + SECTOR + s.capacity * SECTOR + slot.index * s.slot_size

    def _write_slab_header(self, slab: Slab) -> None:
        # Runs on the loop thread when a slab is first used: one 4 KiB write, rare.
        buf = _aligned(SECTOR)
        buf[:] = SlabHeader(slab.slot_size, slab.capacity).pack()
        self._pwrite(buf, self.slab_base(slab.id))

    # -- I/O (I/O threads) --------------------------------------------------------------
    def _pwrite(self, buf: object, offset: int) -> None:
        try:
            n = os.pwritev(self.fd, [buf], offset)  # type: ignore[list-item]
        except OSError as exc:
            raise FlashIOError(
                exc.errno, f"flash device {self.name!r}: write at {offset} failed: {exc.strerror}"
            ) from None
        if n != len(memoryview(buf)):  # type: ignore[arg-type]
            raise FlashIOError(errno.EIO, f"flash device {self.name!r}: short write at {offset}")

    def _pread(self, buf: object, offset: int) -> None:
        try:
            n = os.preadv(self.fd, [buf], offset)  # type: ignore[list-item]
        except OSError as exc:
            raise FlashIOError(
                exc.errno, f"flash device {self.name!r}: read at {offset} failed: {exc.strerror}"
            ) from None
        if n != len(memoryview(buf)):  # type: ignore[arg-type]
            raise FlashIOError(
                errno.EIO, f"flash device {self.name!r}: short read at {offset} (truncated?)"
            )

    def write_record(
        self, slot: SlotRef, header: RecordHeader, payload: memoryview, cipher: XtsCipher | None
    ) -> None:
        """Write one record: payload (encrypted when ``cipher``), then its header."""
        off = self.payload_offset(slot)
        if cipher is not None:
            buf = _staging.payload_buf(len(payload))
            out = memoryview(buf)[: len(payload)]
            cipher.encrypt_into(payload, out, xts_tweak(self.superblock.tweak_id, off))
            self._pwrite(out, off)
            out.release()
        else:
            self._pwrite(payload, off)
        hdr = _staging.header
        hdr[:] = header.pack()
        self._pwrite(hdr, self.header_offset(slot))

    def read_header(self, slot: SlotRef) -> RecordHeader | None:
        hdr = _staging.header
        self._pread(hdr, self.header_offset(slot))
        return RecordHeader.unpack(memoryview(hdr))

    def read_record(
        self,
        slot: SlotRef,
        dst: memoryview,
        namespace: bytes,
        key: bytes,
        length: int,
        crc: int,
        seq: int,
        cipher: XtsCipher | None,
    ) -> None:
        """Read a record into ``dst`` (a 4 KiB-aligned slot) and check everything.

        Raises :class:`ReadFailure` when the header does not match what the index expects
        (a swapped device, a stale or foreign extent) or the payload CRC fails.
        """
        hdr = self.read_header(slot)
        if hdr is None:
            raise ReadFailure("record header missing or corrupt")
        if hdr.namespace != namespace or hdr.key != key:
            raise ReadFailure("record header names another namespace or key")
        if hdr.seq != seq or hdr.length != length or hdr.crc != crc:
            raise ReadFailure("record header does not match the index (stale extent)")
        if hdr.encrypted != (cipher is not None):
            raise ReadFailure("record encryption flag does not match the namespace")
        off = self.payload_offset(slot)
        if cipher is not None:
            buf = _staging.payload_buf(len(dst))
            tmp = memoryview(buf)[: len(dst)]
            self._pread(tmp, off)
            cipher.decrypt_into(tmp, dst, xts_tweak(self.superblock.tweak_id, off))
            tmp.release()
        else:
            self._pread(dst, off)
        if crc32c(dst[:length]) != crc:
            raise ReadFailure("payload CRC32C mismatch")

    def invalidate(self, slot: SlotRef) -> None:
        """Zero a record's header so a restart does not bring the block back."""
        hdr = _staging.header
        hdr[:] = bytes(SECTOR)
        self._pwrite(hdr, self.header_offset(slot))

    def probe(self) -> None:
        """Read the superblock back (O_DIRECT, so from the device): raises FlashIOError
        while the device is failing, and when it holds another device's superblock."""
        buf = _aligned(SECTOR)
        self._pread(buf, 0)
        sb = Superblock.unpack(memoryview(buf))
        if sb is None or sb.device_uuid != self.superblock.device_uuid:
            raise FlashIOError(errno.EIO, f"flash device {self.name!r}: superblock changed "
                                          f"(device swapped?)")

    def sync(self) -> None:
        try:
            os.fdatasync(self.fd)
        except OSError as exc:
            raise FlashIOError(
                exc.errno, f"flash device {self.name!r}: fdatasync failed: {exc.strerror}"
            ) from None

    def scan(self) -> Iterator[tuple[SlotRef, int, RecordHeader]]:
        """Every valid record on the device: (slot, slot size, header). Reads one slab
        header and one header table per used slab."""
        sh = _aligned(SECTOR)
        for slab in range(self.superblock.num_slabs):
            self._pread(sh, self.slab_base(slab))
            header = SlabHeader.unpack(memoryview(sh))
            if header is None or header.slots != slots_per_slab(self.slab_size, header.slot_size):
                continue
            table = _aligned(header.slots * SECTOR)
            self._pread(memoryview(table)[: header.slots * SECTOR], self.slab_base(slab) + SECTOR)
            tv = memoryview(table)
            for i in range(header.slots):
                if tv[i * SECTOR : i * SECTOR + 8] != b"CTXREC01":
                    continue
                rec = RecordHeader.unpack(tv[i * SECTOR : (i + 1) * SECTOR])
                if rec is not None:
                    yield SlotRef(slab, i), header.slot_size, rec
            tv.release()
            table.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class FlashTier:
    """All flash devices; extents are spread over devices with the most free slabs."""

    def __init__(self, devices: list[FlashDevice]) -> None:
        self.devices = devices

    @property
    def enabled(self) -> bool:
        return bool(self.devices)

    def allocate(self, slot_size: int, n: int) -> list[Extent] | None:
        out: list[Extent] = []
        remaining = n
        for dev in sorted(
            (d for d in self.devices if d.healthy),
            key=lambda d: (-(d.alloc.free_slots(slot_size) + d.alloc.free_slabs), d.index),
        ):
            per = slots_per_slab(dev.slab_size, slot_size)
            room = dev.alloc.free_slots(slot_size) + dev.alloc.free_slabs * per
            take = min(room, remaining)
            if take:
                got = dev.alloc.allocate(slot_size, slot_size, take)
                assert got is not None
                out.extend(Extent(dev.index, s) for s in got)
                remaining -= take
            if not remaining:
                return out
        for ext in out:  # all or nothing
            self.free(ext)
        return None

    def free(self, ext: Extent) -> None:
        self.devices[ext.device].alloc.free(ext.slot)

    def quarantine(self, ext: Extent) -> None:
        self.devices[ext.device].alloc.quarantine(ext.slot)

    def capacity_bytes(self) -> int:
        return sum(d.superblock.num_slabs * d.slab_size for d in self.devices)

    def used_bytes(self) -> int:
        return sum(s.used * s.slot_size for d in self.devices for s in d.alloc.slabs)

    def close(self) -> None:
        for d in self.devices:
            d.close()
