"""Record I/O on a flash device: writing payloads and headers, reading headers in runs,
reading payloads in runs (decrypting and CRC-checking them), invalidating records.

:class:`FlashDevice` is the service's device: a
:class:`~ctxmem_dpu.tiers.flash_device.FormattedDevice` plus these record operations.
Every method is a plain blocking call meant for the service's I/O threads; none touches
the index.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from operator import itemgetter

import numpy as np

from ctxmem_common.codecs import XtsCipher, crc32c, xts_tweak
from ctxmem_common.codecs.blockauth import BlockAuthenticator
from ctxmem_common.flash_format import (
    REC_SIZE,
    SECTOR,
    RecordHeader,
    record_context,
    record_header_rows,
)
from ctxmem_dpu.alloc import SlotRef
from ctxmem_dpu.tiers.flash_device import FormattedDevice
from ctxmem_dpu.tiers.flash_io import ZEROS, FlashIOError, staging


class ReadFailure(Exception):
    """A record failed a check on read (header, namespace, key, CRC): serve a miss.

    ``ours`` is true when the header was this block's own record and the payload was bad
    (the record is then dead for good); false when the slot holds another record or none
    (a stale or foreign extent, a swapped device), which must not be touched."""

    def __init__(self, reason: str, ours: bool = False, auth: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.ours = ours
        #: The authenticator did not verify (header and CRC32C did).
        self.auth = auth


# Header reads of a batch (see FlashDevice.read_headers): the headers of slots in one slab
# are read as runs of the slab's header table, one I/O per run. Two wanted slots at most
# HEADER_GAP sectors apart share a run (reading the sectors between costs less than another
# I/O's latency); a run is at most HEADER_RUN sectors long.
HEADER_GAP = 16
HEADER_RUN = 256
# Payloads of adjacent slots (the order demotion wrote them in) are read in one I/O of at
# most PAYLOAD_RUN bytes (XTS_PAYLOAD_RUN with AES-XTS): small blocks stop paying one
# device round trip each. Unencrypted runs go straight into the DRAM slots by one
# ``preadv``: 4 MiB of them, not 1 (issue 17 item 3), for fewer calls: on the 2-core test
# box the service CPU per GB of cold unencrypted 64 KiB gets was 1-10% lower in each of 7
# paired A/Bs (2 MiB: -8% to +4%), wall clock x0.99-1.14 (the gains while the
# shared virtual disk was busy and a read's cost there was mostly per request). Encrypted
# runs (then through a staging buffer) measured x0.92-1.17 at 4 MiB in process but x0.96
# (64 KiB) and x0.74 (2 MiB) in whole-bench pairs, so they stay at 1 MiB (blocks of 1 MiB
# or more: one per I/O); since issue 27 item 4 they too land in the DRAM slots and are
# decrypted there, and 1 MiB is the pipeline's step (see read_payloads).
PAYLOAD_RUN = 4 << 20
XTS_PAYLOAD_RUN = 1 << 20
# Demotion writes payloads of adjacent slots (consecutive extents of one slab, the order
# FlashRoom.reserve hands them out in) by one I/O of at most WRITE_RUN bytes, and their headers
# (adjacent sectors of the slab's header table) by one I/O too: 64 KiB blocks stop paying
# a device round trip and a Python call each (issue 17 item 3).
WRITE_RUN = 2 << 20


# A cold get's payload reads are pipelined (FlashDevice.read_payloads with ``ahead``): the
# reads of up to READ_DEPTH runs past the one being decrypted and checked are handed to
# the other I/O threads.
READ_DEPTH = 2

#: Hands ``fn(k)`` (a run's read) to another I/O thread; returns its future.
SubmitRead = Callable[[Callable[[int], "BaseException | None"], int],
                      "concurrent.futures.Future[BaseException | None]"]

#: Tests only: called with (event, run) as a pipelined read goes: ``"issued"`` (handed to
#: another thread), ``"reading"`` (its preadv starts, on whichever thread), ``"checking"``
#: and ``"checked"`` (this thread decrypts and checks it). None in service.
trace: Callable[[str, int], None] | None = None


@dataclass
class ReadTally:
    """How a promotion's payload runs were read (thread-safe; merged into the store's
    counters on the loop): ``runs`` read, ``ahead`` of them read by another I/O thread
    while this one decrypted and checked earlier runs, ``taken_back`` handed out but not
    started when needed (read by the checking thread), ``helped`` read by the checking
    thread while another read was in flight."""

    runs: int = 0
    ahead: int = 0
    taken_back: int = 0
    helped: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, runs: int, ahead: int, taken_back: int, helped: int) -> None:
        with self.lock:
            self.runs += runs
            self.ahead += ahead
            self.taken_back += taken_back
            self.helped += helped


class _ReadPipeline:
    """The reads of ``n`` runs, in order, up to ``READ_DEPTH`` ahead of the run being
    checked (see :meth:`FlashDevice.read_payloads`). ``read(k)`` reads run ``k`` (raising
    FlashIOError or ValueError on failure); without ``submit`` every read is made here
    when waited for."""

    def __init__(self, read: Callable[[int], None], n: int, submit: SubmitRead | None,
                 tally: ReadTally | None) -> None:
        self._read = read
        self._n = n
        self._submit = submit
        self._tally = tally
        self._futs: dict[int, concurrent.futures.Future[BaseException | None]] = {}
        self._done: dict[int, BaseException | None] = {}
        self._next = 0
        self._ahead = self._taken_back = self._helped = 0

    def _call(self, k: int) -> BaseException | None:
        try:
            self._read(k)
        except (FlashIOError, ValueError) as exc:
            exc.__traceback__ = None  # its frames hold the slot views
            return exc
        return None

    def wait(self, k: int) -> BaseException | None:
        """Run ``k``'s read, ended: None, or the error that failed it. Hands out the
        reads of runs ``k + 1 .. k + READ_DEPTH`` first."""
        if self._submit is None:
            return self._call(k)
        while self._next <= min(k + READ_DEPTH, self._n - 1):
            j = self._next
            self._next += 1
            if j == k:
                continue  # read here, below: nothing to overlap it with
            self._futs[j] = self._submit(self._call, j)
            if trace is not None:
                trace("issued", j)
        if k in self._done:  # read here while an earlier run's read was in flight
            return self._done.pop(k)
        fut = self._futs.pop(k, None)
        if fut is None:
            return self._call(k)
        if fut.cancel():  # not started (the other threads are busy): read it here
            self._taken_back += 1
            return self._call(k)
        while not fut.done():
            # In flight on another thread: read the next queued run here meanwhile.
            later = next((j for j in sorted(self._futs) if self._futs[j].cancel()), None)
            if later is None:
                break
            del self._futs[later]
            self._helped += 1
            self._done[later] = self._call(later)
        self._ahead += 1
        return fut.result()

    def close(self) -> None:
        """Take back every read not started, wait for those in flight (no thread may
        still write into a slot once the caller goes on), and tally."""
        for fut in self._futs.values():
            if not fut.cancel():
                concurrent.futures.wait([fut])
        self._futs.clear()
        if self._tally is not None:
            self._tally.add(self._n, self._ahead, self._taken_back, self._helped)


_SLAB_OF, _INDEX_OF = itemgetter(0), itemgetter(1)


def adjacent_runs(slots: list[SlotRef], sizes: list[int], limit: int) -> list[list[int]]:
    """Indexes of ``slots`` grouped into runs of consecutive slots of one slab (in slab,
    index order), each run's ``sizes`` summing to at most ``limit`` (a run holds one item
    at least); the device reads or writes each run by one I/O.

    The common batch (one slab's consecutive slots, in order, of one size: what
    ``FlashRoom.reserve`` hands a demotion) is recognised by C-level passes and cut into runs
    without a Python step per slot."""
    n = len(slots)
    if n > 1 and sizes.count(sizes[0]) == n:
        first = slots[0]
        if (list(map(_SLAB_OF, slots)).count(first.slab) == n
                and list(map(_INDEX_OF, slots)) == list(range(first.index, first.index + n))):
            per = max(1, limit // max(1, sizes[0]))
            return [list(range(i, min(i + per, n))) for i in range(0, n, per)]
    order = sorted(range(len(slots)), key=lambda i: (slots[i].slab, slots[i].index))
    runs: list[list[int]] = []
    run: list[int] = []
    total = 0
    for i in order:
        if run:
            prev = slots[run[-1]]
            if (slots[i].slab != prev.slab or slots[i].index != prev.index + 1
                    or total + sizes[i] > limit):
                runs.append(run)
                run, total = [], 0
        run.append(i)
        total += sizes[i]
    if run:
        runs.append(run)
    return runs


class FlashDevice(FormattedDevice):
    """One flash device as the store uses it: formatted, slab-allocated, with record
    reads and writes (see :class:`FormattedDevice` for opening and health)."""

    def write_payload(self, slot: SlotRef, payload: memoryview, cipher: XtsCipher | None
                      ) -> None:
        """Write one record's payload (encrypted when ``cipher``); no header, no sync."""
        if self.fence is not None:
            self.fence.check(slot.slab)
        if slot.slab in self._fresh:
            self._init_slab(slot.slab)
        off = self.payload_offset(slot)
        if cipher is not None:
            buf = staging.payload_buf(len(payload))
            out = memoryview(buf)[: len(payload)]
            cipher.encrypt_into(payload, out, xts_tweak(self.superblock.tweak_id, off))
            self._pwrite(out, off)
            out.release()
        else:
            self._pwrite(payload, off)

    def write_payloads(self, items: list[tuple[SlotRef, memoryview]], cipher: XtsCipher | None
                       ) -> list[BaseException | None]:
        """:meth:`write_payload` of many records, adjacent slots by one device write (at
        most ``WRITE_RUN`` bytes: with ``cipher`` each payload is encrypted with its own
        extent's tweak into this thread's staging buffer, then written as one; without,
        one ``pwritev`` straight from the DRAM slots). ``items``: (slot, payload: the
        whole 4 KiB-padded DRAM slot). Returns per item ``None`` (written, not synced) or
        the error of the write (or fence check) that covered it."""
        out: list[BaseException | None] = [None] * len(items)
        slots = [slot for slot, _view in items]
        for run in adjacent_runs(slots, [len(view) for _slot, view in items], WRITE_RUN):
            try:
                self._write_run(slots[run[0]], [items[i][1] for i in run], cipher)
            except (FlashIOError, ValueError) as exc:
                exc.__traceback__ = None  # its frames hold the slot views
                for i in run:
                    out[i] = exc
        return out

    def _write_run(self, first: SlotRef, payloads: list[memoryview], cipher: XtsCipher | None
                   ) -> None:
        """One device write of the payloads of slots ``first``, ``first + 1``, ..."""
        if len(payloads) == 1:
            self.write_payload(first, payloads[0], cipher)
            return
        if self.fence is not None:
            self.fence.check(first.slab)
        if first.slab in self._fresh:
            self._init_slab(first.slab)
        off = self.payload_offset(first)
        if cipher is None:
            self._pwrite(payloads, off)
            return
        total = sum(len(p) for p in payloads)
        buf = memoryview(staging.payload_buf(total))[:total]
        try:
            at = 0
            tweak_id = self.superblock.tweak_id
            for p in payloads:
                n = len(p)
                cipher.encrypt_into(p, buf[at : at + n], xts_tweak(tweak_id, off + at))
                at += n
            self._pwrite(buf, off)
        finally:
            buf.release()

    def write_headers(self, items: list[tuple[SlotRef, RecordHeader]]
                      ) -> list[BaseException | None]:
        """:meth:`write_header` of many records: :meth:`write_header_rows` of their
        headers packed in one pass."""
        rows = record_header_rows([h for _slot, h in items])
        return self.write_header_rows([slot for slot, _h in items], rows)

    def write_header_rows(self, slots: list[SlotRef], rows: np.ndarray
                          ) -> list[BaseException | None]:
        """Write record headers (``rows``: one packed header per slot, as
        :func:`~ctxmem_common.flash_format.pack_record_headers` builds them), the headers
        of adjacent slots (adjacent sectors of a slab's header table) by one device write;
        per slot ``None`` or the error of the write that covered it. Each run's 4 KiB
        entries are filled by two numpy assignments (the rows, then zeroes), not a
        Python step per header."""
        out: list[BaseException | None] = [None] * len(slots)
        for run in adjacent_runs(slots, [SECTOR] * len(slots), HEADER_RUN * SECTOR):
            first = slots[run[0]]
            try:
                if self.fence is not None:
                    self.fence.check(first.slab)
                self.headers_written(first.slab, (slots[i].index for i in run))
                k = len(run)
                flat = np.frombuffer(staging.table_buf(k), dtype=np.uint8, count=k * SECTOR)
                table = flat.reshape(k, SECTOR)
                table[:, :REC_SIZE] = rows[run]
                table[:, REC_SIZE:] = 0
                self._pwrite(flat.data, self.header_offset(first))
                del flat, table
            except (FlashIOError, ValueError) as exc:
                exc.__traceback__ = None
                for i in run:
                    out[i] = exc
        return out

    def write_header(self, slot: SlotRef, header: RecordHeader) -> None:
        if self.fence is not None:
            self.fence.check(slot.slab)
        self.headers_written(slot.slab, (slot.index,))
        hdr = staging.header
        hdr[:] = header.pack()
        self._pwrite(hdr, self.header_offset(slot))

    def write_record(
        self, slot: SlotRef, header: RecordHeader, payload: memoryview, cipher: XtsCipher | None,
        auth: BlockAuthenticator | None = None,
    ) -> None:
        """Payload, then header, no sync (the store orders syncs between the two, see
        ``BlockStore._demote``; this is for tools that build images). With ``auth`` the
        header gets the record's authenticator (:meth:`tag`)."""
        if auth is not None:
            header = replace(header, tag=self.tag(auth, header.key, payload[: header.length],
                                                  slot, header.seq))
        self.write_payload(slot, payload, cipher)
        self.write_header(slot, header)

    # -- authenticators -----------------------------------------------------------------
    def record_context(self, slot: SlotRef, seq: int) -> bytes:
        """What the authenticator of the record at ``slot`` with sequence number ``seq``
        binds besides namespace, key and bytes: this device's UUID, the payload's offset,
        ``seq`` (:func:`~ctxmem_common.flash_format.record_context`)."""
        return record_context(self.superblock.device_uuid, self.payload_offset(slot), seq)

    def tag(self, auth: BlockAuthenticator, key: bytes, plaintext: memoryview, slot: SlotRef,
            seq: int) -> bytes:
        """The authenticator of block ``key``'s record at ``slot``: over its plaintext."""
        return auth.tag(key, plaintext, self.record_context(slot, seq))

    def check_tag(self, auth: BlockAuthenticator, hdr: RecordHeader, slot: SlotRef,
                  plaintext: memoryview, key_confirmed: bool) -> None:
        """Raise :class:`ReadFailure` unless ``hdr``'s authenticator verifies for its key,
        ``plaintext`` (the payload as read and decrypted) and the record's place (slot,
        sequence number): made by a holder of the namespace's key for exactly this record
        here. ``key_confirmed``: the header's key check matched the namespace cipher, so
        a failure is the record's own (``ours``); otherwise it may be a wrong master key
        and the record is left alone."""
        if not auth.verify(hdr.key, plaintext, hdr.tag, self.record_context(slot, hdr.seq)):
            raise ReadFailure("record authenticator does not verify (written by someone "
                              "without the namespace's key, moved, or replayed)",
                              ours=key_confirmed, auth=True)

    def read_header(self, slot: SlotRef) -> RecordHeader | None:
        hdr = staging.header
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
        buf = staging.table_buf(HEADER_RUN)
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
        if cipher is not None and hdr.key_check and hdr.key_check != cipher.check_value:
            # Written with another key (a wrong master key now, or the record's own): not
            # a bad record, so never invalidated (ours=False); the right key reads it.
            raise ReadFailure("record was written with another encryption key (wrong "
                              "master key?)")

    def read_payloads(self, items: list[tuple[SlotRef, memoryview, int, int]],
                      cipher: XtsCipher | None,
                      then: Callable[[int], BaseException | None] | None = None,
                      ahead: SubmitRead | None = None,
                      tally: ReadTally | None = None) -> list[BaseException | None]:
        """:meth:`read_payload_pieces` in one go."""
        steps = self.read_payload_pieces(items, cipher, then, ahead, tally)
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                out: list[BaseException | None] = stop.value
                return out

    def read_payload_pieces(self, items: list[tuple[SlotRef, memoryview, int, int]],
                            cipher: XtsCipher | None,
                            then: Callable[[int], BaseException | None] | None = None,
                            ahead: SubmitRead | None = None,
                            tally: ReadTally | None = None, piece_bytes: int = 0
                            ) -> Generator[None, None, list[BaseException | None]]:
        """Read records' payloads into their slots and check each CRC32C; the headers must
        have been checked (:meth:`check_header`). ``items``: (slot on flash, ``dst`` — the
        4 KiB-aligned DRAM slot, ``length``, ``crc``).

        Items are read in device order; those whose slots follow each other in one slab
        are read by one device I/O (one ``preadv`` straight into the DRAM slots, no
        staging buffer) of at most ``PAYLOAD_RUN`` bytes, or with ``cipher`` of at most
        ``XTS_PAYLOAD_RUN`` (then decrypted in place, slot by slot with each slot's own
        tweak). Each run is then checked while its bytes are in cache: decryption, CRC32C,
        and ``then(i)``, when given, for item ``i`` right after its CRC32C held (promotion
        checks the authenticator there); what it returns is the item's result.

        ``ahead``: a pipeline (issue 27 item 4). With it, the reads of the next
        ``READ_DEPTH`` runs are handed to other I/O threads (``ahead(fn, k)`` submits
        ``fn(k)``) before this thread decrypts and checks the current run, so the device
        reads run k + 1 while run k is decrypted; a read nobody has started by the time
        it is needed is taken back and read here (never a wait on a queued job), and
        while this thread waits on a read another thread has in flight it reads the
        next queued one itself (two reads in flight). Every read handed out has ended
        before this returns, whatever happens: no thread writes into a slot after it.
        ``tally`` counts the runs and how they were read.

        Returns, per item, ``None`` (read and checked), a :class:`ReadFailure` (``ours``:
        bad length or CRC) or the :class:`FlashIOError` of the read that covered it (the
        other runs are still read and checked).

        A generator (the I/O queue's pieces, ``store/ioqueue.py``): it yields between
        runs once it has checked ``piece_bytes`` since it last did (0: never), holding
        nothing of its thread's then; its return value is the list above."""
        out: list[BaseException | None] = [None] * len(items)
        todo: list[int] = []
        for i, (_slot, dst, length, _crc) in enumerate(items):
            if length > len(dst):
                out[i] = ReadFailure("record length exceeds its slot", ours=True)
            else:
                todo.append(i)
        todo.sort(key=lambda i: (items[i][0].slab, items[i][0].index))
        limit = PAYLOAD_RUN if cipher is None else XTS_PAYLOAD_RUN
        runs: list[list[int]] = []
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
                        or total + len(dst) > limit):
                    break
                total += len(dst)
                j += 1
            runs.append(todo[k:j])
            k = j

        def read(r: int) -> None:
            run = runs[r]
            if trace is not None:
                trace("reading", r)
            dsts = [items[i][1] for i in run]
            self._pread(dsts if len(dsts) > 1 else dsts[0], self.payload_offset(items[run[0]][0]))

        pipe = _ReadPipeline(read, len(runs), ahead, tally)
        since = 0  # bytes checked since the last piece ended
        try:
            for r, run in enumerate(runs):
                if piece_bytes and since >= piece_bytes:
                    since = 0
                    yield  # a piece ends: what ranks before this job runs first
                since += sum(len(items[i][1]) for i in run)
                err = pipe.wait(r)
                if err is not None:
                    for i in run:
                        out[i] = err
                    continue
                if trace is not None:
                    trace("checking", r)
                if cipher is not None:
                    try:
                        self._decrypt_run(items[run[0]][0], [items[i][1] for i in run],
                                          cipher)
                    except ValueError as exc:
                        exc.__traceback__ = None  # its frames hold the slot views
                        for i in run:
                            out[i] = exc
                        continue
                for i in run:
                    _slot, dst, length, crc = items[i]
                    if crc32c(dst[:length]) != crc:
                        out[i] = ReadFailure("payload CRC32C mismatch", ours=True)
                    elif then is not None:
                        out[i] = then(i)
                if trace is not None:
                    trace("checked", r)
        finally:
            pipe.close()
        return out

    def _decrypt_run(self, first: SlotRef, dsts: list[memoryview], cipher: XtsCipher) -> None:
        """Decrypt, in place, the payloads of adjacent slots ``first``, ``first + 1``, ...
        just read into ``dsts`` (each its own XTS data unit, tweaked by its offset)."""
        off = self.payload_offset(first)
        tweak_id = self.superblock.tweak_id
        for dst in dsts:
            cipher.decrypt_into(dst, dst, xts_tweak(tweak_id, off))
            off += len(dst)

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
        auth: BlockAuthenticator | None = None,
    ) -> None:
        """Read a record into ``dst`` (a 4 KiB-aligned slot) and check everything.

        Raises :class:`ReadFailure` when the header does not match what the index expects
        (a swapped device, a stale or foreign extent), the payload CRC fails or (with
        ``auth``: every service read) the authenticator does not verify, and
        :class:`ShortRead` when the device is too short to hold the record (truncated:
        a device failure, not a bad record).
        """
        hdr = self.read_header(slot)
        self.check_header(hdr, namespace, key, length, crc, seq, cipher)
        self.read_payload(slot, dst, length, crc, cipher)
        if auth is not None:
            assert hdr is not None
            self.check_tag(auth, hdr, slot, dst[:length],
                           cipher is not None and hdr.key_check != 0)

    def invalidate(self, slot: SlotRef) -> None:
        """Zero a record's header so a restart does not bring the block back. On a shared
        device, a slab whose lease this service lost is left alone (the new owner zeroes
        its table when it assigns it); a lapsed lease raises SlabFenced (parked, retried)."""
        if self.fence is not None:
            if self.fence.lost(slot.slab):
                return
            self.fence.check(slot.slab)
        hdr = staging.header
        hdr[:] = bytes(SECTOR)
        self._pwrite(hdr, self.header_offset(slot))
        self.headers_zeroed(slot.slab, (slot.index,))

    def invalidate_many(self, slots: list[SlotRef]) -> None:
        """:meth:`invalidate` of many records, the headers of adjacent slots zeroed by one
        device write; raises the first FlashIOError (SlabFenced included), as the loop of
        single invalidations did."""
        live = [s for s in slots if self.fence is None or not self.fence.lost(s.slab)]
        for run in adjacent_runs(live, [SECTOR] * len(live), len(ZEROS)):
            first = live[run[0]]
            if self.fence is not None:
                self.fence.check(first.slab)
            with memoryview(ZEROS)[: len(run) * SECTOR] as zeros:
                self._pwrite(zeros, self.header_offset(first))
            self.headers_zeroed(first.slab, (live[i].index for i in run))

