"""The flash tier's batched header reads and staged payload reads (the promote path).

Real files, O_DIRECT: ``FlashDevice.read_headers`` must return exactly what one
``read_header`` per slot returns (headers of several slabs, empty and damaged entries,
runs split by gap and length), in fewer device reads, each of them seen by the
fault-injection layer; ``read_payload`` must deliver exact bytes into a shared-memory slot
(plain and encrypted) and keep its CRC check.
"""

from __future__ import annotations

import mmap
import os
import random
import threading
from pathlib import Path
from typing import Any

import pytest

from ctxmem_common.codecs import XtsCipher, crc32c
from ctxmem_common.flash_format import SECTOR, RecordHeader
from ctxmem_dpu import faults
from ctxmem_dpu.alloc import SlotRef
from ctxmem_dpu.tiers import flash_records as flash_mod
from ctxmem_dpu.tiers.flash import FlashDevice, FlashIOError, ReadFailure

NS = bytes(range(16))
SLOT = 8 * SECTOR  # 32 KiB slots: (4 MiB - 4 KiB) // 36 KiB = 113 per slab


@pytest.fixture(autouse=True)
def _no_faults() -> None:
    faults.reset()
    yield
    faults.reset()


def _device(tmp_path: Path, name: str = "flash0") -> FlashDevice:
    path = tmp_path / f"{name}.img"
    with open(path, "wb") as f:
        f.truncate(24 << 20)
    return FlashDevice(0, name, str(path), 4 << 20, o_direct=True)


def _payload(seed: int, n: int = SLOT - 100) -> bytes:
    return random.Random(seed).randbytes(n)


def _store(dev: FlashDevice, n: int, cipher: XtsCipher | None = None
           ) -> list[tuple[SlotRef, RecordHeader, bytes]]:
    slots = dev.alloc.allocate(SLOT, SLOT, n)
    assert slots is not None
    out = []
    for i, slot in enumerate(slots):
        data = _payload(i)
        hdr = RecordHeader(NS, b"key-%06d" % i, len(data), crc32c(data), 1000 + i,
                           cipher is not None)
        buf = mmap.mmap(-1, SLOT)
        buf[: len(data)] = data
        dev.write_record(slot, hdr, memoryview(buf), cipher)
        out.append((slot, hdr, data))
    dev.sync()
    return out


