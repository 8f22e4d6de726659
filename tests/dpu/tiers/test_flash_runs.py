"""The flash tier's batched record writes (the demotion path) and batched invalidation.

Real files, O_DIRECT: ``write_payloads`` + ``write_headers`` over adjacent slots must
leave exactly the image one ``write_record`` per slot leaves (the on-flash format is
unchanged: ``ctxmem check``, recovery and shared flash read it), plain and encrypted, in
one device write per run of adjacent slots; a write error fails every record of its run
and no other; ``invalidate_many`` zeroes exactly the named headers.
"""

from __future__ import annotations

import mmap
import random
from pathlib import Path

import pytest

from ctxmem_common.codecs import XtsCipher, crc32c
from ctxmem_common.flash_format import SECTOR, RecordHeader
from ctxmem_dpu import faults
from ctxmem_dpu.alloc import SlotRef
from ctxmem_dpu.tiers import flash_records
from ctxmem_dpu.tiers.flash import FlashDevice, FlashIOError

NS = bytes(range(16))
SLOT = 16 * SECTOR  # 64 KiB slots, the small-block case


@pytest.fixture(autouse=True)
def _no_faults() -> None:
    faults.reset()
    yield
    faults.reset()


def _device(tmp_path: Path, name: str) -> FlashDevice:
    path = tmp_path / f"{name}.img"
    with open(path, "wb") as f:
        f.truncate(24 << 20)
    return FlashDevice(0, name, str(path), 4 << 20, o_direct=True)


def _records(n: int, encrypted: bool) -> list[tuple[RecordHeader, mmap.mmap]]:
    out = []
    for i in range(n):
        data = random.Random(i).randbytes(SLOT - 100 * (i % 3))
        hdr = RecordHeader(NS, b"key-%06d" % i, len(data), crc32c(data), 1000 + i, encrypted,
                           123456789)
        buf = mmap.mmap(-1, SLOT)
        buf[: len(data)] = data
        out.append((hdr, buf))
    return out


def _image(dev: FlashDevice) -> bytes:
    with open(dev.path, "rb") as f:
        return f.read()


