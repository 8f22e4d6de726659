"""A formatted flash device: its superblock pair, its slabs and their allocator, its
health (identity, probe, reopen, slab-header scrub) and the warm-restart scan.

The format and its reader are :mod:`ctxmem_common.flash_format`; this module applies them
to a :class:`~ctxmem_dpu.tiers.flash_io.DeviceFile` through its O_DIRECT reads. Record
reads and writes are :mod:`ctxmem_dpu.tiers.flash_records`.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from ctxmem_common.codecs import crc32c
from ctxmem_common.flash_format import (
    BEAT_OFFSET,
    BEAT_SLOTS,
    DATA_START,
    PROBE_OFFSET,
    SB_OFFSET,
    SECTOR,
    FlashReader,
    NodeBeat,
    RecordHeader,
    SlabHeader,
    Superblock,
    TableColumns,
    aligned_buffer,
    fd_read_into,
    fit_records,
    header_offset,
    payload_offset,
    slab_base,
    slots_per_slab,
)
from ctxmem_dpu.alloc import Slab, SlabAllocator, SlotRef
from ctxmem_dpu.storage.nvme_resv import RESV_TYPE, NvmeReservation, node_key
from ctxmem_dpu.tiers.flash_fence import SlabFence, SlabFenced
from ctxmem_dpu.tiers.flash_io import ZEROS, DeviceFile, FlashIOError, ShortRead, scan_buffers

log = logging.getLogger(__name__)


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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.revoked: set[int] = set()

    # -- shared devices: only leased slabs are handed out (ctxmem_dpu.tiers.flash_fence)
    def start_empty(self) -> None:
        """A shared device: no slab is this service's until its lease is granted."""
        self._free_slabs.clear()

    def add_slab(self, slab_id: int) -> None:
        """A lease on free slab ``slab_id`` was granted: it may be assigned."""
        self.revoked.discard(slab_id)
        slab = self.slabs[slab_id]
        if slab.klass is None and slab_id not in self._free_slabs:
            self._free_slabs.append(slab_id)
            self._free_slabs.sort(reverse=True)

    def revoke_slab(self, slab_id: int) -> None:
        """The lease on ``slab_id`` is lost: hand out nothing more from it (its slots in
        use stay counted until freed; the slab never returns to the pool)."""
        self.revoked.add(slab_id)
        if slab_id in self._free_slabs:
            self._free_slabs.remove(slab_id)
        slab = self.slabs[slab_id]
        if slab.klass is not None:
            self._partial.get(slab.klass, set()).discard(slab_id)

    def free(self, ref: SlotRef) -> None:
        super().free(ref)
        if ref.slab in self.revoked:
            self.revoke_slab(ref.slab)

    def free_many(self, refs: Sequence[SlotRef]) -> None:
        super().free_many(refs)
        if self.revoked:
            for slab_id in self.revoked.intersection(r.slab for r in refs):
                self.revoke_slab(slab_id)

    def free_slab_ids(self) -> list[int]:
        """The slabs not assigned to any slot size (leased ones, on a shared device)."""
        return sorted(self._free_slabs)