def _count_reads(dev: FlashDevice, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    real = dev._pread

    def counting(buf: object, offset: int) -> None:
        bufs = buf if isinstance(buf, list) else [buf]
        sizes.append(sum(memoryview(b).nbytes for b in bufs))
        real(buf, offset)

    monkeypatch.setattr(dev, "_pread", counting)
    return sizes


def _patch(path: str, off: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, off)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_read_headers_equal_one_read_per_header(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    dev = _device(tmp_path)
    try:
        recs = _store(dev, 300)  # three slabs: 113 + 113 + 74
        assert len({s.slab for s, _h, _d in recs}) == 3
        empty = [SlotRef(recs[-1][0].slab, recs[-1][0].index + k) for k in (1, 30)]
        want = [s for s, _h, _d in recs[::7]] + empty + [recs[5][0], recs[200][0]]
        random.Random(1).shuffle(want)
        one_by_one = [dev.read_header(s) for s in want]
        sizes = _count_reads(dev, monkeypatch)
        got = dev.read_headers(want)
        assert got == one_by_one
        by_slot = {s: h for s, h, _d in recs}
        for s, h in zip(want, got, strict=True):
            assert h == by_slot.get(s)  # None for the empty entries
        # Entries 7 apart (gap <= HEADER_GAP) share a run; one run per slab here, plus
        # the empty entry 29 slots past the last record (gap > HEADER_GAP).
        assert len(sizes) == 4, sizes
        assert all(n % SECTOR == 0 and n <= flash_mod.HEADER_RUN * SECTOR for n in sizes)
    finally:
        dev.close()


def test_read_headers_split_runs_by_gap_and_length(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    dev = _device(tmp_path)
    try:
        recs = _store(dev, 60)
        monkeypatch.setattr(flash_mod, "HEADER_GAP", 2)
        monkeypatch.setattr(flash_mod, "HEADER_RUN", 8)
        want = [recs[i][0] for i in (0, 1, 2, 4, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 40)]
        sizes = _count_reads(dev, monkeypatch)
        got = dev.read_headers(list(reversed(want)))
        assert got == [recs[i][1] for i in (40, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 4, 2, 1, 0)]
        # runs: 0-4 (gaps <= 2), 7-14 (length 8), 15-16, 40
        assert sizes == [5 * SECTOR, 8 * SECTOR, 2 * SECTOR, SECTOR]
    finally:
        dev.close()


def test_read_headers_damaged_entry_is_none_neighbours_intact(tmp_path: Path) -> None:
    dev = _device(tmp_path)
    try:
        recs = _store(dev, 10)
        bad = recs[4][0]
        off = dev.header_offset(bad) + 40  # inside the key: the header CRC fails
        with open(dev.path, "rb") as f:
            f.seek(off)
            byte = f.read(1)[0]
        _patch(dev.path, off, bytes([byte ^ 0x10]))
        got = dev.read_headers([s for s, _h, _d in recs])
        assert got[4] is None
        assert [h for i, h in enumerate(got) if i != 4] == [h for i, (_s, h, _d)
                                                            in enumerate(recs) if i != 4]
    finally:
        dev.close()


def test_read_headers_io_error_fails_its_run_only_and_is_injected(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dev = _device(tmp_path)
    try:
        recs = _store(dev, 150)  # two slabs: two runs
        faults.configure(devices={"flash0": {"read": "eio", "count": 1}})
        got = dev.read_headers([s for s, _h, _d in recs])
        assert faults.injected() == {"read:eio": 1}  # the run's read went through the layer
        first = recs[0][0].slab
        for (s, h, _d), g in zip(recs, got, strict=True):
            if s.slab == first:
                assert isinstance(g, FlashIOError)
            else:
                assert g == h
    finally:
        dev.close()


def test_check_header_rejects_foreign_stale_and_flag(tmp_path: Path) -> None:
    dev = _device(tmp_path)
    try:
        _slot, h, _d = _store(dev, 1)[0]
        ok = (h.namespace, h.key, h.length, h.crc, h.seq, None)
        dev.check_header(h, *ok)
        cases = [
            (None, ok, "missing or corrupt"),
            (h, (bytes(16), *ok[1:]), "another namespace or key"),
            (h, (h.namespace, b"other", *ok[2:]), "another namespace or key"),
            (h, (*ok[:4], h.seq + 1, None), "stale extent"),
            (h, (*ok[:2], h.length + 1, *ok[3:]), "stale extent"),
            (h, (*ok[:3], h.crc ^ 1, *ok[4:]), "stale extent"),
            (h, (*ok[:5], XtsCipher(bytes(64))), "encryption flag"),
        ]
        for hdr, args, why in cases:
            with pytest.raises(ReadFailure, match=why) as exc:
                dev.check_header(hdr, *args)
            assert not exc.value.ours  # not this block's record: never zeroed
    finally:
        dev.close()


@pytest.mark.parametrize("encrypted", [False, True])
def test_read_payload_into_shared_memory_is_exact(tmp_path: Path, encrypted: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    dev = _device(tmp_path)
    cipher = XtsCipher(bytes(range(64))) if encrypted else None
    fd = os.memfd_create("slot-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4 * SLOT)
    slots = mmap.mmap(fd, 4 * SLOT, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        recs = _store(dev, 3, cipher)
        sizes = _count_reads(dev, monkeypatch)
        for i, (slot, h, data) in enumerate(recs):
            view = memoryview(slots)[(i + 1) * SLOT:(i + 2) * SLOT]
            dev.read_payload(slot, view, h.length, h.crc, cipher)
            assert bytes(view[: h.length]) == data
            view.release()
        assert sizes == [SLOT] * 3  # one device read per payload
        assert bytes(slots[:SLOT]) == bytes(SLOT)  # nothing written outside the slots
        # A payload that does not match its CRC is this record's failure.
        slot, h, data = recs[1]
        _patch(dev.path, dev.payload_offset(slot) + 2 * SECTOR, bytes(SECTOR))
        # (Errors are returned, not raised: no traceback keeps the slot views alive.)
        view = memoryview(slots)[:SLOT]
        crc_err, = dev.read_payloads([(slot, view, h.length, h.crc)], cipher)
        assert isinstance(crc_err, ReadFailure) and "CRC32C" in crc_err.reason
        assert crc_err.ours
        short, = dev.read_payloads([(slot, view[:SECTOR], h.length, h.crc)], cipher)
        assert isinstance(short, ReadFailure) and "exceeds its slot" in short.reason
        view.release()
    finally:
        slots.close()
        os.close(fd)
        dev.close()


@pytest.mark.parametrize("encrypted", [False, True])
def test_read_payloads_merge_adjacent_slots(tmp_path: Path, encrypted: bool,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    dev = _device(tmp_path)
    cipher = XtsCipher(bytes(range(64))) if encrypted else None
    try:
        recs = _store(dev, 40, cipher)
        monkeypatch.setattr(flash_mod, "XTS_PAYLOAD_RUN" if encrypted else "PAYLOAD_RUN",
                            4 * SLOT)
        # A damaged payload in the middle of a run fails its own CRC check only.
        _patch(dev.path, dev.payload_offset(recs[5][0]) + 3 * SECTOR, bytes(SECTOR))
        pick = [0, 1, 2, 3, 4, 5, 6, 9, 10, 30, 12]  # runs (device order): 0-3, 4-6, 9-10, 12, 30
        dram = mmap.mmap(-1, len(pick) * SLOT)
        views = [memoryview(dram)[i * SLOT:(i + 1) * SLOT] for i in range(len(pick))]
        items = [(recs[r][0], v, recs[r][1].length, recs[r][1].crc)
                 for r, v in zip(pick, views, strict=True)]
        sizes = _count_reads(dev, monkeypatch)
        got = dev.read_payloads(items, cipher)
        assert sizes == [4 * SLOT, 3 * SLOT, 2 * SLOT, SLOT, SLOT]
        for r, v, err in zip(pick, views, got, strict=True):
            if r == 5:
                assert isinstance(err, ReadFailure) and err.ours and "CRC32C" in err.reason
            else:
                assert err is None
                assert bytes(v[: recs[r][1].length]) == recs[r][2]
        # A failed read fails the blocks it covered, not the other runs; the
        # fault-injecting layer sees it.
        faults.configure(devices={"flash0": {"read": "eio", "count": 1}})
        sizes.clear()
        got = dev.read_payloads(items, cipher)
        assert faults.injected() == {"read:eio": 1}
        assert len(sizes) == 5
        assert all(isinstance(e, FlashIOError) for e in got[:4])
        assert [e for i, e in enumerate(got[4:], 4) if pick[i] != 5] == [None] * 6
        for v in views:
            v.release()
        dram.close()
    finally:
        dev.close()


def test_header_flags_say_which_layer_encrypted() -> None:
    """Bit 0: ctxmem encrypted (software AES-XTS); bit 1: the device's storage layer (an
    SPDK crypto bdev) encrypts at rest and ctxmem wrote plaintext. Both round-trip, and
    a reader that knows only bit 0 still sees an unencrypted record."""
    from ctxmem_common.flash_format import FLAG_DEVICE_ENCRYPTED, FLAG_ENCRYPTED

    def flags(raw: bytes) -> int:
        return int.from_bytes(raw[10:12], "little")

    by_ctxmem = RecordHeader(NS, b"k", 10, 1, 2, True, 3, 4)
    by_device = RecordHeader(NS, b"k", 10, 1, 2, False, 3, 0, device_encrypted=True)
    assert flags(by_ctxmem.pack()) == FLAG_ENCRYPTED
    assert flags(by_device.pack()) == FLAG_DEVICE_ENCRYPTED
    assert RecordHeader.unpack(by_ctxmem.pack()) == by_ctxmem
    back = RecordHeader.unpack(by_device.pack())
    assert back == by_device and back is not None
    assert back.device_encrypted and not back.encrypted


@pytest.mark.parametrize("encrypted", [False, True])
def test_read_payloads_pipelined_equals_serial(tmp_path: Path, encrypted: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``ahead`` (the reads of the next runs on other threads: issue 27 item 4)
    every item's result and bytes are what the serial reader gives, a damaged payload
    included, and every run is read once, by one I/O; the tally adds up."""
    import concurrent.futures

    dev = _device(tmp_path)
    cipher = XtsCipher(bytes(range(64))) if encrypted else None
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        recs = _store(dev, 24, cipher)
        monkeypatch.setattr(flash_mod, "XTS_PAYLOAD_RUN" if encrypted else "PAYLOAD_RUN",
                            2 * SLOT)  # 12 runs of 2
        _patch(dev.path, dev.payload_offset(recs[13][0]) + SECTOR, bytes(SECTOR))
        dram = mmap.mmap(-1, 2 * 24 * SLOT)
        views = [memoryview(dram)[i * SLOT:(i + 1) * SLOT] for i in range(48)]

        def items(at: int) -> list[tuple[SlotRef, memoryview, int, int]]:
            return [(r[0], views[at + i], r[1].length, r[1].crc) for i, r in enumerate(recs)]

        def ahead(fn: object, k: int) -> concurrent.futures.Future[object]:
            return pool.submit(fn, k)  # type: ignore[arg-type]

        serial = dev.read_payloads(items(0), cipher)
        tally = flash_mod.ReadTally()
        sizes = _count_reads(dev, monkeypatch)
        piped = dev.read_payloads(items(24), cipher, None, ahead, tally)
        assert sizes == [2 * SLOT] * 12
        assert [type(e) for e in piped] == [type(e) for e in serial]
        assert isinstance(piped[13], ReadFailure) and piped[13].ours
        for i, r in enumerate(recs):
            if i != 13:
                assert bytes(views[24 + i][: r[1].length]) == r[2]
        assert tally.runs == 12 and tally.ahead + tally.taken_back + tally.helped == 11
    finally:
        pool.shutdown(wait=True)
        for v in views:
            v.release()
        dram.close()
        dev.close()


@pytest.mark.parametrize(("piece", "pieces"), [(0, 1), (1, 5), (4, 3)])
def test_read_payload_pieces_yield_between_runs_per_piece_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, piece: int, pieces: int) -> None:
    """The I/O queue's pieces (issue 29 item 2): a cold get's checks yield between payload
    runs once ``piece_bytes`` were checked since the last yield (0: never), and return
    what one ``read_payloads`` does; each piece may run on another thread."""
    dev = _device(tmp_path)
    cipher = XtsCipher(bytes(range(64)))
    try:
        recs = _store(dev, 40, cipher)
        monkeypatch.setattr(flash_mod, "XTS_PAYLOAD_RUN", 4 * SLOT)
        pick = [0, 1, 2, 3, 4, 5, 6, 9, 10, 30, 12]  # runs of 4, 3, 2, 1 and 1 slots
        dram = mmap.mmap(-1, len(pick) * SLOT)
        views = [memoryview(dram)[i * SLOT:(i + 1) * SLOT] for i in range(len(pick))]
        items = [(recs[r][0], v, recs[r][1].length, recs[r][1].crc)
                 for r, v in zip(pick, views, strict=True)]
        steps = dev.read_payload_pieces(items, cipher, piece_bytes=piece * SLOT)
        done: dict[str, Any] = {}

        def one() -> None:
            try:
                next(steps)
            except StopIteration as stop:
                done["out"] = stop.value

        n = 0
        while "out" not in done:
            n += 1
            if n % 2:
                one()
            else:  # every other piece on another thread
                t = threading.Thread(target=one)
                t.start()
                t.join(10)
        got = done["out"]
        assert n == pieces
        assert got == [None] * len(pick)
        for r, v in zip(pick, views, strict=True):
            assert bytes(v[: recs[r][1].length]) == recs[r][2]
        for v in views:
            v.release()
        dram.close()
    finally:
        dev.close()
