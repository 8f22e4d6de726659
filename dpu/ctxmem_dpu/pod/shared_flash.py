"""Reading any node's blocks straight from a pod's shared flash device.

:class:`SharedFlashSource` is the :class:`~ctxmem_dpu.pod.sources.RemoteSource` for
blocks the cluster index places on shared flash (a :class:`SharedLocation`: device UUID,
payload offset, length). It opens each shared device read-only with O_DIRECT (no lock,
no owner record: it never writes) and, per block, reads the slab header (cached per slab;
it gives the slot size, so where the record header lies), the record header and the
payload, then checks, in order: the record header's own CRC, namespace, key (when the
caller passes keys), sequence number, length, payload CRC, encryption flag and key check
against what the index published; decrypts with the namespace key derived from the
pod's master key (the XTS tweak is the device UUID and the byte offset, the same on every
node); compares the plaintext's CRC32C; and verifies the record's authenticator (a MAC
under the namespace's key derived from the pod's master key, over the plaintext, binding
namespace, key, length, device UUID, payload offset and sequence number). Anything else is
a miss, never bytes: a pointer made stale by reuse (the slab reassigned: its header table
zeroed, or another record in the slot, or another slot size) fails one of those checks,
and a record written, copied or patched by anyone without the master key (the device is
written by every node of the pod and reachable by its storage target: it is trusted for
nothing) fails the last; so does a record of format version 1, which has no
authenticator. Only verified bytes are returned (the ``RemoteSource`` contract).

Every fetch is bounded by ``timeout_s``: a slow or failed device degrades to misses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import mmap
import os
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ctxmem_common.codecs import XtsCipher, crc32c, xts_tweak
from ctxmem_common.codecs.blockauth import BlockAuthenticator
from ctxmem_common.flash_format import (
    DATA_START,
    SECTOR,
    FlashReader,
    RecordHeader,
    SlabHeader,
    Superblock,
    header_offset,
    record_context,
    slab_base,
    slots_per_slab,
)
from ctxmem_dpu.keyring import Keyring
from ctxmem_dpu.pod.entries import RemoteEntry, SharedLocation
from ctxmem_dpu.pod.sources import RemoteSource

log = logging.getLogger(__name__)


# Records of adjacent slots are read in runs: at most HEADER_RUN header-table entries and
# RUN_BYTES of payload (or one slot, when a slot is larger) per device read.
HEADER_RUN = 256
RUN_BYTES = 1 << 20


class _Staging(threading.local):
    """Per-thread page-aligned buffers (O_DIRECT): a header sector, a header-table run,
    a payload run."""

    def __init__(self) -> None:
        self.header = mmap.mmap(-1, SECTOR)
        self.table = mmap.mmap(-1, SECTOR)
        self.payload = mmap.mmap(-1, RUN_BYTES)

    def table_buf(self, n: int) -> mmap.mmap:
        if len(self.table) < n:
            self.table = mmap.mmap(-1, n)
        return self.table

    def payload_buf(self, n: int) -> mmap.mmap:
        if len(self.payload) < n:
            self.payload = mmap.mmap(-1, n)
        return self.payload


_staging = _Staging()


class Stale(Exception):
    """The record at a location is not the one the index names (a miss)."""


class Unauthentic(Stale):
    """The record's authenticator does not verify (a miss, counted as ``unauthenticated``)."""


@dataclass(frozen=True, slots=True)
class _Job:
    loc: SharedLocation
    entry: RemoteEntry
    key: bytes | None
    cipher: XtsCipher | None
    auth: BlockAuthenticator


