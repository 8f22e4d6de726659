"""Shared-memory channel: map the service's slab memfds and copy with one memcpy per block.

Regions are mapped on first use and cached by ``(region, generation)``; a slot naming a
newer generation means the slab was recycled, so the old mapping is dropped and the new
memfd fetched. An unverified write or read is a memoryview slice assignment: a single C
``memcpy``. A put's write (:meth:`ShmChannel.write_crc`) and a verified read (the default
get) copy each block with :func:`~ctxmem_common.codecs.copy_crc32c`, the copy and its
CRC32C in one pass; a read whose CRC differs from the committed one scrubs the buffer and
stops (:mod:`ctxmem.transport.verified`): another client that still maps the slab cannot
make a get return bytes that were not committed.

With ``ops`` (the service's Health says ``shm_ops``, and ``CTXMEM_FAST_OPS`` is not 0)
the same socket also carries the control fast path (:meth:`ShmChannel.call`: Acquire,
Release, Lookup, Allocate, Commit as binary frames, :mod:`ctxmem_common.shm_ops`), one
request and its reply under the channel's lock. A MAP is only ever sent inside a read or
a write, under that lock, and waits for its own reply, so when an op is sent no MAP
reply is outstanding and the next reply on the socket is the op's (the service answers
in request order; a RELEASE flagged no-reply has none). A socket error or a reply that
does not match its request breaks the channel: this call and every later one raise
Unavailable, which reconnects (``Namespace._retrying``).
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

import numpy as np

from ctxmem.transport.base import DataChannel, Grant, TransportError, op_answer
from ctxmem.transport.base import FastPathUnsupported as FastPathUnsupported  # its old home
from ctxmem.transport.verified import ReadProgress, copy_checked, scrub
from ctxmem_common.codecs import (
    CRC32C_FUSED,
    copy_crc32c,
    copy_crc32c_from_slots,
    copy_crc32c_to_slots,
)
from ctxmem_common.errors import CtxmemError, Unavailable
from ctxmem_common.packed_slots import PackedSlots
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.wire import (
    SHM_HELLO,
    SHM_MAP,
    SHM_MAP_REPLY,
    SHM_OP,
    SHM_OP_NAMES,
    SHM_OP_REPLY,
    SHM_STATUS,
    STATUS_TEXT,
    Status,
)

_MAX_REPLY_BYTES = 256 << 20  # far above any legal answer: a larger one is a broken peer
#: A batch's copy is split across ``copy_threads`` only from this many bytes: below it the
#: hand-off to a pool thread costs more than the second thread gains (docs/benchmarks.md).
COPY_THREADS_MIN_BYTES = 16 << 20
T = TypeVar("T")
_Run = tuple[int, int, memoryview]  # (first slot, end, the region the slots lie in)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise TransportError("shared-memory socket closed by the service")
        buf += chunk
    return bytes(buf)


def _recv_body(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes, received in place (a large answer is not grown chunk by
    chunk)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise TransportError("shared-memory socket closed by the service")
        got += k
    return bytes(buf)


class ShmChannel(DataChannel):
    name = "shm"
    where = "shared-memory"
    packed_slots = True  # a get reads Acquire's packed answer (read_packed)
    maps_slots = True  # the copy reads the mapped slab: nothing checks the lease meanwhile

    def __init__(self, path: str, session_id: bytes, token: bytes, timeout_s: float,
                 ops: bool = False, copy_threads: int = 1) -> None:
        self.path = self.endpoint = path
        self.ops = ops  # the control fast path may be used (call)
        self.copy_threads = max(1, copy_threads)
        self._timeout_s = timeout_s
        self._pool: ThreadPoolExecutor | None = None  # copy_threads - 1 workers, on first use
        self._broken = ""  # why the channel is unusable ("" while it is fine)
        # Frames sent flagged no-reply since the last answered call: close() waits for one
        # answered call first, so what they did (a verified get's Release) has happened
        # when close returns (the service serves a connection's frames in order).
        self.unanswered = False
        self._lock = threading.Lock()
        self._maps: dict[int, tuple[int, mmap.mmap, memoryview]] = {}
        try:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.settimeout(timeout_s)
            self._sock.connect(path)
            self._sock.sendall(SHM_HELLO.pack(b"CXS1", session_id, token))
            _magic, status = SHM_STATUS.unpack(_recv_exact(self._sock, SHM_STATUS.size))
        except OSError as exc:
            raise TransportError(
                f"cannot open the shared-memory channel at {path}: {exc.strerror or exc}; is "
                f"the service on this host, and may this user open its socket?"
            ) from None
        if status != Status.OK:
            self._sock.close()
            raise TransportError(f"shared-memory channel refused: {STATUS_TEXT[Status(status)]}")

    def call(self, op: int, parts: Sequence[bytes], reply: bool = True,
             meanwhile: Callable[[], None] | None = None) -> bytes:
        """Send fast-path op ``op`` with body ``parts`` and return its reply body (b""
        with ``reply`` False: nothing is read). Raises the service's error as the same
        CtxmemError class as over gRPC, FastPathUnsupported, or Unavailable when the
        socket fails or the reply does not match (the channel is then broken)."""
        return self._fast_call(op, parts, reply, meanwhile)

    def call_with_fd(self, op: int, parts: Sequence[bytes]) -> tuple[bytes, int]:
        """:meth:`call` for an op whose OK answer carries one fd with its header
        (SCM_RIGHTS: a staging region's memfd, :mod:`ctxmem.staging`): (body, fd), the
        caller owning the fd. Raises as :meth:`call` does (an fd that came with an error
        answer is closed)."""
        name = SHM_OP_NAMES[op]
        fds: list[int] = []
        with self._lock:
            if self._broken:
                raise Unavailable(f"{self.where} data channel {self.endpoint} is broken "
                                  f"({self._broken}); reconnecting")
            try:
                self._send_op(op, parts)
                self.unanswered = False
                msg, fds, _flags, _addr = socket.recv_fds(self._sock, SHM_OP_REPLY.size, 1)
                if not msg:
                    raise TransportError("shared-memory socket closed by the service")
                msg += _recv_exact(self._sock, SHM_OP_REPLY.size - len(msg))
                magic, status, got_op, length = SHM_OP_REPLY.unpack(msg)
                if magic != b"CXSP" or got_op != op or length > _MAX_REPLY_BYTES:
                    raise TransportError(f"reply {magic!r} op {got_op} of {length} bytes "
                                         f"does not answer {name}")
                body = _recv_body(self._sock, length)
                if status == Status.BAD_REQUEST:
                    raise TransportError(f"the service refused {name} as malformed")
            except (OSError, TransportError) as exc:
                for fd in fds:
                    os.close(fd)
                self._broken = f"{name}: {exc}"
                raise Unavailable(f"{self.where} fast path {name} on {self.endpoint} "
                                  f"failed: {exc}; reconnecting") from None
        try:
            out = op_answer(self.where, name, status, body)
            if len(fds) != 1:
                raise TransportError(f"{name} answered OK with {len(fds)} fds (one "
                                     f"expected); report it")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return out, fds[0]

    def _send_op(self, op: int, parts: Sequence[bytes]) -> None:
        self._sock.sendall(SHM_OP.pack(b"CXSO", op, sum(map(len, parts))))
        for part in parts:
            self._sock.sendall(part)

    def _read_answer(self, op: int, name: str) -> tuple[int, bytes]:
        magic, status, got_op, length = SHM_OP_REPLY.unpack(
            _recv_exact(self._sock, SHM_OP_REPLY.size))
        if magic != b"CXSP" or got_op != op or length > _MAX_REPLY_BYTES:
            raise TransportError(f"reply {magic!r} op {got_op} of {length} bytes "
                                 f"does not answer {name}")
        return status, _recv_body(self._sock, length)

    def _write_grant(self, grant: Grant, views: Sequence[memoryview]) -> list[int]:
        """Packed slots (a fast-path Allocate): :meth:`write_packed`; a gRPC answer's
        ``pb.Slot`` messages: :meth:`write_crc`."""
        if isinstance(grant.slots, PackedSlots):
            return self.write_packed(grant.slots, views)
        return self.write_crc(grant.id, grant.slots, views)

    def _read_grant(self, grant: Grant, views: Sequence[memoryview], verify: bool,
                    progress: ReadProgress) -> None:
        """Packed slots (a fast-path or packed Acquire): :meth:`read_packed`; ``pb.Slot``
        messages (a block group's Acquire): :meth:`read_verified` or :meth:`read`."""
        if isinstance(grant.slots, PackedSlots):
            self.read_packed(grant.id, grant.slots, views, verify, progress)
            return
        n = len(views)
        if verify:
            self.read_verified(grant.id, grant.slots[:n], views, grant.crcs[:n], progress)
        else:
            self.read(grant.id, grant.slots[:n], views)

    def write_packed(self, slots: PackedSlots, views: Sequence[memoryview]) -> list[int]:
        """:meth:`write_crc` for a fast-path Allocate's slots (plain int lists): every
        slot's region mapped and its bounds checked first (TransportError, nothing
        copied), then one :func:`~ctxmem_common.codecs.copy_crc32c_to_slots` per run of
        slots in the same region: each view into its slot and its CRC32C (fused with the
        copy where the native helper is; else the view's, before the copy)."""
        offsets, lengths = slots.offsets, slots.lengths

        def part(pieces: list[_Run]) -> list[int]:
            out: list[int] = []
            for start, end, region in pieces:
                out += copy_crc32c_to_slots(views[start:end], region, offsets[start:end],
                                            lengths[start:end])
            return out

        with self._lock:
            parts = self._split(self._runs(slots, len(views), ""), lengths)
            if len(parts) == 1:
                return part(parts[0])
            futures = [self._pool_().submit(part, p) for p in parts[1:]]
            out = part(parts[0])
            for f in self._results(futures, "put"):
                out += f
            return out

    def _runs(self, slots: PackedSlots, n: int, lease: str) -> list[_Run]:
        """The first ``n`` slots as runs ``(start, end, region)`` of one mapped region
        each, every slot's ``offset + length`` checked against its region before any
        copy: a malformed answer raises TransportError, never reads or writes outside
        the mapping."""
        if n > len(slots):
            raise TransportError(f"{n} buffers for {len(slots)} slots{lease}; the service's "
                                 f"answer is malformed: report it")
        if n == 0:
            return []
        regions, gens, offsets, lengths = (a[:n] for a in slots.ndarrays())
        # Runs: where (region, generation) changes, in one numpy pass; each run's highest
        # end against its region's size, and no end that wrapped past 2**64 (it would
        # end below its offset; the lists' Python ints never wrapped).
        key = (regions.astype(np.uint64) << np.uint64(32)) | gens
        starts = np.flatnonzero(key[1:] != key[:-1]) + 1
        starts = np.concatenate(([0], starts))
        ends = offsets + lengths
        wrapped = ends < offsets
        any_wrapped = bool(wrapped.any())
        top_end = np.maximum.reduceat(ends, starts).tolist()
        cut: list[int] = starts.tolist()
        runs: list[_Run] = []
        for j, (start, end) in enumerate(zip(cut, [*cut[1:], n], strict=True)):
            region = self._region(int(regions[start]), int(gens[start]))
            size = region.nbytes
            if top_end[j] > size or (
                    any_wrapped and wrapped[start:end].any()):
                i = start + int(np.flatnonzero((ends[start:end] > size)
                                               | wrapped[start:end])[0])
                raise TransportError(
                    f"slot {i} [{int(offsets[i])}, {int(offsets[i]) + int(lengths[i])})"
                    f"{lease} lies outside region {int(regions[i])} ({size} bytes); the "
                    f"service's answer is malformed: report it")
            runs.append((start, end, region))
        return runs

    def _region(self, region: int, generation: int) -> memoryview:
        cached = self._maps.get(region)
        if cached is not None and cached[0] == generation:
            return cached[2]
        if cached is not None:
            self._drop(region)
        self._sock.sendall(SHM_MAP.pack(b"CXSM", region, generation))
        try:
            msg, fds, _flags, _addr = socket.recv_fds(self._sock, SHM_MAP_REPLY.size, 1)
        except OSError as exc:
            raise TransportError(f"shared-memory MAP of region {region} failed: {exc}") from None
        if len(msg) != SHM_MAP_REPLY.size:
            raise TransportError("shared-memory socket closed by the service")
        _m, status, gen, size = SHM_MAP_REPLY.unpack(msg)
        if status != Status.OK or not fds:
            for fd in fds:
                __import__("os").close(fd)
            raise TransportError(
                f"shared-memory MAP of region {region} generation {generation} refused: "
                f"{STATUS_TEXT.get(Status(status), status)}")
        try:
            # MAP_POPULATE: set up the page tables once instead of faulting per 4 KiB.
            mm = mmap.mmap(fds[0], size, mmap.MAP_SHARED | mmap.MAP_POPULATE,
                           mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            __import__("os").close(fds[0])
        view = memoryview(mm)
        self._maps[region] = (gen, mm, view)
        return view

    def _drop(self, region: int) -> None:
        _gen, mm, view = self._maps.pop(region)
        view.release()
        with contextlib.suppress(BufferError):
            mm.close()

    def write(self, allocation_id: bytes, slots: Sequence[pb.Slot],
              views: Sequence[memoryview]) -> None:
        with self._lock:
            for slot, src in zip(slots, views, strict=True):
                region = self._region(slot.region, slot.generation)
                region[slot.offset : slot.offset + slot.length] = src

    def write_crc(self, allocation_id: bytes, slots: Sequence[pb.Slot],
                  views: Sequence[memoryview]) -> list[int]:
        """Copy each view into its slot and CRC it in the same pass: the CRC32C Commit
        carries is of the very bytes stored in the slot (read from the view once). On the
        pure CRC32C path (no fused copy) the views are CRC'd first, then copied: a CRC of
        the slot after the copy could cover another mapper's bytes."""
        if not CRC32C_FUSED:
            return super().write_crc(allocation_id, slots, views)
        with self._lock:
            out = []
            for slot, src in zip(slots, views, strict=True):
                region = self._region(slot.region, slot.generation)
                out.append(copy_crc32c(src, region[slot.offset : slot.offset + slot.length]))
            return out

    def read(self, lease_id: bytes, slots: Sequence[pb.Slot],
             views: Sequence[memoryview]) -> None:
        with self._lock:
            for slot, dst in zip(slots, views, strict=True):
                region = self._region(slot.region, slot.generation)
                dst[:] = region[slot.offset : slot.offset + slot.length]

    def read_verified(self, lease_id: bytes, slots: Sequence[pb.Slot],
                      views: Sequence[memoryview], crcs: Sequence[int],
                      progress: ReadProgress) -> None:
        with self._lock:
            for i, (slot, dst, want) in enumerate(zip(slots, views, crcs, strict=True)):
                region = self._region(slot.region, slot.generation)
                if not copy_checked(region[slot.offset : slot.offset + slot.length], dst, want):
                    progress.bad = i
                    return
                progress.done = i + 1

    def read_packed(self, lease_id: bytes, slots: PackedSlots, views: Sequence[memoryview],
                    verify: bool, progress: ReadProgress) -> None:
        """A get's read from Acquire's packed answer (:mod:`ctxmem_common.packed_slots`):
        as :meth:`read_verified` (``verify``) or :meth:`read`. Every slot's region is
        mapped and its ``offset + length`` checked first: a malformed answer raises
        TransportError before any copy. Then one
        :func:`~ctxmem_common.codecs.copy_crc32c_from_slots` per run of slots in the same
        region (the GIL released once per run); with ``verify`` the first block that fails
        its CRC32C is zeroed and ends the read. ``progress.done`` counts the blocks
        delivered, also when this raises.

        A batch of at least :data:`COPY_THREADS_MIN_BYTES` with ``copy_threads`` > 1 is
        split into that many contiguous parts copied at once (this thread takes the
        first). Seen by the caller it is the same read: ``done`` is the first failed
        block's index, that buffer is zeroed, and so is every later buffer another part
        had already written (its blocks are not delivered): a buffer past ``done`` holds
        zeros or is untouched, never other bytes."""
        offsets, lengths = slots.offsets, slots.lengths
        crcs = slots.crcs if verify else None

        def part(pieces: list[_Run]) -> tuple[int, int | None]:
            """(first block of the part not delivered, failed block or None)."""
            end = pieces[0][0] if pieces else 0
            for start, end, region in pieces:
                done, bad = copy_crc32c_from_slots(
                    region, offsets[start:end], lengths[start:end], views[start:end],
                    None if crcs is None else crcs[start:end])
                if bad is not None:
                    return start + done, start + bad
            return end, None

        with self._lock:
            parts = self._split(self._runs(slots, len(views), f" of lease {lease_id.hex()}"),
                                lengths)
            if len(parts) == 1:
                progress.done, progress.bad = part(parts[0])
                return
            futures = [self._pool_().submit(part, p) for p in parts[1:]]
            results = [part(parts[0])]
            progress.done, progress.bad = results[0]
            try:
                results += self._results(futures, f"get of lease {lease_id.hex()}")
            finally:
                # Delivered: whole parts in order, up to the first failed block (or the
                # first part still running, if a wait timed out).
                for done, bad in results:
                    progress.done, progress.bad = done, bad
                    if bad is not None:
                        break
                if progress.bad is not None:  # later parts' blocks are not delivered
                    for p, (done, _bad) in zip(parts, results, strict=False):
                        if p[0][0] > progress.bad:
                            for i in range(p[0][0], done):
                                scrub(views[i])

    def _split(self, runs: list[_Run], lengths: list[int]) -> list[list[_Run]]:
        """``runs`` as ``copy_threads`` contiguous parts of about equal bytes (one part
        when the batch is under :data:`COPY_THREADS_MIN_BYTES`, or one thread)."""
        n = runs[-1][1] if runs else 0
        k = min(self.copy_threads, n)
        if k <= 1 or sum(lengths[:n]) < COPY_THREADS_MIN_BYTES:
            return [runs]
        cuts = [n * j // k for j in range(k + 1)]
        parts: list[list[_Run]] = []
        for lo, hi in itertools.pairwise(cuts):
            parts.append([(max(s, lo), min(e, hi), r) for s, e, r in runs if s < hi and e > lo])
        return parts

    def _pool_(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.copy_threads - 1,
                                            thread_name_prefix="ctxmem-shm-copy")
        return self._pool

    def _results(self, futures: list[Future[T]], what: str) -> list[T]:
        """The parts' results in order, each waited for until the channel's timeout; a
        part still copying then (a machine stalled that long) breaks the channel."""
        deadline = time.monotonic() + self._timeout_s
        out = []
        for f in futures:
            try:
                out.append(f.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                self._broken = f"a copy thread of a {what} still running after " \
                               f"{self._timeout_s} s"
                raise TransportError(
                    f"shared-memory {what}: a copy thread did not finish within "
                    f"{self._timeout_s} s (timeout_s); the channel is closed for use, "
                    f"reconnect") from None
        return out


    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self.unanswered and not self._broken:
            # Bounded: a service that does not answer within the channel's timeout
            # leaves the releases to the lease timeout, as a crashed client would.
            with contextlib.suppress(CtxmemError):
                self.flush()
        with self._lock:
            for region in list(self._maps):
                self._drop(region)
            self._sock.close()
