"""Staging memory owned by the service, and the put that copies from it (issue 27 item 1).

Why: a put through the slabs crosses memory twice (the client copies into the slot, then
the service CRCs the slot at Commit) and needs the client to write the service's slabs.
Here the service creates the memory a client fills (its offload buffer), and a put is
one STAGE_PUT naming (offset, length, CRC32C) per block: the service copies each block
into its DRAM slot with the CRC32C computed in the same pass
(:func:`~ctxmem_common.codecs.copy_crc32c_between`), so the stored bytes are exactly
the bytes whose CRC it computed, whatever the client writes meanwhile.

The trust surface (docs/security.md, "Staging regions"), each case tested in
tests/adversary/test_staging.py:

* a region is a memfd sealed ``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`` before its fd
  leaves the service, and the service maps it itself: a client's ftruncate fails with
  EPERM, and its munmap or close leaves the service's mapping intact;
* a region belongs to the session that created it: another session's (or tenant's)
  region id is refused as unknown, with the same message as an id never issued;
* every (offset, length) is checked against the region, its header and the namespace's
  block size before any copy: one bad entry refuses the whole put, nothing stored;
* a block whose copied bytes do not have the declared CRC32C is not stored (counted in
  ``put_crc_mismatch``, answered :data:`~ctxmem_common.staging_wire.REFUSED_CRC`);
* regions count in the tenant's quota (``quotas.*.staging_max_bytes``, at most
  :data:`MAX_REGIONS_PER_SESSION` per session) and the service's
  (``service.staging_max_bytes``), and are freed with their session (Client.close, or
  the reaper) or by STAGE_FREE; a region being copied from is unmapped only once its copy
  is done.

The memory is plain shared memory here. The same regions can be registered with CUDA
(``cudaHostRegister``) so a GPU's copy lands in them directly; that side is not built yet.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import fcntl
import itertools
import logging
import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ctxmem_common.codecs import copy_crc32c_between
from ctxmem_common.errors import InvalidArgument, ResourceExhausted, UnknownSession
from ctxmem_common.staging_wire import (
    EXISTING,
    HEADER_BYTES,
    REFUSED_CRC,
    STORED,
    Created,
    pack_header,
)
from ctxmem_dpu.store.slotcrc import crc_threads
from ctxmem_dpu.tiers.dram import SLAB_SEALS, round_up

if TYPE_CHECKING:
    from ctxmem_common.config import Config
    from ctxmem_dpu.alloc import SlotRef
    from ctxmem_dpu.blocks import Session
    from ctxmem_dpu.tiers.dram import DramTier

__all__ = ["MAX_REGIONS_PER_SESSION", "StagingRegion", "StagingRegions"]

log = logging.getLogger("ctxmem_dpu.store")

MAX_REGIONS_PER_SESSION = 64
"""Regions one session may hold at once (each is an fd and a mapping in the service)."""
HUGE_PAGE = 2 << 20
COUNTERS = ("staging_regions_created", "staging_regions_freed", "staging_refused",
            "staging_put_blocks", "staging_put_bytes")


@dataclass(eq=False)
class StagingRegion:
    """One region: its memfd and the service's own mapping (kept until the region is
    freed and no copy reads it)."""

    id: int
    session_id: bytes
    tenant: str
    size: int
    hugepages: bool
    fd: int
    mm: mmap.mmap
    view: memoryview
    busy: int = 0  # copies reading it now
    freed: bool = False

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):
            self.mm.close()
        os.close(self.fd)


def _memfd(name: str, size: int, huge: bool) -> tuple[int, mmap.mmap]:
    """A sealed memfd of ``size`` bytes and the service's mapping of it (populated: a
    hugetlb mapping reserves its pages here, or fails here with ENOMEM)."""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if huge else 0)
    fd = os.memfd_create(name, flags)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SLAB_SEALS)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE,
                       mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd, mm


def _make(rid: int, nbytes: int, huge: bool) -> tuple[int, mmap.mmap, bool]:
    """A region's memory (a staging thread): (fd, the service's mapping with the header
    written, whether on huge pages). Huge pages fall back to normal ones."""
    name = f"ctxmem-stage-{rid}"
    if huge:
        try:
            fd, mm = _memfd(name, round_up(HEADER_BYTES + nbytes, HUGE_PAGE), True)
        except OSError as exc:
            # No huge pages to back it (an empty pool answers ENOMEM at the mapping, a
            # kernel without hugetlb EINVAL): normal pages.
            log.info("staging region %d: no huge pages (%s); normal pages", rid,
                     errno.errorcode.get(exc.errno or 0, exc.errno))
            huge = False
    if not huge:
        fd, mm = _memfd(name, round_up(HEADER_BYTES + nbytes, mmap.PAGESIZE), False)
    mm[:HEADER_BYTES] = pack_header(rid, int(huge), len(mm)).ljust(HEADER_BYTES, b"\0")
    return fd, mm, huge


class StagingRegions:
    """Every staging region of the service, by id, and the staged put's copy."""

    def __init__(self, cfg: Config, dram: DramTier, counters: dict[str, int]) -> None:
        self._cfg = cfg
        self._dram = dram
        self._counters = counters
        for name in COUNTERS:
            counters.setdefault(name, 0)
        self._ids = itertools.count(1)
        self.regions: dict[int, StagingRegion] = {}
        # Regions being made (their memory is faulted in on a staging thread, not on the
        # event loop): id -> (session id, tenant, bytes), counted as held meanwhile.
        self._pending: dict[int, tuple[bytes, str, int]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=crc_threads(cfg.service.commit_crc_threads),
            thread_name_prefix="ctxmem-stage")

    # -- lifetime -------------------------------------------------------------------
    def bytes_held(self, tenant: str | None = None) -> int:
        """Bytes of the regions ``tenant`` (None: every tenant) holds or is being given."""
        held = [(r.tenant, r.size) for r in self.regions.values()]
        held += [(t, n) for _sid, t, n in self._pending.values()]
        return sum(n for t, n in held if tenant is None or t == tenant)

    def _refuse(self, s: Session, what: str, message: str) -> ResourceExhausted:
        self._counters["staging_refused"] += 1
        self._counters["quota_refusals"] = self._counters.get("quota_refusals", 0) + 1
        return ResourceExhausted(f"tenant {s.tenant!r}: quota {what}: {message}")

    async def create(self, s: Session, nbytes: int, tenant_max: int) -> StagingRegion:
        """A new region of at least ``nbytes`` data bytes for session ``s`` (after its
        header), counted against ``tenant_max`` bytes of the tenant and
        ``service.staging_max_bytes``; ResourceExhausted past either. Its memory is made
        and faulted in on a staging thread (a 256 MiB region is tens of ms of zeroing)."""
        cfg = self._cfg.service
        if cfg.staging_max_bytes == 0:
            raise InvalidArgument("staging regions are off on this service "
                                  "(service.staging_max_bytes: 0); put through the slabs")
        if nbytes < 1:
            raise InvalidArgument(f"a staging region of {nbytes} bytes; ask for at least 1")
        mine = sum(1 for r in self.regions.values() if r.session_id == s.id) + sum(
            1 for sid, _t, _n in self._pending.values() if sid == s.id)
        if mine >= MAX_REGIONS_PER_SESSION:
            raise self._refuse(s, "staging regions",
                               f"session {s.id.hex()} holds {mine} staging regions, limit "
                               f"{MAX_REGIONS_PER_SESSION}; free some (StagingRegion.close) "
                               f"or make fewer, larger ones")
        huge = cfg.staging_hugepages
        size = round_up(HEADER_BYTES + nbytes, HUGE_PAGE if huge else mmap.PAGESIZE)
        held = self.bytes_held(s.tenant)
        if held + size > tenant_max:
            raise self._refuse(s, "staging_max_bytes",
                               f"a staging region of {size} bytes on top of the {held} "
                               f"bytes its sessions hold exceeds {tenant_max}; free regions "
                               f"(StagingRegion.close, Client.close) or raise "
                               f"quotas.*.staging_max_bytes")
        total = self.bytes_held()
        if total + size > cfg.staging_max_bytes:
            raise self._refuse(s, "service staging_max_bytes",
                               f"a staging region of {size} bytes on top of the {total} "
                               f"bytes all tenants hold exceeds service.staging_max_bytes="
                               f"{cfg.staging_max_bytes}; retry later or raise it")
        rid = next(self._ids)
        self._pending[rid] = (s.id, s.tenant, size)
        loop = asyncio.get_running_loop()
        try:
            fd, mm, huge = await loop.run_in_executor(self._pool, _make, rid, nbytes, huge)
        except OSError as exc:
            raise ResourceExhausted(
                f"staging region of {size} bytes for tenant {s.tenant!r}: memfd failed: "
                f"{exc.strerror} (errno {exc.errno}); the host is out of memory or fds"
            ) from None
        finally:
            del self._pending[rid]
        view = memoryview(mm)
        r = StagingRegion(rid, s.id, s.tenant, len(mm), huge, fd, mm, view)
        if s.ending:  # the session ended while its memory was made
            r.close()
            raise UnknownSession(f"session {s.id.hex()} ended while staging region {rid} "
                                 f"was made; reconnect")
        self.regions[rid] = r
        self._counters["staging_regions_created"] += 1
        return r

    def created(self, r: StagingRegion) -> Created:
        return Created(r.id, r.hugepages, r.size, HEADER_BYTES)

    def region(self, s: Session, region_id: int) -> StagingRegion:
        """Session ``s``'s region ``region_id``; another session's, a freed one or an id
        never issued is refused alike (nothing says which)."""
        r = self.regions.get(region_id)
        if r is None or r.session_id != s.id or r.freed:
            raise InvalidArgument(
                f"staging region {region_id} is not a region of session {s.id.hex()} "
                f"(freed, never created, or another session's); create one with "
                f"Client.staging() and use it in the session (Client, tenant) that "
                f"created it")
        return r

    def free(self, s: Session, region_id: int) -> None:
        self._free(self.region(s, region_id))

    def _free(self, r: StagingRegion) -> None:
        r.freed = True
        self.regions.pop(r.id, None)
        self._counters["staging_regions_freed"] += 1
        if r.busy == 0:
            r.close()

    def session_ended(self, s: Session) -> None:
        """Free every region of ``s`` (the store's ``on_session_end`` hook)."""
        for r in [r for r in self.regions.values() if r.session_id == s.id]:
            self._free(r)

    @contextlib.contextmanager
    def using(self, r: StagingRegion) -> Iterator[None]:
        """While a put reads ``r`` (from its checks to its copy's end): a STAGE_FREE or
        the session's end meanwhile frees it, but unmaps it only once this ends."""
        r.busy += 1
        try:
            yield
        finally:
            r.busy -= 1
            if r.freed and r.busy == 0:
                r.close()

    def close(self) -> None:
        for r in list(self.regions.values()):
            self._free(r)
        self._pool.shutdown(wait=True)

    # -- the put's checks and copy --------------------------------------------------
    def check_entries(self, r: StagingRegion, offsets: np.ndarray, lengths: np.ndarray,
                      block_nbytes: int) -> None:
        """Every entry a whole block inside ``r``'s data (past its header): one numpy
        pass; the first bad entry is named."""
        if not len(offsets):
            return
        bad_len = lengths != np.uint64(block_nbytes)
        ends = offsets + lengths  # uint64: a wrap lands below the offset
        outside = (offsets < np.uint64(HEADER_BYTES)) | (ends > np.uint64(r.size)) \
            | (ends < offsets)
        wrong = bad_len | outside
        if wrong.any():
            i = int(np.flatnonzero(wrong)[0])
            o, n = int(offsets[i]), int(lengths[i])
            if bad_len[i]:
                why = f"is {n} bytes; this namespace's blocks are {block_nbytes}"
            elif o < HEADER_BYTES:
                why = (f"overlaps the region's {HEADER_BYTES}-byte header; blocks start at "
                       f"offset {HEADER_BYTES} or later")
            else:
                why = f"lies outside the region's {r.size} bytes"
            raise InvalidArgument(
                f"staged put from region {r.id}: entry {i} [{o}, {o} + {n}) {why}; nothing "
                f"was stored (offsets are from the region's first byte: "
                f"StagingRegion.data starts at {HEADER_BYTES})")

    async def copy(self, r: StagingRegion, offsets: Sequence[int], refs: Sequence[SlotRef],
                   nbytes: int) -> list[int]:
        """Copy each ``r[offsets[i]:+nbytes]`` into slot ``refs[i]`` and return each
        block's CRC32C of the bytes stored (fused; without the native helper, the slots'
        CRC after the copy), on the staging threads, one call per slab. The slots must
        stay allocated until this returns; ``r`` stays mapped (``busy``)."""
        if not refs:
            return []
        groups: dict[int, tuple[list[int], list[int], list[int]]] = {}
        for pos, ((slab, index), off) in enumerate(zip(refs, offsets, strict=True)):
            g = groups.setdefault(slab, ([], [], []))
            g[0].append(pos)
            g[1].append(index * self._dram.alloc.slabs[slab].slot_size)
            g[2].append(off)
        loop = asyncio.get_running_loop()
        with self.using(r):
            futs = [loop.run_in_executor(self._pool, _copy_part, r.view,
                                         self._dram.regions[slab].view, src, dst, nbytes)
                    for slab, (_pos, dst, src) in groups.items()]
            parts: list[list[int]] = await asyncio.gather(*futs)
        crcs = [0] * len(refs)
        for (positions, _d, _s), part in zip(groups.values(), parts, strict=True):
            for p, c in zip(positions, part, strict=True):
                crcs[p] = c
        self._counters["staging_put_blocks"] += len(refs)
        self._counters["staging_put_bytes"] += len(refs) * nbytes
        return crcs


def _copy_part(src: memoryview, dst: memoryview, src_offsets: list[int],
               dst_offsets: list[int], nbytes: int) -> list[int]:
    """One slab's blocks (a staging thread): each copied from the region into its slot,
    its CRC32C of the words as stored (fused; without the native helper, the slot's CRC
    after the copy), in one call."""
    return copy_crc32c_between(src, src_offsets, dst, dst_offsets, nbytes)


def outcomes(exists: Sequence[bool], new_crcs: Sequence[int],
             declared: np.ndarray | None) -> np.ndarray:
    """Per key: EXISTING, REFUSED_CRC (the copied bytes' CRC differs from the declared
    one) or STORED."""
    out = np.full(len(exists), STORED, np.uint8)
    ex = np.fromiter(exists, bool, len(exists))
    out[ex] = EXISTING
    if declared is not None and len(new_crcs):
        new = np.flatnonzero(~ex)
        bad = declared[new] != np.asarray(new_crcs, np.uint32)
        out[new[bad]] = REFUSED_CRC
    return out
