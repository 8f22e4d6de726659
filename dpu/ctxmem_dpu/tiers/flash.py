"""The flash tier: one or more block devices or files, O_DIRECT, slab-allocated extents.

This module does the I/O; the format is in :mod:`flash_format`. Functions that touch the
device are plain blocking calls meant to run on the service's I/O threads (``os.pread``
and ``os.pwrite`` release the GIL); they never touch the index.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

from ctxmem_common.codecs import XtsCipher, crc32c, xts_tweak
from ctxmem_dpu import faults
from ctxmem_dpu.alloc import Slab, SlabAllocator, SlotRef
from ctxmem_dpu.tiers.flash_format import (
    DATA_START,
    PROBE_OFFSET,
    SECTOR,
    RecordHeader,
    SlabHeader,
    Superblock,
    TableColumns,
    parse_header_columns,
    slots_per_slab,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger(__name__)

# A single device call (read, write, fdatasync) slower than this marks the device slow:
# the store then treats it as failed (DRAM only) until a probe is fast again. Tests and
# the chaos campaign lower it with CTXMEM_FLASH_SLOW_IO_S.
SLOW_IO_S = float(os.environ.get("CTXMEM_FLASH_SLOW_IO_S", "2.0"))
_ZEROS = mmap.mmap(-1, 1 << 20)  # never written: a source of aligned zero bytes


class Extent(NamedTuple):
    """Where a block lives on flash. A NamedTuple (not a frozen dataclass) because a warm
    restart creates one per stored block and tuple construction is several times cheaper."""

    device: int
    slot: SlotRef


class FlashIOError(OSError):
    """A device read or write failed; carries the device name and errno."""


class ShortRead(FlashIOError):
    """A read returned fewer bytes than asked: the device is shorter (truncated)."""


class ReadFailure(Exception):
    """A record failed a check on read (header, namespace, key, CRC): serve a miss.

    ``ours`` is true when the header was this block's own record and the payload was bad
    (the record is then dead for good); false when the slot holds another record or none
    (a stale or foreign extent, a swapped device), which must not be touched."""

    def __init__(self, reason: str, ours: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.ours = ours


# Header reads of a batch (see FlashDevice.read_headers): the headers of slots in one slab
# are read as runs of the slab's header table, one I/O per run. Two wanted slots at most
# HEADER_GAP sectors apart share a run (reading the sectors between costs less than another
# I/O's latency); a run is at most HEADER_RUN sectors long.
HEADER_GAP = 16
HEADER_RUN = 256
# Payloads of adjacent slots (the order demotion wrote them in) are read in one I/O of at
# most PAYLOAD_RUN bytes: small blocks stop paying one device round trip each. Blocks of
# PAYLOAD_RUN or more are read one per I/O, as before (larger reads measured no faster).
PAYLOAD_RUN = 1 << 20


class _Staging(threading.local):
    """Per-thread page-aligned buffers for O_DIRECT (headers, header-table runs,
    ciphertext), anonymous memory reused across calls so their pages are faulted once."""

    def __init__(self) -> None:
        self.header = mmap.mmap(-1, SECTOR)
        self.payload: mmap.mmap | None = None
        self.table: mmap.mmap | None = None

    def payload_buf(self, n: int) -> mmap.mmap:
        if self.payload is None or len(self.payload) < n:
            self.payload = mmap.mmap(-1, max(n, 1 << 20))
        return self.payload

    def table_buf(self) -> mmap.mmap:
        if self.table is None or len(self.table) < HEADER_RUN * SECTOR:
            self.table = mmap.mmap(-1, HEADER_RUN * SECTOR)
        return self.table


_staging = _Staging()


class _TableBuffers:
    """Aligned buffers for scanning header tables (a warm restart), reused across slabs
    so their pages are faulted in once, and dropped when the restart is done."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def get(self, n: int) -> mmap.mmap:
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) >= n:
                    return self._free.pop(i)
        return mmap.mmap(-1, max(n, 1 << 20))

    def put(self, buf: mmap.mmap) -> None:
        with self._lock:
            self._free.append(buf)

    def clear(self) -> None:
        with self._lock:
            for buf in self._free:
                buf.close()
            self._free.clear()