def _counting_writes(dev: FlashDevice, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    real = dev._pwrite

    def counting(buf: object, offset: int) -> None:
        bufs = buf if isinstance(buf, list) else [buf]
        sizes.append(sum(memoryview(b).nbytes for b in bufs))  # type: ignore[arg-type]
        real(buf, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(dev, "_pwrite", counting)
    return sizes


@pytest.mark.parametrize("encrypted", [False, True])
def test_run_writes_leave_the_image_one_record_at_a_time_leaves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, encrypted: bool) -> None:
    cipher = XtsCipher(bytes(range(64))) if encrypted else None
    n = 40  # more than WRITE_RUN holds: two runs (32 + 8 slots)
    records = _records(n, encrypted)
    # Two copies of one formatted device: the same device UUID, so the same XTS tweaks.
    _device(tmp_path, "one").close()
    (tmp_path / "many.img").write_bytes((tmp_path / "one.img").read_bytes())
    one = FlashDevice(0, "one", str(tmp_path / "one.img"), 4 << 20, o_direct=True)
    many = FlashDevice(0, "many", str(tmp_path / "many.img"), 4 << 20, o_direct=True)
    try:
        slots_one = one.alloc.allocate(SLOT, SLOT, n)
        slots_many = many.alloc.allocate(SLOT, SLOT, n)
        assert slots_one == slots_many and slots_one is not None
        for slot, (hdr, buf) in zip(slots_one, records, strict=True):
            one.write_record(slot, hdr, memoryview(buf), cipher)
        one.sync()
        # Shuffled: runs are found in slot order whatever order the jobs come in.
        order = list(range(n))
        random.Random(7).shuffle(order)
        writes = _counting_writes(many, monkeypatch)
        got = many.write_payloads([(slots_many[i], memoryview(records[i][1])) for i in order],
                                  cipher)
        assert got == [None] * n
        # The header staging buffer holds junk (a previous read): every entry's bytes
        # past the header must still be written as zeroes.
        junk = flash_records.staging.table_buf(n)
        junk[:] = b"\xff" * len(junk)
        assert many.write_headers([(slots_many[i], records[i][0]) for i in order]) \
            == [None] * n
        many.sync()
        per_run = flash_records.WRITE_RUN // SLOT
        table = many.alloc.slabs[slots_many[0].slab].capacity * SECTOR
        # The fresh slab's header table zeroed and its header written (once), then one
        # write per run of payloads, then all the headers in one write.
        assert writes == [table, SECTOR, per_run * SLOT, (n - per_run) * SLOT, n * SECTOR]
        # Byte for byte the same slab (slab header, header table, payloads)...
        base = one.slab_base(slots_one[0].slab)
        assert _image(one)[base : base + (4 << 20)] == _image(many)[base : base + (4 << 20)]
        # ...and every record reads back through the single-record reader.
        dst = mmap.mmap(-1, SLOT)
        for slot, (hdr, buf) in zip(slots_many, records, strict=True):
            many.read_record(slot, memoryview(dst), NS, hdr.key, hdr.length, hdr.crc,
                             hdr.seq, cipher)
            assert dst[: hdr.length] == buf[: hdr.length]
    finally:
        one.close()
        many.close()


def test_a_failed_run_write_fails_its_records_only(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    dev = _device(tmp_path, "flash0")
    try:
        records = _records(6, False)
        slots = dev.alloc.allocate(SLOT, SLOT, 6)
        assert slots is not None
        # Slots 0-2 and 4-5 are two runs (3 is not written): the second run's write fails.
        pick = [0, 1, 2, 4, 5]
        bad_at = dev.payload_offset(slots[4])
        real = dev._pwrite

        def failing(buf: object, offset: int) -> None:
            if offset == bad_at:
                raise FlashIOError(5, "injected write error")
            real(buf, offset)  # type: ignore[arg-type]

        monkeypatch.setattr(dev, "_pwrite", failing)
        got = dev.write_payloads([(slots[i], memoryview(records[i][1])) for i in pick], None)
        assert [e is None for e in got] == [True, True, True, False, False]
        assert all(isinstance(e, FlashIOError) for e in got[3:])
    finally:
        dev.close()


def test_invalidate_many_zeroes_exactly_the_named_headers(tmp_path: Path) -> None:
    dev = _device(tmp_path, "flash0")
    try:
        n = 20
        records = _records(n, False)
        slots = dev.alloc.allocate(SLOT, SLOT, n)
        assert slots is not None
        for slot, (hdr, buf) in zip(slots, records, strict=True):
            dev.write_record(slot, hdr, memoryview(buf), None)
        dev.sync()
        dead = {1, 2, 3, 7, 12, 13, 19}
        dev.invalidate_many([slots[i] for i in sorted(dead, reverse=True)])
        dev.sync()
        for i, slot in enumerate(slots):
            hdr = dev.read_header(slot)
            if i in dead:
                assert hdr is None, i
            else:
                assert hdr == records[i][0], i
    finally:
        dev.close()


def test_adjacent_runs_split_by_slab_gap_and_limit() -> None:
    slots = [SlotRef(1, 5), SlotRef(0, 2), SlotRef(0, 0), SlotRef(0, 1), SlotRef(1, 3),
             SlotRef(1, 4), SlotRef(0, 4)]
    runs = flash_records.adjacent_runs(slots, [10] * len(slots), 30)
    assert [[slots[i] for i in run] for run in runs] == [
        [SlotRef(0, 0), SlotRef(0, 1), SlotRef(0, 2)],
        [SlotRef(0, 4)],
        [SlotRef(1, 3), SlotRef(1, 4), SlotRef(1, 5)],
    ]
    adjacent = [SlotRef(0, 0), SlotRef(0, 1), SlotRef(0, 2), SlotRef(0, 3)]
    assert flash_records.adjacent_runs(adjacent, [10, 50, 10, 10], 30) == [[0], [1], [2, 3]]


def _runs_one_by_one(slots: list[SlotRef], sizes: list[int], limit: int) -> list[list[int]]:
    order = sorted(range(len(slots)), key=lambda i: (slots[i].slab, slots[i].index))
    runs: list[list[int]] = []
    for i in order:
        if runs:
            prev = slots[runs[-1][-1]]
            if (slots[i].slab == prev.slab and slots[i].index == prev.index + 1
                    and sum(sizes[j] for j in runs[-1]) + sizes[i] <= limit):
                runs[-1].append(i)
                continue
        runs.append([i])
    return runs


def test_adjacent_runs_fast_path_cuts_as_the_slot_by_slot_walk() -> None:
    """One slab's consecutive slots in order (a demotion's batch) take a C-level path;
    every batch, that one or not, is cut into the runs a slot-by-slot walk finds."""
    rng = random.Random(11)
    for _ in range(2000):
        n = rng.randint(0, 70)
        slab, start = rng.randint(0, 2), rng.randint(0, 5)
        slots = [SlotRef(slab, start + i) for i in range(n)]
        sizes = [rng.choice([SECTOR, SLOT, 2 << 20])] * n
        if n > 2 and rng.random() < 0.3:
            k = rng.randrange(n)
            slots[k] = SlotRef(slots[k].slab + rng.choice([0, 1]),
                               slots[k].index + rng.choice([0, 5]))
        if n > 2 and rng.random() < 0.2:
            rng.shuffle(slots)
        if n > 2 and rng.random() < 0.1:
            sizes[rng.randrange(n)] = SECTOR
        limit = rng.choice([flash_records.WRITE_RUN, 1 << 20, 100])
        assert flash_records.adjacent_runs(slots, sizes, limit) == \
            _runs_one_by_one(slots, sizes, limit)