class _SharedDevice:
    """One shared device, open read-only, and its slab headers as last read."""

    def __init__(self, path: str, o_direct: bool) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if o_direct else 0))
        try:
            sb = FlashReader(self.fd).superblocks().current
            if sb is None:
                raise OSError(f"shared flash {path}: no valid superblock (not formatted?)")
        except BaseException:
            os.close(self.fd)
            raise
        self.sb: Superblock = sb
        self.reader = FlashReader(self.fd)
        self._slabs: dict[int, SlabHeader] = {}

    def slab(self, slab: int, fresh: bool) -> SlabHeader | None:
        h = None if fresh else self._slabs.get(slab)
        if h is None:
            h = self.reader.slab_header(slab, self.sb.slab_size)
            if h is None:
                self._slabs.pop(slab, None)
                return None
            self._slabs[slab] = h
        return h

    def read(self, job: _Job, ns: bytes) -> bytes:
        """The block at ``job.loc`` after every check; raises Stale or OSError."""
        try:
            return self._read(job, ns, fresh=False)
        except Stale:
            return self._read(job, ns, fresh=True)  # the slab may have been reassigned

    def _locate(self, loc: SharedLocation, fresh: bool) -> tuple[int, int, int]:
        """(slab, slot index, slot size) of a payload offset, from the slab's header."""
        size = self.sb.slab_size
        slab = (loc.offset - DATA_START) // size
        if loc.offset < DATA_START or slab >= self.sb.num_slabs:
            raise Stale(f"offset {loc.offset} is outside the device's slabs")
        h = self.slab(slab, fresh)
        if h is None:
            raise Stale(f"slab {slab} has no valid header")
        slot_size = h.slot_size
        area = slab_base(slab, size) + SECTOR + slots_per_slab(size, slot_size) * SECTOR
        index, rem = divmod(loc.offset - area, slot_size)
        if rem or not 0 <= index < h.slots or loc.length > slot_size:
            raise Stale(f"offset {loc.offset} is not a slot of slab {slab} ({slot_size}-byte "
                        f"slots)")
        return slab, index, slot_size

    def _read(self, job: _Job, ns: bytes, fresh: bool) -> bytes:
        slab, index, slot_size = self._locate(job.loc, fresh)
        hbuf = _staging.header
        if os.preadv(self.fd, [hbuf], header_offset(slab, index, self.sb.slab_size)) != SECTOR:
            raise OSError(f"shared flash {self.path}: short header read")
        buf = _staging.payload_buf(slot_size)
        view = memoryview(buf)[:slot_size]
        try:
            if os.preadv(self.fd, [view], job.loc.offset) != slot_size:
                raise OSError(f"shared flash {self.path}: short payload read")
            return self._decode(job, ns, memoryview(hbuf), view, f"slab {slab} slot {index}")
        finally:
            view.release()

    def _decode(self, job: _Job, ns: bytes, hdr_raw: memoryview, payload: memoryview,
                where: str) -> bytes:
        """Check a record's header against the entry, decrypt and CRC-check its payload
        (``payload``: the whole slot as read); raises Stale."""
        loc, e, c = job.loc, job.entry, job.cipher
        hdr = RecordHeader.unpack(hdr_raw)
        if (hdr is None or hdr.namespace != ns or (job.key is not None and hdr.key != job.key)
                or hdr.seq != e.seq or hdr.length != e.nbytes or hdr.length != loc.length
                or hdr.crc != e.crc32c or hdr.encrypted != (c is not None)
                or (c is not None and hdr.key_check and hdr.key_check != c.check_value)):
            raise Stale(f"record header at {where} is not the indexed block")
        if c is None:
            out = bytes(payload[: loc.length])
        else:
            plain = bytearray(len(payload))
            c.decrypt_into(payload, plain, xts_tweak(self.sb.tweak_id, loc.offset))
            del plain[loc.length:]
            out = plain  # type: ignore[assignment]  # bytes-like, no second copy
        if crc32c(out) != e.crc32c:
            raise Stale(f"payload CRC32C mismatch at {where}")
        if not job.auth.verify(hdr.key, out, hdr.tag,
                               record_context(self.sb.device_uuid, loc.offset, hdr.seq)):
            raise Unauthentic(f"record at {where} of {self.path}: its authenticator does not "
                              f"verify (not made with the pod's master key for this key, "
                              f"place and sequence number)")
        return out

    def read_many(self, jobs: list[_Job], ns: bytes) -> list[bytes | str]:
        """:meth:`read` of each job; the records of adjacent slots of one slab (the order a
        node's demotion writes them) are read with one header-table read and one payload
        read per run (at most RUN_BYTES of payload, HEADER_RUN headers). Per job, the
        block or why it is a miss (a counter name)."""
        out: list[bytes | str] = ["stale"] * len(jobs)
        located: list[tuple[int, int, int, int]] = []  # slab, index, slot size, job
        retry: list[int] = []
        for i, job in enumerate(jobs):
            try:
                located.append((*self._locate(job.loc, fresh=False), i))
            except Stale:
                retry.append(i)
        located.sort()
        k = 0
        while k < len(located):
            slab, first, size, _i = located[k]
            cap = max(1, min(HEADER_RUN, RUN_BYTES // size))
            j = k + 1
            while (j < len(located) and j - k < cap and located[j][0] == slab
                   and located[j][1] == first + (j - k)):
                j += 1
            run = located[k:j]
            try:
                self._read_run(jobs, ns, run, out, retry)
            except OSError as exc:
                log.warning("shared flash %s: read failed (%s); misses", self.path, exc)
                for *_r, i in run:
                    out[i] = "io_errors"
            k = j
        for i in retry:  # not where the cached slab header says: read it again
            try:
                out[i] = self._read(jobs[i], ns, fresh=True)
            except Unauthentic as exc:
                log.warning("shared flash: a miss: %s", exc)
                out[i] = "unauthenticated"
            except Stale as exc:
                log.debug("shared flash: miss: %s", exc)
            except (OSError, ValueError) as exc:
                log.warning("shared flash %s: read failed (%s); a miss", self.path, exc)
                out[i] = "io_errors"
        return out

    def _read_run(self, jobs: list[_Job], ns: bytes, run: list[tuple[int, int, int, int]],
                  out: list[bytes | str], retry: list[int]) -> None:
        slab, first, size, _i = run[0]
        n = len(run)
        hdrs = memoryview(_staging.table_buf(n * SECTOR))[: n * SECTOR]
        pays = memoryview(_staging.payload_buf(n * size))[: n * size]
        try:
            if os.preadv(self.fd, [hdrs], header_offset(slab, first, self.sb.slab_size)
                         ) != n * SECTOR or os.preadv(self.fd, [pays], jobs[run[0][3]].loc.offset
                                                      ) != n * size:
                raise OSError(f"shared flash {self.path}: short read in slab {slab}")
            for m, (_s, index, _z, i) in enumerate(run):
                try:
                    out[i] = self._decode(jobs[i], ns, hdrs[m * SECTOR:(m + 1) * SECTOR],
                                          pays[m * size:(m + 1) * size],
                                          f"slab {slab} slot {index}")
                except Stale:
                    retry.append(i)
        finally:
            hdrs.release()
            pays.release()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SharedFlashSource(RemoteSource):
    """Reads blocks of any node from the pod's shared flash devices (module docstring).

    ``paths``: where this node sees each shared device (the UUID in its superblock names
    it); ``master_key``: the pod's master key, which keys the records' authenticators
    (``None``: none configured, the public fallback key of
    :class:`~ctxmem_dpu.keyring.Keyring`); ``encrypt``: whether records are
    encrypted (``encryption.enabled``; never without a master key); ``threads``: reads in
    flight; ``timeout_s``: the bound on one fetch. Open on construction; :meth:`close`
    (or ``with``) releases the descriptors and threads."""

    #: Every block it returns passed its record's authenticator (and CRC32C) under the
    #: master key: the fetch path may adopt it (pod/fetch.py, ``RemoteSource.verifies``).
    verifies = True

    def __init__(self, paths: Sequence[str], master_key: bytes | None, *,
                 encrypt: bool = True, o_direct: bool = True, threads: int = 4,
                 timeout_s: float = 2.0) -> None:
        self.name = "shared_flash"
        self._devices: dict[str, _SharedDevice] = {}
        try:
            for p in paths:
                dev = _SharedDevice(p, o_direct)
                self._devices[dev.sb.device_uuid.hex()] = dev
        except BaseException:
            self.shutdown()
            raise
        self._keyring = Keyring(master_key, encrypt=encrypt)
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, threads),
                                                           thread_name_prefix="ctxmem-shared")
        self._threads = max(1, threads)
        self.timeout_s = timeout_s
        #: hits, stale (header or CRC did not match: reuse, foreign, damaged),
        #: unauthenticated (the authenticator did not verify), io_errors, unknown_device,
        #: timeouts.
        self.counters: Counter[str] = Counter()

    @property
    def device_uuids(self) -> list[str]:
        return sorted(self._devices)

    async def fetch(self, ns_digest: bytes, entries: Sequence[RemoteEntry],
                    keys: Sequence[bytes] | None = None) -> list[bytes | None]:
        """The blocks of ``entries`` (``None``: a miss). ``keys``, when given, are checked
        against the record headers too (the index's entries do not carry them)."""
        out: list[bytes | None] = [None] * len(entries)
        jobs: list[tuple[int, _SharedDevice, _Job]] = []
        cipher = self._keyring.cipher(ns_digest)
        auth = self._keyring.authenticator(ns_digest)
        for i, e in enumerate(entries):
            loc = e.shared
            dev = self._devices.get(loc.device_uuid) if loc is not None else None
            if loc is None or dev is None:
                self.counters["unknown_device"] += 1
                continue
            key = keys[i] if keys is not None else (e.key or None)
            jobs.append((i, dev, _Job(loc, e, key, cipher, auth)))
        if not jobs:
            return out
        # Contiguous parts in device order, so adjacent records share a read (read_many).
        jobs.sort(key=lambda j: (j[1].sb.device_uuid, j[2].loc.offset))
        n = min(self._threads, len(jobs))
        size = -(-len(jobs) // n)
        parts = [jobs[k:k + size] for k in range(0, len(jobs), size)]
        loop = asyncio.get_running_loop()
        try:
            done = await asyncio.wait_for(asyncio.gather(*(
                loop.run_in_executor(self._pool, self._work, ns_digest, part)
                for part in parts)), self.timeout_s)
        except TimeoutError:
            self.counters["timeouts"] += 1
            log.warning("shared flash: a fetch of %d blocks took over %g s; served as misses",
                        len(jobs), self.timeout_s)
            return out
        for part, results in zip(parts, done, strict=True):
            for (i, _d, _j), got in zip(part, results, strict=True):
                if isinstance(got, str):
                    self.counters[got] += 1  # counted here, on the loop: no lock
                else:
                    self.counters["hits"] += 1
                    out[i] = got
        return out

    @staticmethod
    def _work(ns: bytes, part: list[tuple[int, _SharedDevice, _Job]]) -> list[bytes | str]:
        """On a read thread: per job, the block or why it is a miss (a counter name)."""
        res: list[bytes | str] = []
        k = 0
        while k < len(part):
            dev = part[k][1]
            j = k
            while j < len(part) and part[j][1] is dev:
                j += 1
            res += dev.read_many([job for _i, _d, job in part[k:j]], ns)
            k = j
        return res

    def accepts(self, entry: RemoteEntry) -> bool:
        """Entries on a shared device this node has attached (no I/O)."""
        return entry.shared is not None and entry.shared.device_uuid in self._devices

    async def close(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Close every device and stop the threads (idempotent)."""
        for dev in self._devices.values():
            dev.close()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)

    def __enter__(self) -> SharedFlashSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