scan_buffers = _TableBuffers()


def _aligned(n: int) -> mmap.mmap:
    return mmap.mmap(-1, max(SECTOR, (n + SECTOR - 1) // SECTOR * SECTOR))


class FlashSlabAllocator(SlabAllocator):
    """The slab allocator plus a bulk claim for the warm restart.

    ``SlabAllocator.claim`` removes one slot from a slab's free list (O(slots) each, so
    O(slots²) per slab); rebuilding 1M blocks needs O(slots) per slab.
    """

    def claim_slots(self, slab_id: int, slot_size: int, indices: list[int]) -> None:
        slab = self.slabs[slab_id]
        if slab.klass is None:
            self._free_slabs.remove(slab.id)
            slab.klass = slot_size
            slab.slot_size = slot_size
            slab.capacity = self._slots_per_slab(slot_size)
            slab.free = list(range(slab.capacity - 1, -1, -1))
            slab.used = 0
        assert slab.klass == slot_size, f"slab {slab_id} claimed for {slot_size}: {slab.klass}"
        before = len(slab.free)
        slab.free = sorted(set(slab.free).difference(indices), reverse=True)
        slab.used += before - len(slab.free)
        partial = self._partial.setdefault(slot_size, set())
        if slab.free:
            partial.add(slab.id)
        else:
            partial.discard(slab.id)


class FlashDevice:
    """One device or file, formatted with a superblock and cut into slabs.

    ``lock``: take an exclusive ``flock`` on the device, so two services (or a service and
    ``ctxmem check --repair``) never write one device at once.
    """

    def __init__(self, index: int, name: str, path: str, slab_size: int, o_direct: bool,
                 lock: bool = True) -> None:
        self.index = index
        self.name = name
        self.path = path
        self._lock = lock
        # Descriptors replaced by reopen(): kept open until close(), since an I/O thread
        # may still be blocked on one, and a closed number could be reused under it.
        self._retired_fds: list[int] = []
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if o_direct else 0)
        self._flags = flags
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
        if lock:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(self.fd)
                self.fd = -1
                raise FlashIOError(
                    errno.EBUSY, f"flash device {name!r} ({path}) is in use by another "
                    f"process (another ctxmem service, or ctxmem check --repair)") from None
        self.size = os.lseek(self.fd, 0, os.SEEK_END)
        self.healthy = True
        self.health_reason = ""
        self.slow_ios = 0  # device calls slower than SLOW_IO_S (the store reads this)
        self._fresh: set[int] = set()  # slabs assigned but not yet initialised on flash
        self._init_lock = threading.Lock()
        self.superblock = self._load_or_format(slab_size)
        self.slab_size = self.superblock.slab_size
        self.num_slabs = self.superblock.num_slabs
        fits = max(0, (self.size - DATA_START) // self.slab_size)
        if fits < self.num_slabs:
            log.error("flash device %s holds %d bytes, less than its %d formatted slabs need "
                      "(truncated?): using the first %d slabs", name, self.size,
                      self.num_slabs, fits)
            self.num_slabs = fits
        self.alloc = FlashSlabAllocator(
            self.num_slabs,
            slots_per_slab=lambda slot: slots_per_slab(self.slab_size, slot),
            on_assign=self._slab_assigned,
        )

    # -- layout -------------------------------------------------------------------------
    def _load_or_format(self, slab_size: int) -> Superblock:
        buf = _aligned(2 * SECTOR)
        primary = backup = None
        if self.size >= 2 * SECTOR and os.preadv(self.fd, [buf], 0) == 2 * SECTOR:
            primary = Superblock.unpack(memoryview(buf)[:SECTOR])
            backup = Superblock.unpack(memoryview(buf)[SECTOR:])
        sb = primary or backup
        if sb is not None:
            if primary != sb or backup != sb:
                # One copy is damaged or missing (a device formatted before the backup
                # existed): rewrite both from the good one.
                log.warning("flash device %s: %s superblock is damaged or missing; "
                            "restoring it from the %s copy", self.name,
                            "primary" if primary != sb else "backup",
                            "backup" if primary != sb else "primary")
                self._write_superblocks(sb)
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
        self._write_superblocks(sb)
        log.info("formatted flash device %s: %d slabs of %d bytes", self.name, sb.num_slabs,
                 slab_size)
        return sb

    def _write_superblocks(self, sb: Superblock) -> None:
        buf = _aligned(2 * SECTOR)
        raw = sb.pack()
        buf[:SECTOR] = raw
        buf[SECTOR:] = raw
        self._pwrite(buf, 0)
        self.sync()

    def slab_base(self, slab: int) -> int:
        return DATA_START + slab * self.slab_size

    def header_offset(self, slot: SlotRef) -> int:
        return self.slab_base(slot.slab) + SECTOR + slot.index * SECTOR

    def payload_offset(self, slot: SlotRef) -> int:
        s = self.alloc.slabs[slot.slab]
        return self.slab_base(slot.slab) + SECTOR + s.capacity * SECTOR + slot.index * s.slot_size

    def _slab_assigned(self, slab: Slab) -> None:
        # Runs on the loop thread when a slab is handed to a slot size. The slab header and
        # a zeroed header table are written on the I/O thread, before the first payload
        # that lands in the slab (see _init_slab), so no I/O happens on the loop.
        self._fresh.add(slab.id)

    def _init_slab(self, slab_id: int) -> None:
        """Zero a freshly assigned slab's header table, then write its header: records a
        previous use of the slab left behind can never come back."""
        with self._init_lock:
            if slab_id not in self._fresh:
                return
            s = self.alloc.slabs[slab_id]
            base = self.slab_base(slab_id)
            table = s.capacity * SECTOR
            done = 0
            while done < table:
                n = min(len(_ZEROS), table - done)
                self._pwrite(memoryview(_ZEROS)[:n], base + SECTOR + done)
                done += n
            buf = _aligned(SECTOR)
            buf[:] = SlabHeader(s.slot_size, s.capacity).pack()
            self._pwrite(buf, base)
            self._fresh.discard(slab_id)

    # -- I/O (I/O threads) --------------------------------------------------------------
    def _slow(self, t0: float) -> None:
        dt = time.perf_counter() - t0
        if dt > SLOW_IO_S:
            self.slow_ios += 1
            log.warning("flash device %s: one I/O took %.3f s (slow device)", self.name, dt)

    def _pwrite(self, buf: object, offset: int) -> None:
        n_want = len(memoryview(buf))  # type: ignore[arg-type]
        t0 = time.perf_counter()
        try:
            if faults.active:
                faults.before_io(self.name, "write", self.fd, self.path, offset, n_want)
            n = os.pwritev(self.fd, [buf], offset)  # type: ignore[list-item]
        except OSError as exc:
            raise FlashIOError(
                exc.errno, f"flash device {self.name!r}: write at {offset} failed: {exc.strerror}"
            ) from None
        self._slow(t0)
        if n != n_want:
            raise FlashIOError(errno.EIO, f"flash device {self.name!r}: short write at {offset}")

    def _pread(self, buf: Buffer | Sequence[Buffer], offset: int) -> None:
        """One device read of ``buf`` (a buffer, or a list of buffers filled in order by
        one ``preadv``) at ``offset``."""
        bufs: Sequence[Buffer] = buf if isinstance(buf, list) else [buf]  # type: ignore[list-item]
        n_want = sum(memoryview(b).nbytes for b in bufs)
        t0 = time.perf_counter()
        try:
            if faults.active:
                faults.before_io(self.name, "read", self.fd, self.path, offset, n_want)
            n = os.preadv(self.fd, bufs, offset)
        except OSError as exc:
            raise FlashIOError(
                exc.errno, f"flash device {self.name!r}: read at {offset} failed: {exc.strerror}"
            ) from None
        self._slow(t0)
        if n != n_want:
            raise ShortRead(
                errno.EIO, f"flash device {self.name!r}: short read at {offset} (truncated?)"
            )

    def write_payload(self, slot: SlotRef, payload: memoryview, cipher: XtsCipher | None
                      ) -> None:
        """Write one record's payload (encrypted when ``cipher``); no header, no sync."""
        if slot.slab in self._fresh:
            self._init_slab(slot.slab)
        off = self.payload_offset(slot)
        if cipher is not None:
            buf = _staging.payload_buf(len(payload))
            out = memoryview(buf)[: len(payload)]
            cipher.encrypt_into(payload, out, xts_tweak(self.superblock.tweak_id, off))
            self._pwrite(out, off)
            out.release()
        else:
            self._pwrite(payload, off)

    def write_header(self, slot: SlotRef, header: RecordHeader) -> None:
        hdr = _staging.header
        hdr[:] = header.pack()
        self._pwrite(hdr, self.header_offset(slot))

    def write_record(
        self, slot: SlotRef, header: RecordHeader, payload: memoryview, cipher: XtsCipher | None
    ) -> None:
        """Payload, then header, no sync (the store orders syncs between the two, see
        ``BlockStore._demote``; this is for tools that build images)."""
        self.write_payload(slot, payload, cipher)
        self.write_header(slot, header)

    def read_header(self, slot: SlotRef) -> RecordHeader | None:
        hdr = _staging.header
        self._pread(hdr, self.header_offset(slot))
        return RecordHeader.unpack(memoryview(hdr))

    def read_headers(self, slots: list[SlotRef]) -> list[RecordHeader | FlashIOError | None]:
        """The record headers of ``slots``, in their order, in as few reads as the layout
        allows: the wanted entries of each slab's header table are read in runs (see
        ``HEADER_GAP``/``HEADER_RUN``), one I/O per run, instead of one 4 KiB read each.

        Each entry is the parsed header, ``None`` for an empty, torn or foreign entry (as
        :meth:`read_header`), or the :class:`FlashIOError` of the read that should have
        brought it (other runs are still read)."""
        out: list[RecordHeader | FlashIOError | None] = [None] * len(slots)
        order = sorted(range(len(slots)), key=lambda i: (slots[i].slab, slots[i].index))
        buf = _staging.table_buf()
        i = 0
        while i < len(order):
            first = slots[order[i]]
            j = i + 1
            while j < len(order):
                nxt = slots[order[j]]
                prev = slots[order[j - 1]]
                if (nxt.slab != first.slab or nxt.index - prev.index > HEADER_GAP
                        or nxt.index - first.index >= HEADER_RUN):
                    break
                j += 1
            last = slots[order[j - 1]]
            run = memoryview(buf)[: (last.index - first.index + 1) * SECTOR]
            try:
                try:
                    self._pread(run, self.header_offset(first))
                except FlashIOError as exc:
                    exc.__traceback__ = None
                    for k in order[i:j]:
                        out[k] = exc
                else:
                    for k in order[i:j]:
                        at = (slots[k].index - first.index) * SECTOR
                        out[k] = RecordHeader.unpack(run[at : at + SECTOR])
            finally:
                run.release()
            i = j
        return out

    @staticmethod
    def check_header(
        hdr: RecordHeader | None,
        namespace: bytes,
        key: bytes,
        length: int,
        crc: int,
        seq: int,
        cipher: XtsCipher | None,
    ) -> None:
        """Raise :class:`ReadFailure` unless ``hdr`` is the record the index expects."""
        if hdr is None:
            raise ReadFailure("record header missing or corrupt")
        if hdr.namespace != namespace or hdr.key != key:
            raise ReadFailure("record header names another namespace or key")
        if hdr.seq != seq or hdr.length != length or hdr.crc != crc:
            raise ReadFailure("record header does not match the index (stale extent)")
        if hdr.encrypted != (cipher is not None):
            raise ReadFailure("record encryption flag does not match the namespace")

    def read_payloads(self, items: list[tuple[SlotRef, memoryview, int, int]],
                      cipher: XtsCipher | None) -> list[BaseException | None]:
        """Read records' payloads into their slots and check each CRC32C; the headers must
        have been checked (:meth:`check_header`). ``items``: (slot on flash, ``dst`` — the
        4 KiB-aligned DRAM slot, ``length``, ``crc``).

        Items are read in device order; those whose slots follow each other in one slab
        are read by one device I/O of at most ``PAYLOAD_RUN`` bytes (one ``preadv``
        straight into the slots, or with ``cipher`` into this thread's staging buffer,
        then decrypted slot by slot).
        Returns, per item, ``None`` (read and checked), a :class:`ReadFailure` (``ours``:
        bad length or CRC) or the :class:`FlashIOError` of the read that covered it."""
        out: list[BaseException | None] = [None] * len(items)
        todo: list[int] = []
        for i, (_slot, dst, length, _crc) in enumerate(items):
            if length > len(dst):
                out[i] = ReadFailure("record length exceeds its slot", ours=True)
            else:
                todo.append(i)
        todo.sort(key=lambda i: (items[i][0].slab, items[i][0].index))
        k = 0
        while k < len(todo):
            first, dst0, _l, _c = items[todo[k]]
            size = self.alloc.slabs[first.slab].slot_size
            j = k + 1
            total = len(dst0)
            while j < len(todo):
                slot, dst, _l, _c = items[todo[j]]
                if (slot.slab != first.slab or slot.index != first.index + (j - k)
                        or len(dst) != size or len(dst0) != size
                        or total + len(dst) > PAYLOAD_RUN):
                    break
                total += len(dst)
                j += 1
            run = todo[k:j]
            try:
                self._read_run(first, [items[i][1] for i in run], cipher)
            except (FlashIOError, ValueError) as exc:
                exc.__traceback__ = None  # its frames hold the slot views
                for i in run:
                    out[i] = exc
            else:
                for i in run:
                    _slot, dst, length, crc = items[i]
                    if crc32c(dst[:length]) != crc:
                        out[i] = ReadFailure("payload CRC32C mismatch", ours=True)
            k = j
        return out

    def _read_run(self, first: SlotRef, dsts: list[memoryview], cipher: XtsCipher | None
                  ) -> None:
        """One device read of the payloads of adjacent slots ``first``, ``first + 1``, ...
        into ``dsts`` (decrypted with ``cipher``)."""
        off = self.payload_offset(first)
        if cipher is None:
            self._pread(dsts if len(dsts) > 1 else dsts[0], off)
            return
        total = sum(len(d) for d in dsts)
        buf = _staging.payload_buf(total)
        tmp = memoryview(buf)[:total]
        try:
            self._pread(tmp, off)
            at = 0
            for dst in dsts:
                cipher.decrypt_into(tmp[at : at + len(dst)], dst,
                                    xts_tweak(self.superblock.tweak_id, off + at))
                at += len(dst)
        finally:
            tmp.release()

    def read_payload(self, slot: SlotRef, dst: memoryview, length: int, crc: int,
                     cipher: XtsCipher | None) -> None:
        """:meth:`read_payloads` of one record; raises what it returns."""
        err = self.read_payloads([(slot, dst, length, crc)], cipher)[0]
        if err is not None:
            raise err

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
        (a swapped device, a stale or foreign extent) or the payload CRC fails, and
        :class:`ShortRead` when the device is too short to hold the record (truncated:
        a device failure, not a bad record).
        """
        self.check_header(self.read_header(slot), namespace, key, length, crc, seq, cipher)
        self.read_payload(slot, dst, length, crc, cipher)

    def invalidate(self, slot: SlotRef) -> None:
        """Zero a record's header so a restart does not bring the block back."""
        hdr = _staging.header
        hdr[:] = bytes(SECTOR)
        self._pwrite(hdr, self.header_offset(slot))

    def check_identity(self) -> None:
        """Read the superblock back (O_DIRECT, so from the device); raise FlashIOError when
        it is unreadable or belongs to another device (swapped)."""
        buf = _aligned(2 * SECTOR)
        self._pread(buf, 0)
        mine = self.superblock.device_uuid
        copies = [Superblock.unpack(memoryview(buf)[i * SECTOR:(i + 1) * SECTOR])
                  for i in range(2)]
        if not any(sb is not None and sb.device_uuid == mine for sb in copies):
            # (One damaged copy is fine: the other still says whose device this is.)
            raise FlashIOError(errno.EIO, f"flash device {self.name!r}: superblock changed "
                                          f"(device swapped?)")

    def probe(self) -> None:
        """Is a failed device usable again? Its superblock must be ours, it must be as long
        as its slabs need, and a write, sync and read of the probe sector must succeed,
        faster than SLOW_IO_S. Raises FlashIOError otherwise."""
        t0 = time.perf_counter()
        self.check_identity()
        need = DATA_START + self.num_slabs * self.slab_size
        have = os.lseek(self.fd, 0, os.SEEK_END)
        if have < need:
            raise ShortRead(errno.EIO, f"flash device {self.name!r} holds {have} bytes, its "
                                       f"slabs need {need} (truncated)")
        buf = _aligned(SECTOR)
        stamp = f"ctxmem probe {time.time_ns()}".encode()
        buf[: len(stamp)] = stamp
        self._pwrite(buf, PROBE_OFFSET)
        self.sync()
        back = _aligned(SECTOR)
        self._pread(back, PROBE_OFFSET)
        if back[: len(stamp)] != stamp:
            raise FlashIOError(errno.EIO, f"flash device {self.name!r}: probe sector read "
                                          f"back differs")
        if time.perf_counter() - t0 > 3 * SLOW_IO_S:
            raise FlashIOError(errno.ETIMEDOUT, f"flash device {self.name!r}: still slow")

    def scrub_slab_headers(self) -> int:
        """Rewrite the header of every slab in use whose header on the device is missing or
        wrong (e.g. a device that was truncated and grew back as zeros): without it, the
        records written there from now on would be invisible to the next restart.
        Returns how many headers were rewritten."""
        fixed = 0
        buf = _aligned(SECTOR)
        for slab in self.alloc.slabs:
            if slab.klass is None or slab.id in self._fresh:
                continue
            want = SlabHeader(slab.slot_size, slab.capacity)
            self._pread(buf, self.slab_base(slab.id))
            if SlabHeader.unpack(memoryview(buf)) != want:
                buf[:] = want.pack()
                self._pwrite(buf, self.slab_base(slab.id))
                fixed += 1
        if fixed:
            self.sync()
            log.warning("flash device %s: rewrote %d damaged slab headers", self.name, fixed)
        return fixed

    def sync(self) -> None:
        t0 = time.perf_counter()
        try:
            if faults.active:
                faults.before_io(self.name, "sync", self.fd, self.path, 0, 0)
            os.fdatasync(self.fd)
        except OSError as exc:
            raise FlashIOError(
                exc.errno, f"flash device {self.name!r}: fdatasync failed: {exc.strerror}"
            ) from None
        if faults.active:
            faults.after_sync(self.fd)
        self._slow(t0)

    def scan_slab(self, slab: int) -> tuple[int, int, TableColumns] | None:
        """One slab's valid records: (slab, slot size, records by column), or ``None`` for
        a slab without a valid header. One read for the slab header, one for its table."""
        sh = _staging.header
        self._pread(sh, self.slab_base(slab))
        header = SlabHeader.unpack(memoryview(sh))
        if header is None or header.slots != slots_per_slab(self.slab_size, header.slot_size):
            return None
        n = header.slots * SECTOR
        buf = scan_buffers.get(n)
        table = memoryview(buf)[:n]
        try:
            self._pread(table, self.slab_base(slab) + SECTOR)
            cols = parse_header_columns(table, header.slots)
        finally:
            table.release()
            scan_buffers.put(buf)
        # A header that claims more bytes than its slot holds is not a record of this slab.
        if cols.length and not (min(cols.length) > 0 and max(cols.length) <= header.slot_size):
            keep = [0 < n <= header.slot_size for n in cols.length]
            cols = TableColumns._make([v for v, k in zip(c, keep, strict=True) if k]
                                      for c in cols)
        return slab, header.slot_size, cols

    def scan(self) -> Iterator[tuple[SlotRef, int, RecordHeader]]:
        """Every valid record on the device: (slot, slot size, header)."""
        for slab in range(self.num_slabs):
            res = self.scan_slab(slab)
            if res is None:
                continue
            _slab, slot_size, cols = res
            for i, ns, key, length, crc, seq, enc, ts in zip(*cols, strict=True):
                yield SlotRef(slab, i), slot_size, RecordHeader(ns, key, length, crc, seq,
                                                                 enc, ts)

    def reopen(self, path: str) -> None:
        """Point this (failed) device at ``path``: the same device under a new node, e.g.
        an NVMe-oF namespace that was removed and came back as another /dev/nvmeXnY.
        The superblock there must carry this device's UUID; the old descriptor is retired,
        not closed (see ``_retired_fds``). Raises FlashIOError, leaving the device as it
        was, when ``path`` cannot be opened or holds another device."""
        try:
            fd = os.open(path, self._flags)
        except OSError as exc:
            raise FlashIOError(exc.errno, f"flash device {self.name!r}: cannot reopen it at "
                                          f"{path}: {exc.strerror}") from None
        try:
            if self._lock:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    raise FlashIOError(errno.EBUSY, f"flash device {self.name!r}: {path} is "
                                                    f"in use by another process") from None
            buf = _aligned(2 * SECTOR)
            try:
                got = os.preadv(fd, [buf], 0)
            except OSError as exc:
                raise FlashIOError(exc.errno, f"flash device {self.name!r}: reading the "
                                              f"superblock at {path}: {exc.strerror}") from None
            copies = [Superblock.unpack(memoryview(buf)[i * SECTOR:(i + 1) * SECTOR])
                      for i in range(2)] if got == 2 * SECTOR else []
            if not any(sb is not None and sb.device_uuid == self.superblock.device_uuid
                       for sb in copies):
                raise FlashIOError(errno.ENODEV, f"flash device {self.name!r}: {path} does "
                                                 f"not hold this device (superblock UUID "
                                                 f"differs or is unreadable); not reopened")
        except BaseException:
            os.close(fd)
            raise
        log.warning("flash device %s: reopened at %s (was %s)", self.name, path, self.path)
        self._retired_fds.append(self.fd)
        faults.forget_fd(self.fd)
        self.fd = fd
        self.path = path

    def close(self) -> None:
        if self.fd >= 0:
            faults.forget_fd(self.fd)
            os.close(self.fd)
            self.fd = -1
        for fd in self._retired_fds:
            os.close(fd)
        self._retired_fds.clear()


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
        return sum(d.num_slabs * d.slab_size for d in self.devices)

    def used_bytes(self) -> int:
        return sum(s.used * s.slot_size for d in self.devices for s in d.alloc.slabs)

    def close(self) -> None:
        for d in self.devices:
            d.close()
