"""The contract every data channel meets (shared memory, TCP, RDMA)."""

from __future__ import annotations

import abc
from collections.abc import Sequence

from ctxmem.transport.verified import BlockBounce, ReadProgress
from ctxmem_common.codecs import crc32c
from ctxmem_common.errors import Unavailable
from ctxmem_common.proto import ctxmem_pb2 as pb


class TransportError(Unavailable):
    """The data channel failed (peer gone, refused, expired); the request can be retried."""


class DataChannel(abc.ABC):
    """Moves the bytes of one allocation or lease. Blocking; the client runs it on a
    worker thread. ``views`` are flat byte views, one per slot, each ``slot.length`` long."""

    name: str

    @abc.abstractmethod
    def write(self, allocation_id: bytes, slots: Sequence[pb.Slot],
              views: Sequence[memoryview]) -> None: ...

    @abc.abstractmethod
    def read(self, lease_id: bytes, slots: Sequence[pb.Slot],
             views: Sequence[memoryview]) -> None:
        """Copy each slot into its view, unchecked (what ``verify_gets=False`` uses)."""

    def read_verified(self, lease_id: bytes, slots: Sequence[pb.Slot],
                      views: Sequence[memoryview], crcs: Sequence[int],
                      progress: ReadProgress) -> None:
        """Read each block through the channel's bounce and write it into its view only if
        its CRC32C equals ``crcs[i]``; stop at the first block that fails (recorded in
        ``progress.bad``; it and later views stay untouched). ``progress.done`` counts the
        blocks delivered so far, also when this raises.

        This default reads one block per :meth:`read` call; channels override it to fuse
        the check with their copy (see :mod:`ctxmem.transport.verified`)."""
        bounce = self._verify_bounce()
        for i, (slot, dst, want) in enumerate(zip(slots, views, crcs, strict=True)):
            tmp = bounce.view(dst.nbytes)
            self.read(lease_id, [slot], [tmp])
            if not bounce.deliver(dst, crc32c(tmp), want):
                progress.bad = i
                return
            progress.done = i + 1

    def _verify_bounce(self) -> BlockBounce:
        bounce: BlockBounce | None = getattr(self, "_block_bounce", None)
        if bounce is None:
            bounce = BlockBounce()
            self._block_bounce = bounce
        return bounce

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> DataChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
