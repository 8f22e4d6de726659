"""Promotion: bringing flash-only blocks into DRAM, verifying each one.

A block is served only after its record header matches the index, its payload's
CRC32C matches (after decryption) and its authenticator verifies (a MAC under the
namespace's key over the plaintext, binding the key and the record's place: only a holder
of the master key can make one; ``FlashDevice.check_tag``). A block that fails is
removed from the index and its extent quarantined: it is a miss from now on, never wrong
data. When the failing device's superblock is no longer its own (swapped), the device is
marked failed instead and nothing on it is touched.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ctxmem_common.codecs import XtsCipher
from ctxmem_common.codecs.blockauth import BlockAuthenticator
from ctxmem_common.errors import ResourceExhausted
from ctxmem_common.flash_format import RecordHeader
from ctxmem_dpu import faults
from ctxmem_dpu.alloc import SlotRef
from ctxmem_dpu.blocks import Block, Namespace
from ctxmem_dpu.keyring import Keyring
from ctxmem_dpu.store.context import StoreContext
from ctxmem_dpu.store.health import DeviceHealth
from ctxmem_dpu.store.index import BlockIndex, wait_io
from ctxmem_dpu.store.invalidation import Invalidator
from ctxmem_dpu.store.ioqueue import CURRENT, IoClass, work_as
from ctxmem_dpu.store.room import Room
from ctxmem_dpu.tiers.flash import Extent, FlashDevice, FlashIOError, ReadFailure, ShortRead
from ctxmem_dpu.tiers.flash_records import ReadTally, SubmitRead

log = logging.getLogger("ctxmem_dpu.store")


# A get whose run holds more than this many bytes of flash-only blocks is served in pieces
# (issue 17 item 6): an Acquire promotes the first piece and returns it, and queues the
# next piece's promotion behind its own reads, so the device reads (and decrypts) piece
# k + 1 while the client copies piece k out; the shim's next Acquire finds it in DRAM or
# in flight. Off (0) by default: in paired A/Bs on the 2-core test box (AES-XTS, 64 MiB
# batches) 16 MiB pieces gained 0-27% on 64 KiB cold gets (2-5% in the last, quietest
# sets) and cost 0.07-0.15 more service CPU s/GB (more Acquires and Releases, read-ahead
# bookkeeping). flash.cold_piece_bytes (e.g. 16MiB) turns it on, to measure on a DPU.


@dataclass(slots=True)
class PromoteResult:
    """The blocks a promotion could not bring into DRAM (``Block`` hashes by identity)."""

    failed: set[Block] = field(default_factory=set)


class ReadJob(NamedTuple):
    """One block of a promotion: made on the loop, read and checked by an I/O thread
    into its DRAM slot (:func:`_reader`)."""

    device: FlashDevice
    slot: SlotRef  # the flash slot
    view: memoryview  # the DRAM slot it is read into (released when the reads end)
    block: Block
    cipher: XtsCipher | None  # None: a plaintext record
    auth: BlockAuthenticator  # the namespace's authenticator


class Promotion:
    """Flash → DRAM."""

    def __init__(self, ctx: StoreContext, index: BlockIndex, room: Room,
                 invalidator: Invalidator, health: DeviceHealth, keyring: Keyring) -> None:
        self._ctx = ctx
        self._index = index
        self._room = room  # DRAM slots for the blocks it brings in
        self._invalidator = invalidator
        self._health = health
        self._keyring = keyring

    def prefetch(self, ns: Namespace, keys: Sequence[bytes], unpin: Callable[[Block], None],
                 counter: str = "prefetch_blocks") -> tuple[int, int]:
        """Promote the flash-only blocks of ``keys`` in a background task (pinned until it
        ends); returns (how many are being promoted, how many are in DRAM already).
        ``counter`` counts them (``read_ahead_blocks`` for a get's next piece)."""
        per_ns = self._index.get(ns.digest)
        cold = [b for k in keys if (b := per_ns.get(k)) is not None and b.dram is None]
        in_dram = sum(1 for k in keys if (b := per_ns.get(k)) is not None and b.dram is not None)
        if cold:
            self._index.pin_many(cold)

            async def run() -> None:
                try:
                    await self.promote(ns, cold)
                except Exception as exc:
                    log.info("prefetch of %d blocks stopped: %s", len(cold), exc)
                finally:
                    for b in cold:
                        unpin(b)

            self._ctx.io.spawn(run())
            self._ctx.counters[counter] += len(cold)
        return len(cold), in_dram

    def piece_blocks(self, ns: Namespace) -> int:
        """How many flash-only blocks of ``ns`` one Acquire promotes (a piece); 0 when
        cold gets are not served in pieces (``flash.cold_piece_bytes``)."""
        piece_bytes = self._ctx.cfg.flash.cold_piece_bytes
        if piece_bytes <= 0:
            return 0
        return max(1, piece_bytes // max(1, ns.block_nbytes))

    def cold_piece(self, ns: Namespace, run: list[Block]) -> tuple[int, list[Block]]:
        """Where an Acquire cuts ``run`` (its length when it needs no cut) so that it
        promotes at most ``flash.cold_piece_bytes`` of flash-only blocks, and the flash-only
        blocks of the piece after (to promote ahead: :meth:`prefetch`)."""
        per_piece = self.piece_blocks(ns)
        if not per_piece:
            return len(run), []
        cold_at = [i for i, b in enumerate(run) if b.dram is None]
        if len(cold_at) <= per_piece:
            return len(run), []
        cut = cold_at[per_piece]
        return cut, [run[i] for i in cold_at[per_piece : 2 * per_piece]]

    async def promote_fitting(self, ns: Namespace, cold: list[Block],
                              on_io: Callable[[], None] | None = None) -> PromoteResult:
        """Promote as much of ``cold`` (pinned, in run order) as DRAM can take, halving the
        batch on RESOURCE_EXHAUSTED; the blocks left out count as failed, so the caller
        cuts its run at the first of them and the shim asks for the rest in a following
        Acquire once it has copied these out."""
        take = len(cold)
        while True:
            try:
                ok = await self.promote(ns, cold[:take], on_io)
                break
            except ResourceExhausted:
                self._ctx.counters["promote_no_space"] += 1
                if take <= 1:
                    ok = PromoteResult()
                    break
                take //= 2
        ok.failed.update(cold[take:])
        return ok

    async def promote(self, ns: Namespace, blocks: list[Block],
                      on_io: Callable[[], None] | None = None) -> PromoteResult:
        """Bring flash-only blocks into DRAM, verifying each; failures end up in ``failed``.

        Callers pin ``blocks`` beforehand. Raises ResourceExhausted when DRAM cannot take
        them all. ``on_io`` is called once the reads are queued on the I/O threads (a
        get's read-ahead then queues behind them).

        The promotion runs to its end even if the request that asked for it is cancelled
        (a gRPC deadline, a client gone: ``IOPool.uncancellable``). Cut short, it would
        leave its blocks marked in flight (``b.io``: never promoted again, every later
        get a miss) and their DRAM slots reserved for nobody, with the I/O threads still
        writing into them. With nothing to promote (a get whose run is all in DRAM) no
        task is started."""
        if not blocks:
            return PromoteResult()
        return await self._ctx.io.uncancellable(self._promote_now(ns, blocks, on_io))

    async def _promote_now(self, ns: Namespace, blocks: list[Block],
                           on_io: Callable[[], None] | None) -> PromoteResult:
        ctx = self._ctx
        work_as(IoClass.LOAD, ns.tenant)  # a get waits on it: before write-back
        result = PromoteResult()
        await wait_io(blocks)
        blocks = [b for b in blocks if b.dram is None and b.flash is not None and not b.deleted]
        if not blocks:
            return result
        refs = await self._room.reserve_dram(ns, len(blocks))
        # Deleted or promoted by someone else while DRAM was being made: skip those.
        keep = [b.dram is None and b.flash is not None and not b.deleted and b.io is None
                for b in blocks]
        for ref, k in zip(refs, keep, strict=True):
            if not k:
                ctx.dram.free(ref)
        refs = [r for r, k in zip(refs, keep, strict=True) if k]
        blocks = [b for b, k in zip(blocks, keep, strict=True) if k]
        if not blocks:
            return result
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        jobs: list[ReadJob] = []
        for b, ref in zip(blocks, refs, strict=True):
            assert b.flash is not None
            b.io = fut
            dev = ctx.flash.devices[b.flash.device]
            jobs.append(ReadJob(dev, b.flash.slot, ctx.dram.slot_view(ref), b,
                                self._keyring.for_device(b.ns, dev.name),
                                self._keyring.authenticator(b.ns)))
        # A pipeline (issue 27 item 4): half the I/O threads (one of two) check, each
        # handing its next runs' reads to the others; the reads land in the DRAM slots.
        tally = ReadTally()
        work = CURRENT.get()

        def ahead(fn: Callable[[int], BaseException | None], k: int
                  ) -> concurrent.futures.Future[BaseException | None]:
            return ctx.io.submit_as(work, fn, k)

        # Each part a job in pieces of service.io_piece_bytes (the I/O queue's bound on
        # how long one runs), its reads ahead jobs of their own.
        reads = ctx.io.parallel_pieces(
            _reader(ns.block_nbytes, ahead, tally, ctx.cfg.service.io_piece_bytes), jobs,
            parts=max(1, ctx.io.threads // 2))
        if on_io is not None:
            try:  # never leave the reads un-awaited: they write into the DRAM slots
                on_io()
            except Exception:
                log.exception("starting a get's read-ahead failed")
        try:
            return await self._finish(jobs, refs, reads, fut, result)
        finally:
            counters = ctx.counters
            counters["cold_read_runs"] += tally.runs
            counters["cold_reads_ahead"] += tally.ahead
            counters["cold_reads_taken_back"] += tally.taken_back
            counters["cold_reads_helped"] += tally.helped

    async def _finish(self, jobs: list[ReadJob], refs: list[SlotRef],
                      reads: Awaitable[list[BaseException | None]],
                      fut: asyncio.Future[None], result: PromoteResult) -> PromoteResult:
        """The rest of :meth:`promote` once its reads are queued: await them (every part:
        ``IOPool.parallel`` returns only when no thread still writes into a slot), then
        index each verified block in DRAM, or free its slot and quarantine what failed.
        If the reads raise (a fault in the reader itself), every slot is freed and every
        block left on flash, as it was, before the error goes on."""
        ctx = self._ctx
        try:
            results = await reads
            faults.point("promote.after_read")
        except BaseException:
            for job, ref in zip(jobs, refs, strict=True):
                job.block.io = None
                ctx.dram.free(ref)
            raise
        finally:
            for job in jobs:
                job.view.release()
            fut.set_result(None)
        dead: list[Extent] = []
        for (dev, _slot, _v, b, _c, _a), ref, err in zip(jobs, refs, results, strict=True):
            b.io = None
            if err is None and not b.deleted:
                self._index.promoted(b, ref)
                ctx.counters["promoted_blocks"] += 1
                continue
            ctx.dram.free(ref)
            result.failed.add(b)
            if isinstance(err, ReadFailure):
                ctx.counters["integrity_failures"] += 1
                ctx.counters["quarantined_extents"] += 1
                if err.auth:
                    ctx.counters["flash_auth_failures"] += 1
                log.warning("block %s on %s failed its check (%s): quarantined, served as miss",
                            b.key.hex()[:16], dev.name, err.reason)
                assert b.flash is not None
                ctx.flash.quarantine(b.flash)
                ctx.flash.free(b.flash)
                if err.ours:
                    dead.append(b.flash)  # its own record, bad payload: zero the header
                self._index.flash_lost(b)
            elif err is not None:
                ctx.counters["flash_read_errors"] += 1
                reason = ("truncated" if isinstance(err, ShortRead) else
                          "swapped or unreadable" if "superblock" in str(err) else "failed")
                self._health.mark_unhealthy(dev.index, err, reason)
        if dead:
            ctx.io.spawn(self._invalidator.invalidate(dead, free=False))
        self._health.check_slow({j.device.index for j in jobs})
        return result


def _reader(block_nbytes: int, ahead: SubmitRead | None = None, tally: ReadTally | None = None,
            piece_bytes: int = 0
            ) -> Callable[[list[ReadJob]], Generator[None, None, list[BaseException | None]]]:
    """The I/O-thread work of a promotion: for a part of the jobs, read and check each
    record into its view; one result per job (None: verified). ``ahead`` and ``tally``:
    the payload reads' pipeline (:meth:`FlashDevice.read_payload_pieces`). A generator
    (``IOPool.parallel_pieces``): it yields between payload runs, once per
    ``piece_bytes`` checked."""

    def headers(part: list[ReadJob]) -> list[RecordHeader | FlashIOError | None]:
        """The part's record headers, read per device in runs of its header tables
        (FlashDevice.read_headers): a few I/Os instead of one per block."""
        got: list[RecordHeader | FlashIOError | None] = [None] * len(part)
        by_dev: dict[FlashDevice, list[int]] = {}
        for i, job in enumerate(part):
            if job.device.healthy:
                by_dev.setdefault(job.device, []).append(i)
        for dev, idx in by_dev.items():
            for i, h in zip(idx, dev.read_headers([part[i].slot for i in idx]), strict=True):
                got[i] = h
        return got

    def work(part: list[ReadJob]) -> Generator[None, None, list[BaseException | None]]:
        out: list[BaseException | None] = [None] * len(part)
        identity: dict[FlashDevice, FlashIOError | None] = {}

        def failed(dev: FlashDevice, exc: ReadFailure) -> BaseException:
            # Is it the record, or is the whole device not ours any more?
            if dev not in identity:
                try:
                    dev.check_identity()
                    identity[dev] = None
                except FlashIOError as id_exc:
                    identity[dev] = id_exc
            return identity[dev] or exc

        # Check every header first; then read the payloads of the blocks that passed,
        # per device in device order, adjacent ones by one I/O (read_payloads).
        ready: list[int] = []
        unsure: set[int] = set()
        hdrs = headers(part)
        for i, ((dev, _slot, _view, b, cipher, _auth), hdr) in enumerate(
                zip(part, hdrs, strict=True)):
            try:
                if not dev.healthy:
                    raise FlashIOError(5, f"flash device {dev.name!r} is marked failed")
                if isinstance(hdr, FlashIOError):
                    raise hdr
                if b.length != block_nbytes:
                    raise ReadFailure("record length does not match the namespace's "
                                      "block size", ours=True)
                dev.check_header(hdr, b.ns, b.key, b.length, b.crc, b.seq, cipher)
                if cipher is not None and hdr is not None and not hdr.key_check:
                    unsure.add(i)  # an older record: its key cannot be verified
                ready.append(i)
            except ReadFailure as exc:
                out[i] = failed(dev, exc)
            except (FlashIOError, ValueError) as exc:
                out[i] = exc
        groups: dict[tuple[FlashDevice, XtsCipher | None], list[int]] = {}
        for i in ready:
            groups.setdefault((part[i].device, part[i].cipher), []).append(i)
        for (dev, cipher), group in groups.items():

            def authentic(k: int, dev: FlashDevice = dev, group: list[int] = group,
                          confirmed: bool = cipher is not None) -> ReadFailure | None:
                # The CRC32C held: is it authentic, and here? Checked while in cache.
                i = group[k]
                hdr = hdrs[i]
                assert isinstance(hdr, RecordHeader)
                job = part[i]
                slot, view, b, auth = job.slot, job.view, job.block, job.auth
                try:
                    dev.check_tag(auth, hdr, slot, view[: b.length],
                                  confirmed and i not in unsure)
                except ReadFailure as exc:
                    exc.__traceback__ = None  # its frames hold the slot's view
                    return exc
                return None

            got = yield from dev.read_payload_pieces(
                [(part[i].slot, part[i].view, part[i].block.length, part[i].block.crc)
                 for i in group], cipher, authentic, ahead, tally, piece_bytes)
            for i, err in zip(group, got, strict=True):
                if isinstance(err, ReadFailure) and i in unsure:
                    # A CRC mismatch after decrypting with a key the header cannot confirm
                    # may be a wrong master key, not a bad record: never invalidate it.
                    err.ours = False
                out[i] = failed(dev, err) if isinstance(err, ReadFailure) else err
        return out

    return work
