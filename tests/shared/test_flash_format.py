"""The flash format's reader (``ctxmem_common.flash_format.reader``): which superblock copy
counts, and what the slab walk finds, on real image files read through a descriptor and
through a read callable."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ctxmem_common.codecs import crc32c
from ctxmem_common.codecs.blockauth import TAG_BYTES
from ctxmem_common.flash_format import (
    REC_OFF_CRC,
    REC_SIZE,
    SB_BACKUP_OFFSET,
    SECTOR,
    FlashReader,
    RecordHeader,
    SlabHeader,
    Superblock,
    fit_records,
    header_offset,
    legacy_slots,
    max_table_slots,
    pack_header_table,
    pack_record_headers,
    record_context,
    record_header_rows,
    record_version,
    slab_base,
    slots_per_slab,
)

SLAB = 1 << 20
SLOT = 64 << 10
NS = bytes(range(16))


def _keys(first: int, n: int) -> np.ndarray:
    return np.array([[first + i] * 8 for i in range(n)], dtype=np.uint8)


@pytest.fixture
def image(tmp_path: Path) -> Iterator[tuple[int, Superblock]]:
    """A 4-slab image: slab 0 holds 5 records, slab 1 has a damaged header over 3 records,
    slab 2 is empty, slab 3 holds 2 records."""
    path = tmp_path / "dev.img"
    sb = Superblock.new(SLAB, (1 << 20) + 4 * SLAB)
    per = slots_per_slab(SLAB, SLOT)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, (1 << 20) + 4 * SLAB)
    os.pwrite(fd, sb.pack_pair(), 0)
    for slab, n in ((0, 5), (1, 3), (3, 2)):
        os.pwrite(fd, SlabHeader(SLOT, per).pack(), slab_base(slab, SLAB))
        table = pack_header_table(per, NS, _keys(10 * slab, n), 1000, 7,
                                  np.arange(n, dtype=np.uint64))
        os.pwrite(fd, table, slab_base(slab, SLAB) + SECTOR)
    os.pwrite(fd, bytes(SECTOR), slab_base(1, SLAB))  # slab 1's header damaged
    try:
        yield fd, sb
    finally:
        os.close(fd)


def test_both_superblock_copies_sound(image: tuple[int, Superblock]) -> None:
    fd, sb = image
    pair = FlashReader(fd).superblocks()
    assert pair.primary == pair.backup == pair.current == sb
    assert pair.damaged == "" and pair.names(sb.device_uuid) and not pair.names(bytes(16))


@pytest.mark.parametrize("damaged", ["primary", "backup", "both"])
def test_a_damaged_copy_is_named_and_the_other_counts(image: tuple[int, Superblock],
                                                      damaged: str) -> None:
    fd, sb = image
    if damaged in ("primary", "both"):
        os.pwrite(fd, b"\xff", 8)  # the version field
    if damaged in ("backup", "both"):
        os.pwrite(fd, b"\xff", SB_BACKUP_OFFSET + 8)
    pair = FlashReader(fd).superblocks()
    if damaged == "both":
        assert pair.current is None and pair.damaged == "" and not pair.names(sb.device_uuid)
    else:
        assert pair.current == sb and pair.damaged == damaged and pair.names(sb.device_uuid)


def test_a_copy_not_read_in_full_is_missing(tmp_path: Path) -> None:
    sb = Superblock.new(SLAB, 8 * SLAB)
    calls: list[tuple[int, int]] = []

    def short(buf: memoryview, offset: int) -> int:  # a device that ends after 4 KiB
        calls.append((offset, buf.nbytes))
        buf[:SECTOR] = sb.pack()
        return SECTOR

    pair = FlashReader(short).superblocks()
    assert calls == [(0, 2 * SECTOR)]  # one read of both copies
    assert pair.primary == sb and pair.backup is None and pair.damaged == "backup"


def test_walk_finds_the_slabs_with_a_header(image: tuple[int, Superblock]) -> None:
    fd, sb = image
    scans = list(FlashReader(fd).walk(sb))
    assert [(s.slab, s.slot_size, len(s.records.slot)) for s in scans] == [(0, SLOT, 5),
                                                                         (3, SLOT, 2)]
    first = scans[0]
    assert first.header == SlabHeader(SLOT, slots_per_slab(SLAB, SLOT))
    assert first.entries == slots_per_slab(SLAB, SLOT) and first.torn == []
    assert first.records.key[4] == bytes([4] * 8) and first.records.seq == [0, 1, 2, 3, 4]


def test_walk_reads_orphaned_slabs_with_an_assumed_slot_size(
        image: tuple[int, Superblock]) -> None:
    fd, sb = image
    scans = {s.slab: s for s in FlashReader(fd).walk(sb, orphan_slot_size=SLOT)}
    assert sorted(scans) == [0, 1, 2, 3]
    assert scans[1].header is None and scans[1].slot_size == SLOT
    assert scans[1].records.key == [bytes([10 + i] * 8) for i in range(3)]
    assert FlashReader(fd).slab_header(1, SLAB) is None
    cols, entries, _torn, _old = FlashReader(fd).read_table(1, SLAB, max_table_slots(SLAB))
    assert entries == max_table_slots(SLAB) and len(cols.slot) == 3


def test_torn_headers_are_reported_apart_from_records(image: tuple[int, Superblock]) -> None:
    fd, sb = image
    os.pwrite(fd, b"\xee\xee", header_offset(0, 2, SLAB) + REC_OFF_CRC)
    reader = FlashReader(fd)
    (scan,) = (s for s in reader.walk(sb, slabs=[0], torn=True))
    assert scan.torn == [2] and scan.records.slot == [0, 1, 3, 4]
    assert next(reader.walk(sb, slabs=[0])).torn == []  # only when asked for


def test_a_short_device_gives_fewer_table_entries(image: tuple[int, Superblock]) -> None:
    fd, _sb = image
    cut = slab_base(3, SLAB) + SECTOR + 3 * SECTOR  # slab 3's table ends after 3 entries
    os.ftruncate(fd, cut)
    scan = FlashReader(fd).scan_slab(3, SLAB)
    assert scan is not None and scan.entries == 3 and len(scan.records.slot) == 2


def test_a_read_callable_sees_every_read(image: tuple[int, Superblock]) -> None:
    fd, sb = image
    seen: list[int] = []

    def read_into(buf: memoryview, offset: int) -> int:
        seen.append(offset)
        return os.preadv(fd, [buf], offset)

    reader = FlashReader(read_into)
    assert reader.superblocks().current == sb
    assert [s.slab for s in reader.walk(sb)] == [0, 3]
    assert seen[:3] == [0, slab_base(0, SLAB), slab_base(0, SLAB) + SECTOR]


def test_fit_records_drops_lengths_that_do_not_fit(image: tuple[int, Superblock]) -> None:
    fd, _sb = image
    scan = FlashReader(fd).scan_slab(0, SLAB)
    assert scan is not None
    assert fit_records(scan.records, SLOT) is scan.records  # all fit: the same columns
    assert fit_records(scan.records, 999).slot == []  # 1000-byte records, 999-byte slots


def test_slab_header_pod_extension_round_trips_and_old_readers_ignore_it() -> None:
    from ctxmem_common.flash_format import SlabHeader, Superblock

    sb = Superblock(1 << 20, 3, bytes(range(16)))
    plain = SlabHeader(65536, 14).for_device(sb)
    owned = plain.owned_by("node-a", 7)
    raw = owned.pack()
    assert SlabHeader.unpack(raw) == owned
    assert (owned.owner, owned.epoch) == ("node-a", 7)
    # The fields before the pod extension are unchanged, so a reader of the earlier
    # format (which stops at the first extension) reads the same slab.
    assert raw[:len(plain.pack().rstrip(b"\0"))] == plain.pack().rstrip(b"\0")
    damaged = bytearray(raw)
    damaged[len(plain.pack().rstrip(b"\0")) + 10] ^= 1  # a bit of the pod extension
    assert SlabHeader.unpack(bytes(damaged)) == plain  # no owner: never mistaken
    assert SlabHeader.unpack(plain.pack()) == plain


def test_pack_record_headers_matches_record_header_pack() -> None:
    """The column-wise packer (demotion's headers) writes byte for byte what
    RecordHeader.pack writes, for every key length, flag and field, and unpacks back."""
    rng = np.random.default_rng(3)
    hs = [RecordHeader(os.urandom(16), os.urandom(int(rng.integers(1, 65))),
                       int(rng.integers(0, 1 << 40)), int(rng.integers(0, 1 << 32)),
                       int(rng.integers(0, 1 << 62)), bool(i & 1), int(rng.integers(0, 1 << 62)),
                       int(rng.integers(0, 1 << 32)), bool(i & 2),
                       os.urandom(TAG_BYTES) if i & 4 else b"") for i in range(200)]
    rows = record_header_rows(hs)  # pack_record_headers, the flags from each header
    assert rows.shape == (len(hs), REC_SIZE)
    for h, row in zip(hs, rows, strict=True):
        assert row.tobytes() == h.pack()[:REC_SIZE]
        assert RecordHeader.unpack(row.tobytes().ljust(SECTOR, b"\0")) == h
    # One value for every record (what a demotion batch passes for flags and time).
    one = pack_record_headers([hs[0].namespace], [hs[0].key], [hs[0].length], [hs[0].crc],
                              [hs[0].seq], 0, 0, 7)
    assert RecordHeader.unpack(one[0].tobytes().ljust(SECTOR, b"\0")) == RecordHeader(
        hs[0].namespace, hs[0].key, hs[0].length, hs[0].crc, hs[0].seq, False, 7)
    assert pack_record_headers([], [], [], [], []).shape == (0, REC_SIZE)


@pytest.mark.parametrize(("ns", "key"), [(b"n" * 16, b""), (b"n" * 16, b"k" * 65),
                                         (b"n" * 17, b"k")])
def test_pack_record_headers_refuses_what_struct_would_cut(ns: bytes, key: bytes) -> None:
    with pytest.raises(ValueError, match="pack_record_headers"):
        pack_record_headers([ns], [key], [1], [0], [1])


def v1_header(h: RecordHeader) -> bytes:
    """``h`` as a record header of format version 1 (no authenticator; its CRC32C at
    offset 125), as services before authenticated records wrote it."""
    body = bytearray(h.pack()[:125])
    body[8:10] = (1).to_bytes(2, "little")
    return (bytes(body) + crc32c(bytes(body)).to_bytes(4, "little")).ljust(SECTOR, b"\0")


def test_version_1_records_are_found_but_never_parsed() -> None:
    """A record header of version 1 (CRC32C only) is not a record to the reader (unpack,
    the column parser): anyone who writes the flash can make one. legacy_slots and
    record_version find it (the rebuild counts it, ctxmem check reports it)."""
    h = RecordHeader(NS, b"old", 100, 7, 9, False, 1)
    old = v1_header(h)
    assert RecordHeader.unpack(old) is None
    assert record_version(old) == 1
    assert record_version(h.pack()) == 2
    assert record_version(old[:8] + b"\x05" + old[9:]) == 0  # torn: CRC fails
    table = bytearray(4 * SECTOR)
    table[0:SECTOR] = h.pack()
    table[2 * SECTOR:3 * SECTOR] = old
    assert legacy_slots(table, 4) == [2]
    assert parsed_slots(table) == [0]


def parsed_slots(table: bytearray) -> list[int]:
    from ctxmem_common.flash_format import parse_header_columns

    return parse_header_columns(table, len(table) // SECTOR).slot


def test_record_context_binds_place_and_sequence() -> None:
    u = bytes(range(16))
    ctx = record_context(u, 1 << 20, 5)
    assert len(ctx) == 32
    assert len({ctx, record_context(u, (1 << 20) + SECTOR, 5), record_context(u, 1 << 20, 6),
                record_context(bytes(16), 1 << 20, 5)}) == 4