class FormattedDevice(DeviceFile):
    """One device or file, formatted with a superblock pair and cut into slabs (a blank
    one is formatted on open; a damaged superblock copy is restored; a device that holds
    slab headers but no valid superblock is refused: ``ctxmem check --repair`` rebuilds
    its superblock, formatting it would lose every record)."""

    def __init__(self, index: int, name: str, path: str, slab_size: int, o_direct: bool,
                 lock: bool = True, fence: SlabFence | None = None) -> None:
        # A shared device: the slabs this service leases (None: it owns the device).
        self.fence = fence
        # A shared device whose target offers NVMe reservations: this node's registration
        # (registered before the first write, in _before_writes); None: the on-device epoch
        # alone fences, for the reason in resv_absent.
        self.resv: NvmeReservation | None = None
        self.resv_absent = ""
        super().__init__(name, path, o_direct, lock, shared=fence is not None)
        self.index = index
        self.healthy = True
        self.health_reason = ""
        self._fresh: set[int] = set()  # slabs assigned but not yet initialised on flash
        # What this process knows of its slabs' header tables (devices it owns; see
        # _init_slab): per slab, the leading table entries it zeroed when it last
        # initialised the slab, and the entries it wrote a record header to since without
        # zeroing it again. A restart knows nothing: every slab it assigns is zeroed whole.
        self._table_zeroed: dict[int, tuple[int, int]] = {}  # (entries, slot size)
        self._headers_live: dict[int, set[int]] = {}
        self._init_lock = threading.Lock()
        # Through read_into: O_DIRECT, the fault layer, FlashIOError/ShortRead.
        self.reader = FlashReader(self.read_into, scan_buffers)
        try:
            self.superblock = self._load_or_format(slab_size)
        except BaseException:
            self.close()
            raise
        self.slab_size = self.superblock.slab_size
        self.num_slabs = self.superblock.num_slabs
        fits = max(0, (self.size - DATA_START) // self.slab_size)
        if fits < self.num_slabs:
            # Served as it is (the blocks in the cut part are lost); it is never grown back
            # behind the operator's back (see storage.local).
            log.error("flash device %s holds %d bytes, less than its %d formatted slabs need "
                      "(truncated?): using the first %d slabs", name, self.size,
                      self.num_slabs, fits)
            self.num_slabs = fits
        self.alloc = FlashSlabAllocator(
            self.num_slabs,
            slots_per_slab=lambda slot: slots_per_slab(self.slab_size, slot),
            on_assign=self._slab_assigned,
        )
        if fence is not None:
            self.alloc.start_empty()

    # -- NVMe reservations (shared devices; ctxmem_dpu.storage.nvme_resv) ---------------
    def _before_writes(self) -> None:
        """A shared device: where the target offers reservations, register this node's
        key and reserve the namespace Write Exclusive - All Registrants, before the first
        write; where it offers none, say why once (the on-device epoch alone fences)."""
        if self.fence is None:
            return
        resv = NvmeReservation(self.fd, self.name, self.fence.node_id)
        try:
            support = resv.probe()
            if not support.ok:
                resv.close()
                self.resv_absent = support.reason
                log.warning("flash device %s (shared, %s): no NVMe reservations: %s; the "
                            "slab headers' epochs alone fence it", self.name, self.path,
                            support.reason)
                return
            resv.register()
            resv.acquire(RESV_TYPE)
            st = resv.report()
        except OSError as exc:
            resv.close()
            raise FlashIOError(exc.errno or errno.EIO, f"flash device {self.name!r}: "
                               f"registering node {self.fence.node_id!r}'s reservation key "
                               f"failed: {exc}") from None
        if resv.key not in st.registered_keys() or st.rtype != RESV_TYPE:
            resv.close()
            raise FlashIOError(errno.EBADE, f"flash device {self.name!r}: after registering "
                               f"node {self.fence.node_id!r} the target reports reservation "
                               f"type {st.rtype} and {len(st.registrants)} registrants "
                               f"without its key; another host holds a conflicting "
                               f"reservation (nvme resv-report {self.path} shows it)")
        self.resv = resv
        log.info("flash device %s (shared): node %s registered key 0x%016x; namespace "
                 "reserved %s (%d registrants)", self.name, self.fence.node_id, resv.key,
                 RESV_TYPE.name, len(st.registrants))

    @property
    def fencing(self) -> str:
        """How this shared device is fenced: ``reservation``, ``epoch_only`` (the target
        has no reservations: :attr:`resv_absent` says why) or ``preempted`` (this node's
        key was preempted: it writes nothing more); ``""`` on a device it owns."""
        if self.fence is None:
            return ""
        if self.fence.stopped:
            return "preempted"
        return "reservation" if self.resv is not None else "epoch_only"

    def _preempted(self, what: str, exc: OSError) -> SlabFenced:
        """A write (or sync) failed with a reservation conflict: this node's key was
        preempted. Stop the fence (nothing more is written or acknowledged here)."""
        assert self.fence is not None
        reason = (f"its NVMe reservation key was preempted (a {what} failed with a "
                  f"reservation conflict: another node judged it dead and took its slabs); "
                  f"restart the service to register again and re-read its slabs")
        if not self.fence.stopped:
            log.error("flash device %s: node %s stops writing here: %s", self.name,
                      self.fence.node_id, reason)
        self.fence.stop(reason)
        return SlabFenced(errno.EBADE, f"flash device {self.name!r}: {what} refused: {exc}; "
                          f"node {self.fence.node_id!r} stops writing here: {reason}")

    def _pwrite(self, buf: Any, offset: int) -> None:
        try:
            super()._pwrite(buf, offset)
        except FlashIOError as exc:
            if self.fence is not None and exc.errno == errno.EBADE:
                raise self._preempted(f"write at {offset}", exc) from None
            raise

    def sync(self) -> None:
        try:
            super().sync()
        except FlashIOError as exc:
            if self.fence is not None and exc.errno == errno.EBADE:
                raise self._preempted("sync", exc) from None
            raise

    def refresh_owner(self) -> None:
        if self.fence is not None and self.fence.stopped:
            return  # it writes nothing more here
        try:
            super().refresh_owner()
        except OSError as exc:
            if self.fence is not None and exc.errno == errno.EBADE:
                self._preempted("pod marker refresh", exc)
                return
            raise

    def check_registration(self) -> bool:
        """Is this node's reservation key still registered (True where the target has no
        reservations)? When it is gone, the fence stops. Raises FlashIOError when the
        target cannot be asked."""
        if self.resv is None or self.fence is None or self.fence.stopped:
            return self.fence is None or not self.fence.stopped
        try:
            st = self.resv.report()
        except OSError as exc:
            raise FlashIOError(exc.errno or errno.EIO, str(exc)) from None
        if self.resv.key in st.registered_keys():
            return True
        self._preempted("Reservation Report", OSError(
            errno.EBADE, f"key 0x{self.resv.key:016x} is not among the "
                         f"{len(st.registrants)} registrants"))
        return False

    def fence_out(self, node: str) -> str:
        """Before taking a slab of ``node`` (judged dead): preempt and abort its
        reservation key, so a write it still sends fails on the device. Returns what was
        done (``""``: the target has no reservations). Raises FlashIOError when the key
        is still registered afterwards or the target refuses."""
        if self.resv is None:
            return ""
        key = node_key(node)
        try:
            if key not in self.resv.report().registered_keys():
                return f"node {node!r}'s key 0x{key:016x} was not registered"
            self.resv.preempt(key, RESV_TYPE, abort=True, victim=node)
            still = key in self.resv.report().registered_keys()
        except OSError as exc:
            raise FlashIOError(exc.errno or errno.EIO, f"flash device {self.name!r}: "
                               f"fencing out node {node!r}: {exc}") from None
        if still:
            raise FlashIOError(errno.EBADE, f"flash device {self.name!r}: node {node!r}'s key "
                               f"0x{key:016x} is still registered after preempt-and-abort; "
                               f"its slabs are not taken")
        return f"preempted and aborted node {node!r}'s key 0x{key:016x}"

    def close(self) -> None:
        """Close the file; on a shared device with reservations, unregister this node's
        key first (unless it was preempted: it holds none)."""
        resv, self.resv = getattr(self, "resv", None), None
        if resv is not None:
            try:
                if self.fence is not None and not self.fence.stopped:
                    resv.unregister()
            except OSError as exc:
                log.warning("flash device %s: %s", self.name, exc)
            finally:
                resv.close()
        super().close()

    # -- layout -------------------------------------------------------------------------
    def _load_or_format(self, slab_size: int) -> Superblock:
        # Read straight from the file (not through the fault layer): opening a device is
        # not one of the I/O calls faults are injected into.
        pair = (FlashReader(fd_read_into(self.fd)).superblocks() if self.size >= 2 * SECTOR
                else None)
        sb = pair.current if pair is not None else None
        if pair is not None and sb is not None:
            if pair.damaged:
                # One copy is damaged or missing (a device formatted before the backup
                # existed): rewrite both from the good one.
                log.warning("flash device %s: %s superblock is damaged or missing; "
                            "restoring it from the %s copy", self.name, pair.damaged,
                            "backup" if pair.damaged == "primary" else "primary")
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
        if self.shared:
            # Two services attaching a blank shared device at once would each format it
            # (two UUIDs, the other's records lost): a shared device is formatted once,
            # on purpose.
            raise FlashIOError(
                errno.ENODEV, f"flash device {self.name!r} ({self.path}) is shared but not "
                f"formatted; format it once, with no service attached: `ctxmem check "
                f"--format --device {self.name}={self.path} --slab-size SIZE`")
        self._refuse_if_not_blank(slab_size)
        sb = Superblock.new(slab_size, self.size)
        self._write_superblocks(sb)
        log.info("formatted flash device %s: %d slabs of %d bytes", self.name, sb.num_slabs,
                 slab_size)
        return sb

    def _refuse_if_not_blank(self, slab_size: int) -> None:
        """Raise FlashIOError when a device without a valid superblock holds slab headers:
        it is a damaged device with records, not a blank one, and only an operator may
        format it (``ctxmem check --format``) or rebuild its superblock (``--repair``)."""
        found = FlashReader(fd_read_into(self.fd)).find_slab_headers(self.size, [slab_size])
        if found:
            raise FlashIOError(
                errno.EUCLEAN,
                f"flash device {self.name!r} ({self.path}): both superblock copies are "
                f"damaged, but the device holds records ({len(found)} slab headers found); "
                f"not formatting it. Stop the service and run `ctxmem check --repair` "
                f"(rebuilds the superblock from the slab headers), or, to discard its "
                f"records, `ctxmem check --format --device {self.name}={self.path}`")

    def _write_superblocks(self, sb: Superblock) -> None:
        buf = aligned_buffer(2 * SECTOR)
        buf[:] = sb.pack_pair()
        self._pwrite(buf, SB_OFFSET)
        self.sync()

    def slab_base(self, slab: int) -> int:
        """Byte offset of ``slab`` on this device."""
        return slab_base(slab, self.slab_size)

    def header_offset(self, slot: SlotRef) -> int:
        """Byte offset of ``slot``'s record header."""
        return header_offset(slot.slab, slot.index, self.slab_size)

    def payload_offset(self, slot: SlotRef) -> int:
        """Byte offset of ``slot``'s payload (its slab must be assigned)."""
        return payload_offset(slot.slab, slot.index, self.slab_size,
                              self.alloc.slabs[slot.slab].slot_size)

    def _slab_assigned(self, slab: Slab) -> None:
        # Runs on the loop thread when a slab is handed to a slot size. The slab header and
        # a zeroed header table are written on the I/O thread, before the first payload
        # that lands in the slab (see _init_slab), so no I/O happens on the loop.
        self._fresh.add(slab.id)

    def _init_slab(self, slab_id: int) -> None:
        """Zero a freshly assigned slab's header table, then write its header: records a
        previous use of the slab left behind can never come back.

        On a device this service owns, a table it zeroed itself at the slab's last
        assignment, whose every record header written since was zeroed again (the store
        frees an extent only once its header is zeroed and synced), is still zero: only
        the entries past that table (the old layout's payload area, when the slab now
        holds smaller slots and so more entries) and any header still live are zeroed.
        Reusing a slab for the same slot size then writes nothing (its slab header, written
        and synced at the last assignment, says the same), where it used to rewrite the
        whole table (≈ 3.8 MiB for 64 KiB slots in a 64 MiB slab:
        issue 17 item 3). The zeroing is one device write, made durable with the
        payloads' sync, before any header of the slab is written (as before)."""
        with self._init_lock:
            if slab_id not in self._fresh:
                return
            s = self.alloc.slabs[slab_id]
            base = self.slab_base(slab_id)
            start, same = 0, False
            if self.fence is None:
                zeroed, slot_size = self._table_zeroed.pop(slab_id, (0, 0))
                start = min(zeroed, s.capacity)
                # The slab header this process wrote last time says the same.
                same = slot_size == s.slot_size
                live = self._headers_live.pop(slab_id, None)
                if live:
                    start = min(start, min(live))
            header = SlabHeader(s.slot_size, s.capacity).for_device(self.superblock)
            if self.fence is not None:
                # Never zero a table this service does not own (another node's records):
                # checked before anything is written. The lease's grant stamped the slab
                # header with this node and epoch (claim_slab); anything else there means
                # another node has taken it since.
                on_device = self.slab_owner(slab_id)
                self.fence.check(slab_id, on_device)
                mine = (self.fence.node_id, self.fence.epoch(slab_id))
                if on_device != mine:
                    raise SlabFenced(errno.EACCES, f"flash device {self.name!r}: slab "
                                     f"{slab_id} header names node {on_device[0]!r} at "
                                     f"epoch {on_device[1]}, not this node's lease {mine}; "
                                     f"not written")
                header = header.owned_by(*mine)
            self.zero_range(base + SECTOR + start * SECTOR, (s.capacity - start) * SECTOR)
            if not same:
                buf = aligned_buffer(SECTOR)
                buf[:] = header.pack()
                self._pwrite(buf, base)
            self._fresh.discard(slab_id)
            if self.fence is None:
                self._table_zeroed[slab_id] = (s.capacity, s.slot_size)

    def forget_tables(self) -> None:
        """Assume nothing of the tables of slabs not in use (a device that failed, was
        reopened or probed may have lost writes): each is zeroed whole, and its slab
        header written, when next assigned."""
        self._table_zeroed.clear()

    def zero_range(self, offset: int, n: int) -> None:
        """Write ``n`` zero bytes (whole sectors) at ``offset`` by one device write."""
        if n <= 0:
            return
        full, tail = divmod(n, len(ZEROS))
        zeros = [memoryview(ZEROS)] * full
        if tail:
            zeros.append(memoryview(ZEROS)[:tail])
        self._pwrite(zeros if len(zeros) > 1 else zeros[0], offset)

    def headers_written(self, slab_id: int, indices: Iterable[int]) -> None:
        """Record header entries about to be written in ``slab_id`` (not zero until
        :meth:`headers_zeroed`): the slab's next assignment zeroes them (see
        :meth:`_init_slab`)."""
        self._headers_live.setdefault(slab_id, set()).update(indices)

    def headers_zeroed(self, slab_id: int, indices: Iterable[int]) -> None:
        """Header entries of ``slab_id`` just zeroed (invalidated)."""
        live = self._headers_live.get(slab_id)
        if live:
            live.difference_update(indices)

    # -- shared devices -----------------------------------------------------------------
    def slab_owner(self, slab_id: int) -> tuple[str, int]:
        """(owner node, fencing epoch) the slab header on the device names (("", 0): none,
        or a slab of a device one service owns). A lease stamp (slot size 0: leased, no
        records yet) counts."""
        h = self._raw_slab_header(slab_id)
        return (h.owner, h.epoch) if h is not None else ("", 0)

    def _raw_slab_header(self, slab_id: int) -> SlabHeader | None:
        buf = aligned_buffer(SECTOR)
        self._pread(buf, self.slab_base(slab_id))
        return SlabHeader.unpack(memoryview(buf))

    def slab_owners(self) -> list[tuple[str, int]]:
        """:meth:`slab_owner` of every slab, read from the device now."""
        return [self.slab_owner(s) for s in range(self.num_slabs)]

    def slab_stamps(self) -> list[tuple[str, int, bool]]:
        """Per slab, read from the device now: (owner, epoch, whether it may hold records:
        a real slab header, not a lease stamp)."""
        out = []
        for s in range(self.num_slabs):
            h = self._raw_slab_header(s)
            out.append((h.owner, h.epoch, h.slot_size > 0) if h is not None
                       else ("", 0, False))
        return out

    def claim_slab(self, slab_id: int, epoch: int, seen: tuple[str, int]) -> bool:
        """Make a slab just leased at ``epoch`` this node's on the device, before it takes
        any write: if its header still names ``seen`` (what the choice was made on), write
        and sync a lease stamp (slot size 0: no records; the old records, a dead node's,
        become misses) naming this node at ``epoch``, then read it back. False (nothing
        written, or another node's stamp won a race) when the slab is not this node's."""
        assert self.fence is not None
        if self.slab_owner(slab_id) != seen:
            return False
        buf = aligned_buffer(SECTOR)
        buf[:] = SlabHeader(0, 0).for_device(self.superblock).owned_by(
            self.fence.node_id, epoch).pack()
        self._pwrite(buf, self.slab_base(slab_id))
        self.sync()
        return self.slab_owner(slab_id) == (self.fence.node_id, epoch)

    def unclaim_slab(self, slab_id: int, epoch: int) -> None:
        """Blank the lease stamp of a leased slab that holds nothing (a clean close gives
        it back): other nodes take it as blank. Left alone unless it names this node at
        ``epoch`` with slot size 0."""
        assert self.fence is not None
        h = self._raw_slab_header(slab_id)
        if h is None or h.slot_size or (h.owner, h.epoch) != (self.fence.node_id, epoch):
            return
        self._pwrite(aligned_buffer(SECTOR), self.slab_base(slab_id))
        self.sync()

    # -- pod heartbeats (a shared device) ------------------------------------------------
    def read_beats(self) -> dict[str, NodeBeat]:
        """Every pod node's heartbeat on the device (one read of the slots)."""
        buf = aligned_buffer(BEAT_SLOTS * SECTOR)
        self._pread(buf, BEAT_OFFSET)
        view = memoryview(buf)
        out: dict[str, NodeBeat] = {}
        for i in range(BEAT_SLOTS):
            if view[i * SECTOR] == 0:
                continue
            b = NodeBeat.unpack(view[i * SECTOR:(i + 1) * SECTOR])
            if b is not None:
                out[b.node] = b
        return out

    def write_beat(self, beat: NodeBeat) -> None:
        """Write this node's heartbeat into its slot (the first, probing from the node
        id's CRC32C, that names it or is empty) and sync."""
        buf = aligned_buffer(BEAT_SLOTS * SECTOR)
        self._pread(buf, BEAT_OFFSET)
        view = memoryview(buf)
        first = crc32c(beat.node.encode()) % BEAT_SLOTS
        slot = None
        for k in range(BEAT_SLOTS):
            i = (first + k) % BEAT_SLOTS
            b = NodeBeat.unpack(view[i * SECTOR:(i + 1) * SECTOR])
            if b is not None and b.node == beat.node:
                slot = i
                break
            if b is None and slot is None:
                slot = i
        if slot is None:
            raise FlashIOError(errno.ENOSPC, f"flash device {self.name!r}: all {BEAT_SLOTS} "
                               f"pod heartbeat slots hold other nodes; node {beat.node!r} "
                               f"has none")
        one = aligned_buffer(SECTOR)
        one[:] = beat.pack()
        self._pwrite(one, BEAT_OFFSET + slot * SECTOR)
        self.sync()

    def check_fences(self, slabs: set[int]) -> dict[int, FlashIOError]:
        """Before a write batch on a shared device: per slab that may not be written, why
        (its lease lapsed, or the header on the device names a later epoch)."""
        out: dict[int, FlashIOError] = {}
        if self.fence is None:
            return out
        for slab in slabs:
            try:
                self.fence.check(slab, None if slab in self._fresh else self.slab_owner(slab))
            except FlashIOError as exc:
                out[slab] = exc
        return out

    def restamp_slab(self, slab_id: int, epoch: int) -> None:
        """Rewrite a slab's header naming this node at ``epoch`` (a lease of a slab this
        node wrote before, granted again, or a lease stamp): its records stay."""
        assert self.fence is not None
        h = self._raw_slab_header(slab_id)
        if h is None:
            return
        buf = aligned_buffer(SECTOR)
        buf[:] = h.for_device(self.superblock).owned_by(self.fence.node_id, epoch).pack()
        self._pwrite(buf, self.slab_base(slab_id))
        self.sync()

    def owned_slabs(self) -> list[int]:
        """The slabs whose records this service indexes at start: every slab, or on a
        shared device the slabs it leases (other nodes' are found through the index)."""
        return list(range(self.num_slabs)) if self.fence is None else self.fence.slabs()

    # -- health (I/O threads) -----------------------------------------------------------
    def check_identity(self) -> None:
        """Read the superblock back (O_DIRECT, so from the device); raise FlashIOError when
        it is unreadable or belongs to another device (swapped)."""
        # (One damaged copy is fine: the other still says whose device this is.)
        if not self.reader.superblocks().names(self.superblock.device_uuid):
            raise FlashIOError(errno.EIO, f"flash device {self.name!r}: superblock changed "
                                          f"(device swapped?)")

    def probe(self) -> None:
        """Is a failed device usable again? Its superblock must be ours, it must be as long
        as its slabs need, and a write, sync and read of the probe sector must succeed,
        faster than three times ``slow_io_s``. Raises FlashIOError otherwise."""
        t0 = time.perf_counter()
        self.forget_tables()
        self.check_identity()
        need = DATA_START + self.num_slabs * self.slab_size
        have = os.lseek(self.fd, 0, os.SEEK_END)
        if have < need:
            raise ShortRead(errno.EIO, f"flash device {self.name!r} holds {have} bytes, its "
                                       f"slabs need {need} (truncated)")
        buf = aligned_buffer(SECTOR)
        stamp = f"ctxmem probe {time.time_ns()}".encode()
        buf[: len(stamp)] = stamp
        self._pwrite(buf, PROBE_OFFSET)
        self.sync()
        back = aligned_buffer(SECTOR)
        self._pread(back, PROBE_OFFSET)
        if back[: len(stamp)] != stamp:
            raise FlashIOError(errno.EIO, f"flash device {self.name!r}: probe sector read "
                                          f"back differs")
        if time.perf_counter() - t0 > 3 * self.slow_io_s:
            raise FlashIOError(errno.ETIMEDOUT, f"flash device {self.name!r}: still slow")

    def scrub_slab_headers(self) -> int:
        """Rewrite the header of every slab in use whose header on the device is missing or
        wrong (e.g. a device that was truncated and grew back as zeros): without it, the
        records written there from now on would be invisible to the next restart.
        Returns how many headers were rewritten."""
        # The device may have lost what this process wrote to slabs not in use (their
        # next assignment zeroes the table and writes the header again, see _init_slab).
        self.forget_tables()
        fixed = 0
        buf = aligned_buffer(SECTOR)
        for slab in self.alloc.slabs:
            if slab.klass is None or slab.id in self._fresh:
                continue
            want = SlabHeader(slab.slot_size, slab.capacity).for_device(self.superblock)
            if self.fence is not None:
                if not self.fence.held(slab.id):
                    continue  # not ours any more: another node's header
                want = want.owned_by(self.fence.node_id, self.fence.epoch(slab.id))
            self._pread(buf, self.slab_base(slab.id))
            if SlabHeader.unpack(memoryview(buf)) != want:
                buf[:] = want.pack()
                self._pwrite(buf, self.slab_base(slab.id))
                fixed += 1
        if fixed:
            self.sync()
            log.warning("flash device %s: rewrote %d damaged slab headers", self.name, fixed)
        return fixed

    def reopen(self, path: str) -> None:
        """Point this (failed) device at ``path``: the same device under a new node, e.g.
        an NVMe-oF namespace that was removed and came back as another /dev/nvmeXnY.
        The superblock there must carry this device's UUID; the old descriptor is retired,
        not closed. Raises FlashIOError, leaving the device as it was, when ``path`` cannot
        be opened or holds another device."""
        fd = self.open_other(path)
        try:
            try:
                pair = FlashReader(fd_read_into(fd)).superblocks()
            except OSError as exc:
                raise FlashIOError(exc.errno, f"flash device {self.name!r}: reading the "
                                              f"superblock at {path}: {exc.strerror}") from None
            if not pair.names(self.superblock.device_uuid):
                raise FlashIOError(errno.ENODEV, f"flash device {self.name!r}: {path} does "
                                                 f"not hold this device (superblock UUID "
                                                 f"differs or is unreadable); not reopened")
        except BaseException:
            os.close(fd)
            raise
        self.forget_tables()
        self.replace_fd(fd, path)
        if self.resv is not None:  # the registration is the host's: ask the new path
            self.resv.close()
            self.resv = NvmeReservation(fd, self.name, self.resv.node_id)

    # -- warm restart (I/O threads) -----------------------------------------------------
    def scan_slab(self, slab: int) -> tuple[int, int, TableColumns, int] | None:
        """One slab's valid records: (slab, slot size, records by column, how many
        entries hold a record of format version 1: not served, their slots free), or
        ``None`` for a slab without a valid header. One read for the slab header, one for
        its table."""
        scan = self.reader.scan_slab(slab, self.slab_size)
        if scan is None:
            return None
        return slab, scan.slot_size, fit_records(scan.records, scan.slot_size), len(scan.legacy)

    def scan(self) -> Iterator[tuple[SlotRef, int, RecordHeader]]:
        """Every valid record on the device: (slot, slot size, header)."""
        for slab in range(self.num_slabs):
            res = self.scan_slab(slab)
            if res is None:
                continue
            _slab, slot_size, cols, _old = res
            for i, ns, key, length, crc, seq, enc, ts in zip(*cols, strict=True):
                yield SlotRef(slab, i), slot_size, RecordHeader(ns, key, length, crc, seq,
                                                                 enc, ts)
