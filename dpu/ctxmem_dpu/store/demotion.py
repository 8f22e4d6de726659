"""Demotion: writing DRAM-only blocks to flash, durably, in batches; the demoter task.

Write ordering (docs/reliability.md): payloads → fdatasync → headers → fdatasync. A header
therefore never reaches stable storage before its payload, so after a crash or power cut
every valid header on flash names a complete payload; a block is durable (and its extent
recorded in the index) only after the second sync.

Every record header carries the record's authenticator (``FlashDevice.tag``: a MAC under
the namespace's key over the plaintext, binding key, device, payload offset and sequence
number), made by the I/O thread from the DRAM slot right after its payload was written
and its CRC32C re-checked: one call per record, which reads the slot once more while it
is in cache.

A block is persisted only while its DRAM bytes still match the CRC32C computed at commit:
each payload's CRC32C is recomputed from the DRAM slot right after the slot was written
(encrypted from it, while it is still in cache), and a block that changed since commit (a
shared-memory client writing slots it no longer holds) is dropped, a miss, counted in
``dram_crc_mismatch``, and its header never written. A change racing the write itself and
undone before the check is caught on read, where every record's CRC32C is verified.

:meth:`Demotion.demote` returns, per block it could not make durable, why: the
:class:`~ctxmem_dpu.tiers.flash.FlashIOError` of the failed write (``ENOSPC`` when the tier
had no room, ``ENODEV`` when no device was usable), or :class:`DramChanged`. Write-through
commits turn those into errors (``store.writethrough``).
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import time
from collections.abc import Callable, Hashable
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple

from ctxmem_common.codecs import XtsCipher, crc32c_many
from ctxmem_common.codecs.blockauth import BlockAuthenticator
from ctxmem_common.flash_format import (
    FLAG_DEVICE_ENCRYPTED,
    FLAG_ENCRYPTED,
    pack_record_headers,
)
from ctxmem_dpu import faults
from ctxmem_dpu.alloc import SlotRef
from ctxmem_dpu.blocks import Block
from ctxmem_dpu.keyring import Keyring
from ctxmem_dpu.store.context import StoreContext
from ctxmem_dpu.store.flash_room import FlashRoom
from ctxmem_dpu.store.health import DeviceHealth
from ctxmem_dpu.store.index import BlockIndex
from ctxmem_dpu.store.invalidation import Invalidator
from ctxmem_dpu.store.ioqueue import IoClass, work_as
from ctxmem_dpu.tiers.flash import Extent, FlashDevice, FlashIOError
from ctxmem_dpu.tiers.flash_fence import SlabFenced


class Record(NamedTuple):
    """What every record of one namespace on one device shares (looked up once per
    namespace and device in a batch)."""

    cipher: XtsCipher | None  # None: written in plaintext
    flags: int  # the header flags (FLAG_ENCRYPTED, FLAG_DEVICE_ENCRYPTED)
    key_check: int  # the cipher's key check value (0: plaintext)
    auth: BlockAuthenticator  # the namespace's authenticator


class Job(NamedTuple):
    """One block of a demotion: made on the loop (:meth:`Demotion._jobs`), read by the
    I/O threads. A tuple still, so the phases pull columns out by C-level maps."""

    device: FlashDevice
    slot: SlotRef  # the flash slot
    block: Block
    view: memoryview  # the DRAM slot's view (released when the batch ends)
    record: Record
    region: memoryview  # the DRAM slab's mapping ...
    at: int  # ... and the slot's offset in it


_SIZE_NS = attrgetter("slot_size", "ns")
_HEADER_FIELDS = attrgetter("ns", "key", "length", "crc", "seq")
_HITS = attrgetter("hits")
_LENGTH = attrgetter("length")
_SLOT_SIZE = attrgetter("slot_size")
_DEVICE = attrgetter("device")


def _fields(record: type[tuple[Any, ...]], *names: str) -> itemgetter[Any]:
    """An itemgetter of ``record``'s fields by name: as fast over a batch's columns as
    over plain tuples (attrgetter on a NamedTuple is about twice as slow)."""
    fields: tuple[str, ...] = record._fields  # type: ignore[attr-defined]
    return itemgetter(*map(fields.index, names))


_SLOT, _BLOCK, _VIEW, _RECORD, _AT = (_fields(Job, "slot"), _fields(Job, "block"),
                                      _fields(Job, "view"), _fields(Job, "record"),
                                      _fields(Job, "at"))
_DEV = _fields(Job, "device")
_DEV_RECORD = _fields(Job, "device", "record")
_CRC = attrgetter("crc")
_REGION_ID: Callable[[Job], Hashable] = lambda job: id(job.region)  # noqa: E731
_FLAGS, _KEY_CHECK = _fields(Record, "flags"), _fields(Record, "key_check")

log = logging.getLogger("ctxmem_dpu.store")

# The demoter's poll period, and the longest it waits between tries that made no progress.
DEMOTE_POLL_S = 0.02
DEMOTE_BACKOFF_MAX_S = 1.0
# The most blocks the byte bound (``flash.demote_batch_bytes``) adds to a background
# batch. The demoter's event-loop work before the first write and after the last sync is
# per block (≈ 1 µs each way): 5,000 blocks of 4 KiB in one batch stalled the loop for
# milliseconds and took the bench's 10k-key Lookup p99 from 1.6 to 4.3 ms. 256 blocks
# (16 MiB of 64 KiB blocks) keep a stall near half a millisecond; ``flash.demote_batch``
# (the count every batch takes at least) is not capped.
DEMOTE_BATCH_MAX_BLOCKS = 256
# Demotion re-checks each block's CRC32C and makes its authenticator in chunks of about
# this many bytes, so the tag reads the slot from cache right after the CRC did.
TAG_CHUNK_BYTES = 1 << 20
# "flash tier full" is logged at most this often (each occurrence is counted in flash_full).
FLASH_FULL_LOG_INTERVAL_S = 30.0


class DramChanged(Exception):
    """A block's DRAM bytes no longer match the CRC32C computed at its commit: it was not
    persisted and is dropped (a miss)."""


class Demotion:
    """DRAM → flash."""

    def __init__(self, ctx: StoreContext, index: BlockIndex, room: FlashRoom,
                 invalidator: Invalidator, health: DeviceHealth, keyring: Keyring) -> None:
        self._ctx = ctx
        self._index = index
        self._room = room  # where its extents come from (leased slabs, flash victims)
        self._invalidator = invalidator
        self._health = health
        self._keyring = keyring
        self._flash_full_logged = -FLASH_FULL_LOG_INTERVAL_S

    async def run(self) -> None:
        """The write-back demoter: demote dirty blocks in batches until the store closes.

        Polls every 20 ms instead of waiting on an Event under wait_for: cancelling a
        task blocked in wait_for(Event.wait()) can hang on CPython 3.11 at shutdown.
        While no device is healthy it does not try at all (the reaper's probe brings
        devices back); while it makes no progress (flash full of pinned blocks) it
        backs off to DEMOTE_BACKOFF_MAX_S between tries."""
        ctx, dirty = self._ctx, self._index.dirty
        pause = DEMOTE_POLL_S
        while not ctx.closed:
            await asyncio.sleep(pause)
            if not self._health.usable():
                continue
            while dirty and ctx.flash.enabled and not ctx.closed:
                batch = self._next_batch()
                before = len(dirty)
                try:
                    await self.demote(batch)
                except Exception:
                    log.exception("background demotion failed")
                    break
                if len(dirty) >= before:  # no progress (flash full or failing)
                    pause = min(DEMOTE_BACKOFF_MAX_S, pause * 2 ** 4)
                    break
                pause = DEMOTE_POLL_S

    def _next_batch(self) -> list[Block]:
        """The demoter's next batch: the oldest dirty blocks, ``flash.demote_batch`` of
        them at least, and more until they hold ``flash.demote_batch_bytes`` (slot
        sizes) or :data:`DEMOTE_BATCH_MAX_BLOCKS` blocks: 32 blocks of 2 MiB already
        hold 64 MiB; 64 KiB blocks go 256 at a time (16 MiB), not 32."""
        cfg, dirty = self._ctx.cfg.flash, self._index.dirty
        batch = list(itertools.islice(dirty, cfg.demote_batch))
        want = cfg.demote_batch_bytes
        nbytes = sum(map(_SLOT_SIZE, batch))
        if nbytes < want and len(batch) < min(len(dirty), DEMOTE_BATCH_MAX_BLOCKS):
            for b in itertools.islice(dirty, len(batch), DEMOTE_BATCH_MAX_BLOCKS):
                batch.append(b)
                nbytes += b.slot_size
                if nbytes >= want:
                    break
        return batch

    async def demote(self, blocks: list[Block]) -> dict[Block, BaseException]:
        """Write DRAM-only blocks to flash and make them durable (see the module doc);
        returns the blocks that are not durable now, each with why (blocks that need no
        demotion, or that another demotion has in flight, are not named).

        Each record is encrypted with its namespace's key unless its device encrypts in
        hardware (:class:`~ctxmem_dpu.keyring.Keyring`); the header's flags say which
        layer encrypted (ctxmem's, or the device's).

        The loop's work is per batch where it can be (issue 17 item 3: 512 blocks of
        64 KiB spent ≈ 1 ms before the first write and ≈ 0.9 ms after the last sync):
        the cipher and header flags once per namespace and device, the DRAM slab's
        mapping once per slab, no header object per record (the I/O threads pack the
        batch's headers column-wise), the durable blocks' index updates in bulk.

        The demotion runs to its end even if the request that asked for it (an Evict, a
        put making room) is cancelled (``IOPool.uncancellable``): cut short, its extents
        would be given up while the I/O threads may still be writing into them."""
        return await self._ctx.io.uncancellable(self._demote_now(blocks))

    async def _demote_now(self, blocks: list[Block]) -> dict[Block, BaseException]:
        ctx = self._ctx
        work_as(IoClass.STORE)  # behind gets' promotions (store/ioqueue.py)
        # A copy fetched from another node (``origin``) stays in DRAM only: on flash it
        # would come back after a restart as this node's own block (docs/pod.md).
        blocks = [b for b in blocks if b.dram is not None and b.flash is None
                  and not b.deleted and b.io is None and b.origin is None]
        failures: dict[Block, BaseException] = {}
        if not blocks or not ctx.flash.enabled:
            return failures
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._index.pin_many(blocks)  # claimed before any await: no concurrent demotion
        for b in blocks:  # takes them
            b.io = fut
        # The blocks that got an extent, and their extents, in the same order.
        planned: list[Block] = []
        exts: list[Extent] = []
        jobs: list[Job] = []
        results: list[BaseException | None] = []
        ok = False
        try:
            # Grouped by tenant too: flash eviction is fair per tenant (store.quotas).
            for (size, tenant), group in self._groups(blocks).items():
                got = await self._room.reserve(size, len(group), tenant)
                if got is None:
                    no_room = self._no_room(size, len(group))
                    failures.update(dict.fromkeys(group, no_room))
                    continue
                planned += group
                exts += got
                self._invalidator.begin(got)
            jobs = self._jobs(planned, exts)
            if jobs:
                faults.point("demote.before_write")
                results = await self._write_records(jobs, time.time_ns())
            ok = True
        finally:
            for job in jobs:
                job.view.release()
            fut.set_result(None)
            self._invalidator.end(exts)
            if not ok:  # cancelled or failed before the records were written
                for ext in exts:
                    self._invalidator.park(ext)
                for b in blocks:
                    b.io = None
                    self._invalidator.unpin(b)
        durable: list[Block] = []
        wrote: set[int] = set()
        for b, ext, err in zip(planned, exts, results, strict=True):
            if err is None:
                # Durable. A block deleted meanwhile keeps its extent until ``delete``
                # (waiting on ``b.io``) zeroes the header.
                b.flash = ext
                wrote.add(ext.device)
                if not b.deleted:
                    durable.append(b)
            else:
                self._not_written(b, ext, err, failures)
        self._index_durable(durable)
        unpin = self._invalidator.unpin
        for b in blocks:
            b.io = None
            unpin(b)
        self._health.wrote(wrote)
        self._health.check_slow(set(map(_DEVICE, exts)))
        return failures

    def _groups(self, blocks: list[Block]) -> dict[tuple[int, str], list[Block]]:
        """``blocks`` by (slot size, tenant), each group in the blocks' order; the tenant
        looked up once per namespace (one C-level pass when the batch has one)."""
        if len(set(map(_SIZE_NS, blocks))) == 1:
            b = blocks[0]
            return {(b.slot_size, self._room.tenant_of(b)): blocks}
        tenants: dict[bytes, str] = {}
        out: dict[tuple[int, str], list[Block]] = {}
        for b in blocks:
            tenant = tenants.get(b.ns)
            if tenant is None:
                tenant = tenants[b.ns] = self._room.tenant_of(b)
            out.setdefault((b.slot_size, tenant), []).append(b)
        return out

    def _jobs(self, planned: list[Block], exts: list[Extent]) -> list[Job]:
        """One :data:`Job` per block: its extent's device and slot, the DRAM slot's view,
        and the record's cipher and header flags (looked up once per namespace and device),
        the slab's mapping and offsets once per DRAM slab. Computed here, on the loop,
        which owns the DRAM tier's bookkeeping; the I/O threads only move bytes."""
        dram, devices, keyring = self._ctx.dram, self._ctx.flash.devices, self._keyring
        records: dict[tuple[bytes, int], Record] = {}
        slabs: dict[int, tuple[memoryview, int]] = {}
        jobs: list[Job] = []
        for b, ext in zip(planned, exts, strict=True):
            rec = records.get((b.ns, ext.device))
            if rec is None:
                name = devices[ext.device].name
                cipher = keyring.for_device(b.ns, name)
                rec = records[(b.ns, ext.device)] = Record(
                    cipher,
                    (FLAG_ENCRYPTED if cipher is not None else 0)
                    | (FLAG_DEVICE_ENCRYPTED if keyring.device_encrypts(name) else 0),
                    cipher.check_value if cipher is not None else 0,
                    keyring.authenticator(b.ns))
            ref = b.dram
            assert ref is not None
            slab = slabs.get(ref.slab)
            if slab is None:  # ctx.dram.slot_view, keeping the slot's place in its slab
                slab = slabs[ref.slab] = (dram.regions[ref.slab].view,
                                          dram.alloc.slabs[ref.slab].slot_size)
            region, size = slab
            at = ref.index * size
            jobs.append(Job(devices[ext.device], ext.slot, b, region[at : at + size], rec,
                            region, at))
        return jobs

    def _not_written(self, b: Block, ext: Extent, err: BaseException,
                     failures: dict[Block, BaseException]) -> None:
        """``b`` was not made durable at ``ext`` because of ``err``: free or park the
        extent, and say why in ``failures``."""
        ctx = self._ctx
        if isinstance(err, SlabFenced):
            # Shared flash: the slab's lease lapsed or was taken over; no header was
            # written there. The block stays dirty (another slab takes it).
            failures[b] = err
            ctx.counters["flash_fenced_writes"] += 1
            ctx.flash.free(ext)
        elif isinstance(err, DramChanged):
            failures[b] = err
            # Its header was never written: the extent holds no record.
            ctx.flash.free(ext)
            self._drop_changed(b, err)
        else:
            ctx.counters["flash_write_errors"] += 1
            # The header may or may not have landed: zero it before reuse.
            self._invalidator.park(ext)
            full = self._health.write_failed(ext.device, err)
            failures[b] = err if not full or getattr(err, "errno", None) == errno.ENOSPC \
                else FlashIOError(errno.ENOSPC, f"the filesystem holding flash device "
                                  f"{ctx.flash.devices[ext.device].name!r} is full: {err}")

    def _index_durable(self, blocks: list[Block]) -> None:
        """``blocks`` (not deleted) are durable on flash: out of the dirty set, into the
        flash LRU (in order), counted; on a shared device announced with their location
        (any node of the pod can now read them directly). In bulk: a demotion's blocks
        have no flash copy yet, so none is in the flash LRU, and blocks not yet reused
        enter its probation end in one update."""
        if not blocks:
            return
        index, ctx = self._index, self._ctx
        index.made_durable(blocks)
        ctx.counters["demoted_blocks"] += len(blocks)
        ctx.counters["demoted_bytes"] += sum(map(_LENGTH, blocks))
        devices = ctx.flash.devices
        if any(d.fence is not None for d in devices):
            index.announce([b for b in blocks if b.flash is not None
                            and devices[b.flash.device].fence is not None], True)

    def _drop_changed(self, b: Block, err: DramChanged) -> None:
        """``b``'s DRAM bytes changed after commit: it is a miss from now on; its slot is
        freed by the last unpin."""
        self._ctx.counters["dram_crc_mismatch"] += 1
        log.warning("%s; dropped (a miss), not persisted", err)
        self._index.changed(b)

    def _no_room(self, size: int, n: int) -> FlashIOError:
        """Why ``n`` extents of ``size`` could not be found: no device usable (ENODEV) or
        the tier is full (ENOSPC, counted in ``flash_full``)."""
        devices = self._ctx.flash.devices
        if not self._health.usable():
            states = ", ".join(f"{d.name} {d.health_reason or 'failed'}" for d in devices)
            return FlashIOError(errno.ENODEV, f"no flash device is usable ({states}) for "
                                f"{n} blocks")
        self._flash_full(n)
        names = ", ".join(d.name for d in devices if d.healthy)
        return FlashIOError(errno.ENOSPC, f"flash tier full: no room for {n} blocks of "
                            f"{size} bytes on {names}, none can be evicted")

    def _flash_full(self, n: int) -> None:
        self._ctx.counters["flash_full"] += 1
        now = time.monotonic()
        if now >= self._flash_full_logged + FLASH_FULL_LOG_INTERVAL_S:
            self._flash_full_logged = now
            log.warning("flash tier full: %d blocks stay in DRAM only (counted in "
                        "flash_full; logged at most every %g s)", n, FLASH_FULL_LOG_INTERVAL_S)

    async def _write_records(self, jobs: list[Job], committed_ns: int
                             ) -> list[BaseException | None]:
        """The four I/O phases of a demotion; one result per job (None: durable).
        ``committed_ns``: the write time every header of the batch records."""
        io = self._ctx.io
        # Each written block's authenticator, from the payload phase to the header phase
        # (set by the I/O threads: one dict store per block).
        tags: dict[Block, bytes] = {}

        def fences(jobs: list[Job]) -> list[BaseException | None]:
            # Shared devices: is each slab's lease still this node's (clock and the slab
            # header's epoch on the device)? Once per slab per batch.
            slabs: dict[FlashDevice, set[int]] = {}
            for dev, slot, *_rest in jobs:
                if dev.fence is not None:
                    slabs.setdefault(dev, set()).add(slot.slab)
            if not slabs:
                return [None] * len(jobs)
            fenced = {(dev, slab): exc for dev, ss in slabs.items()
                      for slab, exc in dev.check_fences(ss).items()}
            return [fenced.get((j.device, j.slot.slab)) for j in jobs]

        def payloads(part: list[tuple[Job, BaseException | None]]
                     ) -> list[BaseException | None]:
            # Per device and record kind (cipher), adjacent extents by one write
            # (write_payloads). Columns pulled out by C-level maps: no Python step per
            # block on the common batch (one device, one namespace, one DRAM slab).
            out: list[BaseException | None] = [err for _job, err in part]
            for (dev, rec), group in _grouped(part, out, _DEV_RECORD).items():
                todo = [part[i][0] for i in group]
                got = dev.write_payloads(list(zip(map(_SLOT, todo), map(_VIEW, todo),
                                                  strict=True)),
                                         rec.cipher)
                for i, err in zip(group, got, strict=True):
                    out[i] = err
            # After the writes, while the slots are in cache: what was written is what was
            # committed, or the block is dropped (see the module doc). One native call per
            # chunk of about TAG_CHUNK_BYTES of one DRAM slab (the GIL released once per
            # chunk, not once per block), then each of the chunk's authenticators
            # (plaintext, from the slot) while the CRC pass left it in cache.
            for _region, whole in _grouped(part, out, _REGION_ID).items():
                step = max(1, TAG_CHUNK_BYTES // part[whole[0]][0].block.slot_size)
                for at in range(0, len(whole), step):
                    group = whole[at : at + step]
                    todo = [part[i][0] for i in group]
                    blocks = list(map(_BLOCK, todo))
                    got_crcs = crc32c_many(todo[0].region, list(map(_AT, todo)),
                                           list(map(_LENGTH, blocks)))
                    if got_crcs != list(map(_CRC, blocks)):
                        for i, b, got_crc in zip(group, blocks, got_crcs, strict=True):
                            if got_crc != b.crc:
                                out[i] = DramChanged(
                                    f"block {b.key.hex()[:16]} of namespace {b.ns.hex()[:16]}: "
                                    f"DRAM bytes changed after commit (CRC32C {got_crc:08x}, "
                                    f"committed {b.crc:08x}; a shared-memory client wrote a "
                                    f"slot it no longer holds)")
                    for i, (dev, slot, b, view, rec, _r, _a) in zip(group, todo, strict=True):
                        if out[i] is None:
                            tags[b] = dev.tag(rec.auth, b.key, view[: b.length], slot, b.seq)
            return out

        def headers(part: list[tuple[Job, BaseException | None]]
                    ) -> list[BaseException | None]:
            # Per device, the batch's headers packed column-wise in one pass, those of
            # adjacent extents written by one write (write_header_rows).
            out: list[BaseException | None] = [err for _job, err in part]
            for dev, group in _grouped(part, out, _DEV).items():
                todo = [part[i][0] for i in group]
                namespaces, keys, lengths, crcs, seqs = zip(
                    *map(_HEADER_FIELDS, map(_BLOCK, todo)), strict=True)
                recs = list(map(_RECORD, todo))
                try:
                    rows = pack_record_headers(
                        namespaces, keys, lengths, crcs, seqs, list(map(_FLAGS, recs)),
                        list(map(_KEY_CHECK, recs)), committed_ns,
                        list(map(tags.__getitem__, map(_BLOCK, todo))))
                except ValueError as exc:
                    got: list[BaseException | None] = [exc] * len(group)
                else:
                    got = dev.write_header_rows(list(map(_SLOT, todo)), rows)
                for i, err in zip(group, got, strict=True):
                    out[i] = err
            return out

        def sync(devs: list[FlashDevice]) -> dict[FlashDevice, BaseException]:
            failed: dict[FlashDevice, BaseException] = {}
            for dev in devs:
                try:
                    dev.sync()
                except FlashIOError as exc:
                    failed[dev] = exc
            return failed

        async def synced(results: list[BaseException | None]) -> list[BaseException | None]:
            # A sync failure fails every write on that device.
            devs = list({j.device for j, r in zip(jobs, results, strict=True) if r is None})
            failed = await io.run(sync, devs)
            if not failed:
                return results
            return [failed.get(j.device, r) if r is None else r
                    for j, r in zip(jobs, results, strict=True)]

        fenced = await io.run(fences, jobs)
        # The payloads in parts of at most service.io_piece_bytes (one block at least),
        # each an I/O job of its own: a get arriving waits for one part, not for half the
        # batch (the I/O queue never interrupts a running job). The syncs below still
        # cover every part: a block is durable only once all are written and synced.
        piece = self._ctx.cfg.service.io_piece_bytes
        per_part = max(1, piece // max(map(_SLOT_SIZE, map(_BLOCK, jobs)))) if piece else 0
        results = await io.parallel(payloads, list(zip(jobs, fenced, strict=True)),
                                    per_part=per_part)
        faults.point("demote.after_payload")
        results = await synced(results)
        faults.point("demote.after_payload_sync")
        results = await io.parallel(headers, list(zip(jobs, results, strict=True)))
        faults.point("demote.after_header")
        results = await synced(results)
        faults.point("demote.after_sync")
        return results


def _grouped(part: list[tuple[Job, BaseException | None]], out: list[BaseException | None],
             key: Callable[[Job], Hashable]) -> dict[Any, list[int]]:
    """The indexes of ``part`` whose ``out`` is still None, by ``key`` of their job (in
    order): one C-level pass when they share one key (the common batch)."""
    todo = [i for i, err in enumerate(out) if err is None]
    if not todo:
        return {}
    jobs = [part[i][0] for i in todo]
    keys = list(map(key, jobs))
    if keys.count(keys[0]) == len(keys):
        return {keys[0]: todo}
    groups: dict[Any, list[int]] = {}
    for i, k in zip(todo, keys, strict=True):
        groups.setdefault(k, []).append(i)
    return groups

