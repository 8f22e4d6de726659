"""The contract every data channel meets (shared memory, TCP, RDMA)."""

from __future__ import annotations

import abc
from collections.abc import Sequence

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
             views: Sequence[memoryview]) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> DataChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
