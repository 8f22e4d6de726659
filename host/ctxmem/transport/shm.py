"""Shared-memory channel: map the service's slab memfds and copy with one memcpy per block.

Regions are mapped on first use and cached by ``(region, generation)``; a slot naming a
newer generation means the slab was recycled, so the old mapping is dropped and the new
memfd fetched. An unverified write or read is a memoryview slice assignment: a single C
``memcpy``. A put's write (:meth:`ShmChannel.write_crc`) and a verified read (the default
get) copy each block with :func:`~ctxmem_common.codecs.copy_crc32c`, the copy and its
CRC32C in one pass; a read whose CRC differs from the committed one scrubs the buffer and
stops (:mod:`ctxmem.transport.verified`): another client that still maps the slab cannot
make a get return bytes that were not committed.
"""

from __future__ import annotations

import contextlib
import mmap
import socket
import threading
from collections.abc import Sequence

from ctxmem.transport.base import DataChannel, TransportError
from ctxmem.transport.verified import ReadProgress, copy_checked
from ctxmem_common.codecs import CRC32C_FUSED, copy_crc32c
from ctxmem_common.packed_slots import PackedSlots
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.wire import (
    SHM_HELLO,
    SHM_MAP,
    SHM_MAP_REPLY,
    SHM_STATUS,
    STATUS_TEXT,
    Status,
)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise TransportError("shared-memory socket closed by the service")
        buf += chunk
    return bytes(buf)


class ShmChannel(DataChannel):
    name = "shm"

    def __init__(self, path: str, session_id: bytes, token: bytes, timeout_s: float) -> None:
        self.path = path
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
        as :meth:`read_verified` (``verify``) or :meth:`read`, on plain int lists, with the
        region looked up only when it changes. Each slot's ``offset + length`` is checked
        against the mapped region before its copy: a malformed answer raises
        TransportError, never reads outside the mapping. ``progress.done`` counts the
        blocks delivered, also when this raises."""
        regions, gens, offsets, lengths, crcs = (
            slots.regions, slots.generations, slots.offsets, slots.lengths, slots.crcs)
        with self._lock:
            key = (-1, -1)
            region = memoryview(b"")
            for i, dst in enumerate(views):
                if (regions[i], gens[i]) != key:
                    key = (regions[i], gens[i])
                    region = self._region(*key)
                off = offsets[i]
                end = off + lengths[i]
                if end > region.nbytes:
                    raise TransportError(
                        f"lease {lease_id.hex()}: slot {i} [{off}, {end}) lies outside "
                        f"region {key[0]} ({region.nbytes} bytes); the service's answer is "
                        f"malformed: report it")
                if not verify:
                    dst[:] = region[off:end]
                elif not copy_checked(region[off:end], dst, crcs[i]):
                    progress.bad = i
                    return
                progress.done = i + 1

    def close(self) -> None:
        with self._lock:
            for region in list(self._maps):
                self._drop(region)
            self._sock.close()
