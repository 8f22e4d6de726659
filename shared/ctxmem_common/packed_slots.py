"""Acquire's packed answer: the slots of a lease as little-endian fixed-width arrays.

Why: a get of 64 KiB blocks spent most of the service's time building one protobuf
``Slot`` message per block, and the client as long reading them back. Packed, the
service fills five ``bytes`` fields with one numpy call each and the client reads them
with ``np.frombuffer``, whatever the batch's size (layout in ctxmem.proto,
``AcquireResponse`` fields 7-11: ``slot_regions`` and ``slot_generations`` uint32,
``slot_offsets`` and ``slot_lengths`` uint64, ``slot_crcs`` uint32).

Only shared-memory sessions ask for it (``AcquireRequest.want_packed``): TCP and RDMA keep
the repeated ``slots`` (RDMA needs each slot's address and rkey). An older service ignores
the flag and answers with ``slots``; :func:`unpack_acquire` reads either form.

Decoding trusts nothing: each field must be exactly ``num_acquired`` elements wide, and
every length must equal the block size the caller expects; the shared-memory channel then
checks each ``offset + length`` against the region it mapped before any copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ctxmem_common.proto import ctxmem_pb2 as pb

__all__ = ["PackedSlots", "pack_acquire", "unpack_acquire"]

_U32 = np.dtype("<u4")
_U64 = np.dtype("<u8")


@dataclass(frozen=True)
class PackedSlots:
    """One lease's slots, as plain int lists (``ndarray.tolist``: what a per-block loop in
    Python indexes fastest) of equal length."""

    regions: list[int]
    generations: list[int]
    offsets: list[int]
    lengths: list[int]
    crcs: list[int]
    #: The same regions, generations, offsets and lengths as numpy arrays (uint32, uint32,
    #: uint64, uint64) where the decoder had them (a fast-path answer), so the channel's
    #: run and bounds check is numpy over them, not Python over the lists.
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = field(
        default=None, compare=False, repr=False)

    def __len__(self) -> int:
        return len(self.regions)

    def ndarrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """:attr:`arrays`, or the lists converted (a gRPC answer, a test's slots)."""
        if self.arrays is not None:
            return self.arrays
        return (np.asarray(self.regions, np.uint32), np.asarray(self.generations, np.uint32),
                np.asarray(self.offsets, np.uint64), np.asarray(self.lengths, np.uint64))

    def slots(self) -> list[pb.Slot]:
        """The same slots as protobuf messages, for channels that take those."""
        return [pb.Slot(region=r, generation=g, offset=o, length=n) for r, g, o, n in
                zip(self.regions, self.generations, self.offsets, self.lengths, strict=True)]


_Ints = Sequence[int] | np.ndarray


def pack_acquire(resp: pb.AcquireResponse, regions: _Ints, generations: _Ints,
                 offsets: _Ints, lengths: _Ints, crcs: _Ints) -> None:
    """Fill ``resp``'s packed fields (one array conversion per field; none for numpy
    arrays of the field's dtype)."""
    resp.slot_regions = np.asarray(regions, dtype=_U32).tobytes()
    resp.slot_generations = np.asarray(generations, dtype=_U32).tobytes()
    resp.slot_offsets = np.asarray(offsets, dtype=_U64).tobytes()
    resp.slot_lengths = np.asarray(lengths, dtype=_U64).tobytes()
    resp.slot_crcs = np.asarray(crcs, dtype=_U32).tobytes()


def _field(resp: pb.AcquireResponse, name: str, dtype: np.dtype, n: int) -> list[int]:
    raw: bytes = getattr(resp, name)
    if len(raw) != n * dtype.itemsize:
        raise ValueError(
            f"Acquire answer for lease {resp.lease_id.hex()}: {name} is {len(raw)} bytes, "
            f"not {n} x {dtype.itemsize} for num_acquired={n}; the service sent a malformed "
            f"packed answer (a bug in it, or not a ctxmem service): report it")
    out: list[int] = np.frombuffer(raw, dtype=dtype).tolist()
    return out


def unpack_acquire(resp: pb.AcquireResponse, requested: int,
                   block_nbytes: int) -> PackedSlots:
    """The acquired slots of ``resp`` in either form (packed, or the repeated ``slots``
    and ``crc32c`` of a service that predates it), checked: ``num_acquired`` at most
    ``requested``, every field exactly that many elements, every length ``block_nbytes``.
    ValueError names what was wrong."""
    n = resp.num_acquired
    if n > requested:
        raise ValueError(
            f"Acquire answer for lease {resp.lease_id.hex()}: num_acquired={n} but only "
            f"{requested} keys were asked for; report this service bug")
    if resp.slot_regions or (n and not resp.slots):
        out = PackedSlots(
            regions=_field(resp, "slot_regions", _U32, n),
            generations=_field(resp, "slot_generations", _U32, n),
            offsets=_field(resp, "slot_offsets", _U64, n),
            lengths=_field(resp, "slot_lengths", _U64, n),
            crcs=_field(resp, "slot_crcs", _U32, n))
    else:
        if len(resp.slots) < n or len(resp.crc32c) < n:
            raise ValueError(
                f"Acquire answer for lease {resp.lease_id.hex()}: num_acquired={n} but "
                f"{len(resp.slots)} slots and {len(resp.crc32c)} CRCs; report this "
                f"service bug")
        slots = resp.slots[:n]
        out = PackedSlots(
            regions=[s.region for s in slots], generations=[s.generation for s in slots],
            offsets=[s.offset for s in slots], lengths=[s.length for s in slots],
            crcs=list(resp.crc32c[:n]))
    if n and (min(out.lengths) != block_nbytes or max(out.lengths) != block_nbytes):
        raise ValueError(
            f"Acquire answer for lease {resp.lease_id.hex()}: slot lengths "
            f"{sorted(set(out.lengths))[:4]} differ from the block size {block_nbytes}; "
            f"report this service bug")
    return out
