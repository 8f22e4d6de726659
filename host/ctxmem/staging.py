"""Staging regions: memory the service owns, mapped here, that puts are made from.

Why (issue 27 item 1): an ordinary put copies each block into a slab slot, then the
service reads the slot again at Commit to check its CRC32C: two passes over memory, and
the client writes the service's slabs. With a staging region the engine fills its blocks
in memory the service created (its offload buffer *is* that memory), and one call names
them; the service copies each block into its slot with the CRC32C computed in the same
pass. The client never writes a slab for this path.

::

    with client.staging(64 << 20) as region:        # service memory, mapped here
        buf = region.array()                        # numpy uint8 over region.data
        buf[:n] = kv_bytes                          # e.g. the engine's D2H copy lands here
        region.put(ns, keys, offsets=[0, block, ...])   # or region.offsets_of(views)

A region belongs to the client's session of one tenant: it is freed by
:meth:`StagingRegion.close`, by :meth:`ctxmem.Client.close`, or with the session, and it
counts in the tenant's quota (``quotas.*.staging_max_bytes``). Shared memory only (the
service hands over the region's memfd on its Unix socket). The CPU side is what is built
and tested; registering a region with CUDA (``cudaHostRegister``) so a GPU's copy lands
in it is left to a later change.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ctxmem.transport.shm import ShmChannel
from ctxmem_common import staging_wire
from ctxmem_common.errors import CtxmemError, InvalidArgument
from ctxmem_common.keys import validate_keys
from ctxmem_common.wire import SHM_OP_STAGE_CREATE, SHM_OP_STAGE_FREE, SHM_OP_STAGE_PUT

if TYPE_CHECKING:
    from ctxmem.client import Client, _Session
    from ctxmem.namespace import Namespace

__all__ = ["MAX_PUT_BLOCKS", "StagedPutResult", "StagingRegion", "open_region"]

MAX_PUT_BLOCKS = 65536
"""Blocks per STAGE_PUT frame (its body stays well under ``service.shm_op_max_bytes``)."""


@dataclass(frozen=True)
class StagedPutResult:
    stored: int
    """Blocks newly committed by this call."""
    existing: int
    """Blocks already stored (nothing was copied for them)."""
    refused: list[int]
    """Indexes of blocks not stored because the bytes the service copied do not have the
    CRC32C given for them (the region changed under the put, or the CRC was wrong)."""


class StagingRegion:
    """A service-owned staging region mapped into this process. Use it as a context
    manager or call :meth:`close`; :attr:`data` (and :meth:`array`) are views of its
    data bytes, which :meth:`put` offsets count from."""

    def __init__(self, session: _Session, created: staging_wire.Created, fd: int) -> None:
        self.session = session
        self.id = created.region_id
        self.size = created.size
        self.hugepages = created.hugepages
        self._data_offset = created.data_offset
        try:
            self._mm = mmap.mmap(fd, created.size, mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._view = memoryview(self._mm)
        magic, _v, rid, _f, size, data_offset = staging_wire.HEADER.unpack_from(self._view)
        if (magic, rid, size, data_offset) != (staging_wire.HEADER_MAGIC, self.id, self.size,
                                               self._data_offset):
            self._unmap()
            raise CtxmemError(f"staging region {self.id}: the memory the service sent has "
                              f"header {magic!r} region {rid} of {size} bytes; report it")
        self.data: memoryview = self._view[self._data_offset:]
        """The region's data bytes (writable): blocks are filled here."""
        self.closed = False

    @property
    def nbytes(self) -> int:
        """Bytes of :attr:`data`."""
        return self.size - self._data_offset

    def array(self, dtype: Any = np.uint8) -> np.ndarray:
        """:attr:`data` as a flat numpy array of ``dtype`` (no copy)."""
        return np.frombuffer(self.data, dtype=dtype)

    def offsets_of(self, buffers: Sequence[Any]) -> list[int]:
        """Where each of ``buffers`` (numpy arrays or memoryviews that are views of
        :attr:`data`, e.g. an engine's blocks laid out in the region) starts in
        :attr:`data`: the ``offsets`` :meth:`put` takes. InvalidArgument for a buffer
        that is not a contiguous view inside the region."""
        base = np.frombuffer(self.data, np.uint8).__array_interface__["data"][0]
        out = []
        for i, buf in enumerate(buffers):
            arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
            off = arr.__array_interface__["data"][0] - base
            if not arr.flags.c_contiguous or off < 0 or off + arr.nbytes > self.nbytes:
                raise InvalidArgument(
                    f"buffers[{i}] is not a contiguous view inside staging region "
                    f"{self.id}'s data ({self.nbytes} bytes); slice region.array() or "
                    f"region.data")
            out.append(int(off))
        return out

    def put(self, ns: Namespace, keys: Sequence[bytes], offsets: Sequence[int],
            crcs: Sequence[int] | None = None) -> StagedPutResult:
        """Store one block per key from :attr:`data` at ``offsets[i]`` (each
        ``ns.block_nbytes`` long), in one call per up to :data:`MAX_PUT_BLOCKS` blocks:
        the service copies each into its slot with its CRC32C computed in the same pass.
        ``crcs`` (optional): each block's CRC32C, checked against the bytes copied (a
        block that differs is not stored: :attr:`StagedPutResult.refused`); without them
        the service's CRC of what it copied is the block's."""
        self._check_open()
        validate_keys(keys)
        n = len(keys)
        if len(offsets) != n or (crcs is not None and len(crcs) != n):
            raise InvalidArgument(f"put from staging region {self.id}: {n} keys, "
                                  f"{len(offsets)} offsets, "
                                  f"{'no' if crcs is None else len(crcs)} crcs; pass one "
                                  f"offset (and CRC) per key")
        s = ns._open()
        if s is not self.session:
            raise InvalidArgument(
                f"staging region {self.id} belongs to session {self.session.id.hex()}, "
                f"namespace {ns.model_id!r} is open in session {s.id.hex()} (another "
                f"tenant, or the service restarted and the session was replaced); create "
                f"a region with client.staging(..., tenant={ns.tenant!r})")
        ch = self._channel()
        offs = np.asarray(offsets, np.uint64) + np.uint64(self._data_offset)
        stored = existing = 0
        refused: list[int] = []
        for start in range(0, n, MAX_PUT_BLOCKS):
            end = min(n, start + MAX_PUT_BLOCKS)
            part = list(keys[start:end])
            packed = b"".join(part)
            key_len = len(part[0]) if part else 1
            if len(packed) != key_len * len(part):
                raise InvalidArgument("put from a staging region needs keys of one length "
                                      "(hash engine keys to a fixed size)")
            lengths = np.full(end - start, ns.block_nbytes, np.uint64)
            out = staging_wire.decode_put_reply(ch.call(SHM_OP_STAGE_PUT, staging_wire.encode_put(
                ns.handle, self.id, packed, key_len, offs[start:end], lengths,
                None if crcs is None else np.asarray(crcs[start:end], np.uint32))),
                end - start)
            stored += out.stored
            existing += out.existing
            codes = np.frombuffer(out.outcome, np.uint8)
            refused += (np.flatnonzero(codes == staging_wire.REFUSED_CRC) + start).tolist()
        return StagedPutResult(stored, existing, refused)

    def _channel(self) -> ShmChannel:
        ch = self.session.channel
        if not isinstance(ch, ShmChannel) or not ch.ops:
            raise InvalidArgument("staging regions need the shared-memory transport with "
                                  "its fast path (transport='shm', CTXMEM_FAST_OPS not 0)")
        return ch

    def _check_open(self) -> None:
        if self.closed:
            raise InvalidArgument(f"staging region {self.id} is closed; create another")

    def _unmap(self) -> None:
        self._view.release()
        with contextlib.suppress(BufferError):  # a view the caller still holds
            self._mm.close()

    def close(self) -> None:
        """Free the region on the service (best effort: its session may have ended,
        which freed it) and unmap it here. Views of :attr:`data` the caller still holds
        keep the mapping alive until they are released."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(CtxmemError, OSError):
            self._channel().call(SHM_OP_STAGE_FREE, [staging_wire.encode_free(self.id)])
        self.data.release()
        self._unmap()

    def __enter__(self) -> StagingRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_region(client: Client, nbytes: int, tenant: str = "default") -> StagingRegion:
    """A new staging region of at least ``nbytes`` data bytes in ``client``'s session of
    ``tenant`` (see :meth:`ctxmem.Client.staging`)."""
    s = client._session(tenant)
    ch = s.channel
    if not isinstance(ch, ShmChannel) or not ch.ops:
        raise InvalidArgument(
            f"staging regions need the shared-memory transport with its fast path; this "
            f"client uses {client.transport_in_use!r} (pass transport='shm', run on the "
            f"service's host, leave CTXMEM_FAST_OPS unset; the service must offer the fast "
            f"path: service.shm_op_max_bytes above 0)")
    body, fd = ch.call_with_fd(SHM_OP_STAGE_CREATE, [staging_wire.encode_create(nbytes)])
    try:
        created = staging_wire.decode_create_reply(body)
    except ValueError as exc:
        os.close(fd)
        raise CtxmemError(f"malformed STAGE_CREATE answer: {exc}; report it") from None
    return StagingRegion(s, created, fd)
