"""Reading the on-flash format from a device: the superblock pair and the slab walk.

The one reader the service's flash tier, ``ctxmem check`` and the tools (chaos campaign,
recovery benchmark) share, so "which superblock copy counts" and "what a slab holds" are
decided in one place. It chooses no I/O path of its own: it reads through a
:data:`ReadInto` callable, so the service passes its O_DIRECT read (fault hooks, slow-I/O
accounting, errors raised as its own exceptions, a short read raised as a truncation) and
the tools pass a plain file descriptor (:func:`fd_read_into`: a short read near the end of
a truncated device is then just fewer table entries). Every buffer it reads into is a
page-aligned anonymous mapping, which is what O_DIRECT needs.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from ctxmem_common.flash_format.records import (
    DATA_START,
    OWNER_OFFSET,
    SECTOR,
    OwnerRecord,
    SlabHeader,
    Superblock,
    TableColumns,
    legacy_slots,
    magic_slots,
    parse_header_columns,
    slab_base,
    slots_per_slab,
)

ReadInto = Callable[[memoryview, int], int]
"""``read_into(buf, offset) -> bytes read``: fill ``buf`` from the device at ``offset``."""


def fd_read_into(fd: int) -> ReadInto:
    """A :data:`ReadInto` over a file descriptor (one ``preadv`` per call)."""

    def read_into(buf: memoryview, offset: int) -> int:
        return os.preadv(fd, [buf], offset)

    return read_into


def aligned_buffer(n: int) -> mmap.mmap:
    """``n`` bytes (rounded up to whole sectors) of page-aligned memory, for O_DIRECT."""
    return mmap.mmap(-1, max(SECTOR, (n + SECTOR - 1) // SECTOR * SECTOR))


class BufferPool:
    """Aligned buffers for reading header tables, reused across slabs so their pages are
    faulted in once (a warm restart reads thousands of tables on several threads), and
    dropped with :meth:`clear` when the walk is done."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def get(self, n: int) -> mmap.mmap:
        """A buffer of at least ``n`` bytes (a pooled one when one is large enough)."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) >= n:
                    return self._free.pop(i)
        return mmap.mmap(-1, max(n, 1 << 20))

    def put(self, buf: mmap.mmap) -> None:
        """Give a buffer from :meth:`get` back for the next table."""
        with self._lock:
            self._free.append(buf)

    def clear(self) -> None:
        """Unmap every pooled buffer."""
        with self._lock:
            for buf in self._free:
                buf.close()
            self._free.clear()


class _Sector(threading.local):
    """One aligned sector per thread for slab-header reads (I/O threads read in parallel)."""

    def __init__(self) -> None:
        self.buf = aligned_buffer(SECTOR)


_sector = _Sector()


@dataclass(frozen=True, slots=True)
class SuperblockPair:
    """The two superblock copies (offset 0 and 4 KiB) as read; ``None`` for a copy that is
    damaged, missing or was not read in full. Both copies are written together and never
    differ when sound, so the valid one is :attr:`current` (the primary when both are)."""

    primary: Superblock | None
    backup: Superblock | None

    @property
    def current(self) -> Superblock | None:
        """The superblock that counts, or ``None`` when neither copy is valid."""
        return self.primary or self.backup

    @property
    def damaged(self) -> str:
        """``"primary"`` or ``"backup"`` when that copy is damaged or missing and the other
        is good (it should be rewritten from :attr:`current`); ``""`` otherwise."""
        sb = self.current
        if sb is None or (self.primary == sb and self.backup == sb):
            return ""
        return "primary" if self.primary != sb else "backup"

    def names(self, device_uuid: bytes) -> bool:
        """Does either copy carry ``device_uuid`` (one damaged copy still tells whose
        device this is)?"""
        return any(sb is not None and sb.device_uuid == device_uuid
                   for sb in (self.primary, self.backup))


@dataclass(frozen=True, slots=True)
class SlabScan:
    """One slab's header table as read.

    ``header`` is ``None`` when the slab's own header is missing or damaged and the table
    was read with an assumed slot size (``slot_size``; see :meth:`FlashReader.scan_slab`).
    ``records`` holds every entry that parses as a record, whatever its length (see
    :func:`~ctxmem_common.flash_format.records.fit_records`); ``entries`` is how many
    table entries were read (fewer than the slab's slots when the device ends first);
    ``torn`` (only when asked for) the entries that carry the record magic but fail their
    checks; ``legacy`` the entries that hold a record of format version 1 (no
    authenticator: never served)."""

    slab: int
    slot_size: int
    header: SlabHeader | None
    records: TableColumns
    entries: int
    torn: list[int] = field(default_factory=list)
    legacy: list[int] = field(default_factory=list)


class FlashReader:
    """Reads one device's superblocks and slabs through ``source``: a file descriptor or
    a :data:`ReadInto`. Header tables are read into buffers from ``buffers`` (a private
    pool when not given). Safe to use from several threads at once."""

    def __init__(self, source: int | ReadInto,
                 buffers: BufferPool | None = None) -> None:
        self._read = fd_read_into(source) if isinstance(source, int) else source
        self.buffers = buffers if buffers is not None else BufferPool()

    def superblocks(self) -> SuperblockPair:
        """Both superblock copies, each parsed only when its whole sector was read."""
        # A fresh buffer, dropped (not closed) after: a read that raised may leave its
        # traceback holding a view of it.
        view = memoryview(aligned_buffer(2 * SECTOR))
        n = self._read(view, 0)
        primary = Superblock.unpack(view[:SECTOR]) if n >= SECTOR else None
        backup = Superblock.unpack(view[SECTOR:]) if n >= 2 * SECTOR else None
        return SuperblockPair(primary, backup)

    def owner(self) -> OwnerRecord | None:
        """The owner record (which service has the device), or ``None``."""
        view = memoryview(aligned_buffer(SECTOR))
        n = self._read(view, OWNER_OFFSET)
        return OwnerRecord.unpack(view) if n == SECTOR else None

    def slab_header(self, slab: int, slab_size: int) -> SlabHeader | None:
        """Slab ``slab``'s header, or ``None`` when it is missing, damaged, or names a slot
        count that does not match its slot size on this slab size (not a header the
        service wrote: the slab counts as free)."""
        view = memoryview(_sector.buf)
        try:
            if self._read(view, slab_base(slab, slab_size)) < SECTOR:
                return None
            header = SlabHeader.unpack(view)
        finally:
            view.release()
        if header is None or header.slots != slots_per_slab(slab_size, header.slot_size):
            return None
        if not header.slot_size:
            return None  # a pod node's lease stamp: the slab holds no records yet
        return header

    def read_table(self, slab: int, slab_size: int, slots: int, torn: bool = False
                   ) -> tuple[TableColumns, int, list[int], list[int]]:
        """The first ``slots`` entries of ``slab``'s header table: (valid records by
        column, entries read, torn entries when ``torn``, entries holding a record of
        format version 1). One read for the table."""
        n = slots * SECTOR
        buf = self.buffers.get(n)
        table = memoryview(buf)[:n]
        try:
            entries = min(slots, max(0, self._read(table, slab_base(slab, slab_size) + SECTOR))
                          // SECTOR)
            cols = parse_header_columns(table, entries)
            old = legacy_slots(table, entries)
            bad: list[int] = []
            if torn:
                valid = set(cols.slot).union(old)
                bad = [i for i in magic_slots(table, entries) if i not in valid]
        finally:
            table.release()
            self.buffers.put(buf)
        return cols, entries, bad, old

    def scan_slab(self, slab: int, slab_size: int, orphan_slot_size: int = 0,
                  torn: bool = False) -> SlabScan | None:
        """Slab ``slab``: its header, then its header table (two reads). ``None`` for a
        slab without a valid header (free to the service), unless ``orphan_slot_size``:
        its table is then read as a slab of that slot size (the tools' view of a slab
        whose header was damaged while the running service still uses it)."""
        header = self.slab_header(slab, slab_size)
        if header is not None:
            slot_size, slots = header.slot_size, header.slots
        elif orphan_slot_size:
            slot_size = orphan_slot_size
            slots = slots_per_slab(slab_size, orphan_slot_size)
        else:
            return None
        cols, entries, bad, old = self.read_table(slab, slab_size, slots, torn)
        return SlabScan(slab, slot_size, header, cols, entries, bad, old)

    def find_slab_headers(self, device_size: int, slab_sizes: Iterable[int] = (),
                          limit: int = 64) -> list[tuple[int, int, SlabHeader]]:
        """Valid slab headers on a device whose superblock is lost: (slab, slab size,
        header) for each slab size tried. ``slab_sizes`` (e.g. the configured one) are
        walked over the whole device; then the powers of two from 1 MiB to 1 GiB over
        their first ``limit`` slabs (a service assigns slabs from the front). Slab 0
        lies at ``DATA_START`` whatever the slab size. Empty: the device is blank."""
        found: list[tuple[int, int, SlabHeader]] = []
        tried: set[int] = set()
        sizes = [(s, None) for s in slab_sizes] + [(1 << p, limit) for p in range(20, 31)]
        for slab_size, cap in sizes:
            if slab_size < 2 * SECTOR or slab_size % SECTOR or slab_size in tried:
                continue
            tried.add(slab_size)
            fits = max(0, (device_size - DATA_START) // slab_size)
            for slab in range(fits if cap is None else min(fits, cap)):
                header = self.slab_header(slab, slab_size)
                if header is not None:
                    found.append((slab, slab_size, header))
            if found and any(h.superblock() is not None for _s, _z, h in found):
                break
        return found

    def walk(self, sb: Superblock, slabs: Iterable[int] | None = None,
             orphan_slot_size: int = 0, torn: bool = False) -> Iterator[SlabScan]:
        """:meth:`scan_slab` of every slab of ``sb`` (or of ``slabs``) that has a valid
        header (or ``orphan_slot_size``), in order."""
        for slab in range(sb.num_slabs) if slabs is None else slabs:
            scan = self.scan_slab(slab, sb.slab_size, orphan_slot_size, torn)
            if scan is not None:
                yield scan
