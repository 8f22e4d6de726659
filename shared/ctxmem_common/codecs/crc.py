"""CRC32C (Castagnoli) over any buffer, over many ranges of one buffer in one call, and a
copy fused with it (one pass over memory).

Two implementations stand behind the same functions:

* ``native``: ``ctxmem_common.codecs._crc32c_native``, this package's C extension (built at
  install by setup.py): SSE4.2 ``crc32`` on x86-64 (with AVX2, large copies use
  non-temporal stores), the ARMv8 CRC32C instructions on aarch64 (BlueField), slicing-by-8
  tables elsewhere. :func:`copy_crc32c` copies and CRCs each word in the same pass, so the
  destination holds exactly the bytes that were checked.
* ``pure``: the ``crc32c`` package (also hardware-accelerated, no fused copy): the fallback
  when the extension was not built; :func:`copy_crc32c` then copies, then CRCs the
  destination chunk by chunk while it is in cache: the bytes as stored, provided nobody
  else writes ``dst`` meanwhile. So where ``dst`` is shared (a put into a slab slot), a
  caller checks :data:`FUSED` and otherwise CRCs its own source before copying.

``CTXMEM_CRC32C_IMPL`` forces one at import: ``hardware``, ``table`` (the extension's
portable path) or ``pure``; unset means the fastest available. Tests and ``ctxmem bench``
use it to compare the paths on one machine. :data:`IMPLEMENTATION` says which is active
(``native/sse4.2+avx2``, ``native/armv8-crc``, ``native/table``, ``pure``); the service
logs it at start and the bench prints it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Buffer

import crc32c as _crc32c

__all__ = ["FUSED", "IMPLEMENTATION", "copy_crc32c", "copy_crc32c_between",
           "copy_crc32c_from_slots", "copy_crc32c_to_slots", "crc32c", "crc32c_many"]

ENV = "CTXMEM_CRC32C_IMPL"
_CHOICES = ("hardware", "table", "pure")

# Release the GIL for buffers above the package's threshold so a CRC of a 2 MiB block
# does not stall the service's event loop thread.
_GIL_RELEASE = 1
_PURE_CHUNK = 256 << 10
"""The pure fused copy's step: small enough that the CRC reads the chunk from L2."""


def _load_native(choice: str) -> ModuleType | None:
    if choice == "pure":
        return None
    try:
        from ctxmem_common.codecs import _crc32c_native as mod  # type: ignore[attr-defined]
    except ImportError:
        if choice:
            raise ImportError(
                f"{ENV}={choice} needs the native extension ctxmem_common.codecs."
                f"_crc32c_native, which is not built; reinstall with a C compiler and the "
                f"Python headers (`pip install -e .`), or set {ENV}=pure") from None
        return None
    if choice:
        mod.set_implementation(choice)
    return mod


_choice = os.environ.get(ENV, "").strip().lower()
if _choice and _choice not in _CHOICES:
    raise ImportError(f"{ENV}={_choice!r}: use one of {', '.join(_CHOICES)}, or unset it")
_native = _load_native(_choice)

IMPLEMENTATION: str = "pure" if _native is None else f"native/{_native.implementation()}"
"""The active implementation (see the module docstring)."""

FUSED: bool = _native is not None
"""Whether :func:`copy_crc32c` CRCs each word from the register it stores (native), so the
CRC is of the bytes stored even if ``dst`` is written by someone else during the copy."""


def _pure_crc32c(data: Buffer, value: int = 0) -> int:
    return int(_crc32c.crc32c(data, value, _GIL_RELEASE))


def _pure_copy_crc32c(src: Buffer, dst: Buffer, value: int = 0) -> int:
    s = memoryview(src).cast("B")
    d = memoryview(dst).cast("B")
    if d.readonly:
        raise ValueError("copy_crc32c: dst is read-only; pass a writable buffer "
                         "(bytearray, a writable memoryview or numpy array)")
    if s.nbytes != d.nbytes:
        raise ValueError(f"copy_crc32c: src is {s.nbytes} bytes but dst is {d.nbytes}; pass "
                         f"a destination of exactly the source's size")
    for off in range(0, s.nbytes, _PURE_CHUNK):
        end = min(off + _PURE_CHUNK, s.nbytes)
        d[off:end] = s[off:end]
        value = _crc32c.crc32c(d[off:end], value, _GIL_RELEASE)
    return int(value)


def _pure_crc32c_many(buf: Buffer, offsets: Sequence[int],
                      lengths: int | Sequence[int]) -> list[int]:
    m = memoryview(buf).cast("B")
    lens = [lengths] * len(offsets) if isinstance(lengths, int) else list(lengths)
    if len(lens) != len(offsets):
        raise ValueError(f"crc32c_many: {len(offsets)} offsets but {len(lens)} lengths; pass "
                         f"one length per offset, or one int for all")
    for i, (off, n) in enumerate(zip(offsets, lens, strict=True)):
        if off < 0 or n < 0 or off + n > m.nbytes:
            raise ValueError(f"crc32c_many: range {i} is [{off}, {off} + {n}), outside the "
                             f"{m.nbytes}-byte buffer; pass offsets and lengths within it")
    return [int(_crc32c.crc32c(m[off:off + n], 0, _GIL_RELEASE))
            for off, n in zip(offsets, lens, strict=True)]


def _check_slots(fn: str, region: memoryview, offsets: Sequence[int],
                 lengths: Sequence[int], bufs: Sequence[memoryview],
                 crcs: Sequence[int] | None) -> None:
    """The native batch functions' checks, all before any copy (same errors)."""
    n = len(bufs)
    if len(offsets) != n or len(lengths) != n or (crcs is not None and len(crcs) != n):
        raise ValueError(f"{fn}: {n} buffers but {len(offsets)} offsets, {len(lengths)} "
                         f"lengths and {n if crcs is None else len(crcs)} crcs; pass one of "
                         f"each per block")
    if crcs is not None and not all(0 <= c <= 0xFFFFFFFF for c in crcs):
        raise ValueError(f"{fn}: crcs must be ints in [0, 2**32)")
    for i, (off, length, buf) in enumerate(zip(offsets, lengths, bufs, strict=True)):
        if off < 0 or length < 0 or off + length > region.nbytes:
            raise ValueError(f"{fn}: slot {i} [{off}, {off} + {length}) lies outside the "
                             f"region ({region.nbytes} bytes); nothing was copied")
        if buf.nbytes != length:
            raise ValueError(f"{fn}: buffer {i} is {buf.nbytes} bytes but its slot is "
                             f"{length}; pass buffers of exactly their slot's length; "
                             f"nothing was copied")


def _pure_copy_from_slots(region: Buffer, offsets: Sequence[int], lengths: Sequence[int],
                          dsts: Sequence[Buffer], crcs: Sequence[int] | None = None
                          ) -> tuple[int, int | None]:
    r = memoryview(region).cast("B")
    views = [memoryview(d).cast("B") for d in dsts]
    _check_slots("copy_crc32c_from_slots", r, offsets, lengths, views, crcs)
    if any(v.readonly for v in views):
        raise ValueError("copy_crc32c_from_slots: a dst is read-only; pass writable buffers")
    for i, (off, length, dst) in enumerate(zip(offsets, lengths, views, strict=True)):
        if crcs is None:
            dst[:] = r[off : off + length]
        elif _pure_copy_crc32c(r[off : off + length], dst) != crcs[i]:
            dst[:] = bytes(length)
            return i, i
    return len(views), None


def _pure_copy_to_slots(srcs: Sequence[Buffer], region: Buffer, offsets: Sequence[int],
                        lengths: Sequence[int]) -> list[int]:
    r = memoryview(region).cast("B")
    views = [memoryview(s).cast("B") for s in srcs]
    _check_slots("copy_crc32c_to_slots", r, offsets, lengths, views, None)
    if r.readonly:
        raise ValueError("copy_crc32c_to_slots: region is read-only; pass a writable buffer")
    out = []
    for off, length, src in zip(offsets, lengths, views, strict=True):
        # Not fused: CRC the source, then copy (a CRC of the slot after the copy could
        # cover another mapper's bytes).
        out.append(_pure_crc32c(src))
        r[off : off + length] = src
    return out


def _pure_copy_between(src: Buffer, src_offsets: Sequence[int], dst: Buffer,
                       dst_offsets: Sequence[int], length: int) -> list[int]:
    s = memoryview(src).cast("B")
    d = memoryview(dst).cast("B")
    fn = "copy_crc32c_between"
    if d.readonly:
        raise ValueError(f"{fn}: dst is read-only; pass a writable buffer")
    if len(src_offsets) != len(dst_offsets):
        raise ValueError(f"{fn}: {len(src_offsets)} src_offsets but {len(dst_offsets)} "
                         f"dst_offsets; pass one of each per block")
    if length < 0:
        raise ValueError(f"{fn}: length must be >= 0")
    for i, (so, do) in enumerate(zip(src_offsets, dst_offsets, strict=True)):
        if so < 0 or do < 0 or so + length > s.nbytes or do + length > d.nbytes:
            raise ValueError(f"{fn}: block {i} [{so}, +{length}) -> [{do}, +{length}) lies "
                             f"outside src ({s.nbytes} bytes) or dst ({d.nbytes} bytes); "
                             f"nothing was copied")
    # Not fused: copy, then CRC what was stored (the source may be another process's,
    # changing meanwhile; the destination is the caller's).
    out = []
    for so, do in zip(src_offsets, dst_offsets, strict=True):
        d[do:do + length] = s[so:so + length]
        out.append(_pure_crc32c(d[do:do + length]))
    return out


if TYPE_CHECKING:
    def crc32c(data: Buffer, value: int = 0) -> int:
        """CRC32C of ``data``, continuing from ``value`` (0 to start)."""

    def copy_crc32c(src: Buffer, dst: Buffer, value: int = 0) -> int:
        """Copy ``src`` into ``dst`` (the same size; ValueError otherwise, or if ``dst``
        is read-only) and return the CRC32C, continuing from ``value``, of the bytes
        stored into ``dst``."""

    def crc32c_many(buf: Buffer, offsets: Sequence[int],
                    lengths: int | Sequence[int]) -> list[int]:
        """The CRC32C (from 0) of each ``buf[offsets[i]:offsets[i] + lengths[i]]``
        (``lengths``: one int for all ranges, or one per offset), in one call: natively,
        with the GIL released once for the whole batch (a Commit's slots in a slab).
        Every range is checked first: ValueError, before any CRC, if one is outside
        ``buf``."""

    def copy_crc32c_from_slots(region: Buffer, offsets: Sequence[int],
                               lengths: Sequence[int], dsts: Sequence[Buffer],
                               crcs: Sequence[int] | None = None) -> tuple[int, int | None]:
        """A batch of a get: ``region[offsets[i]:offsets[i] + lengths[i]]`` into
        ``dsts[i]``, every bound and size checked before any copy (ValueError naming the
        slot), one native call with the GIL released once. With ``crcs``, each block is
        copied and CRC'd in one pass and the first whose CRC differs ends the call with its
        ``dst`` zeroed: returns ``(i, i)``; otherwise ``(len(dsts), None)``. Without
        ``crcs``, a plain copy."""

    def copy_crc32c_to_slots(srcs: Sequence[Buffer], region: Buffer,
                             offsets: Sequence[int], lengths: Sequence[int]) -> list[int]:
        """A batch of a put: ``srcs[i]`` into ``region[offsets[i]:offsets[i] +
        lengths[i]]``, checked first as :func:`copy_crc32c_from_slots`, and each block's
        CRC32C (of the words as stored, where :data:`FUSED`; of the source otherwise)."""

    def copy_crc32c_between(src: Buffer, src_offsets: Sequence[int], dst: Buffer,
                            dst_offsets: Sequence[int], length: int) -> list[int]:
        """A staged put's batch: each ``src[src_offsets[i]:+length]`` into
        ``dst[dst_offsets[i]:+length]``, every range (and overlap) checked before any
        copy (ValueError naming the block), one native call with the GIL released once,
        and each block's CRC32C of the words as stored (where :data:`FUSED`; otherwise of
        the destination after the copy)."""
elif _native is None:
    crc32c = _pure_crc32c
    copy_crc32c = _pure_copy_crc32c
    copy_crc32c_from_slots = _pure_copy_from_slots
    copy_crc32c_to_slots = _pure_copy_to_slots
    crc32c_many = _pure_crc32c_many
    copy_crc32c_between = _pure_copy_between
else:
    crc32c = _native.crc32c
    copy_crc32c = _native.copy_crc32c
    copy_crc32c_from_slots = _native.copy_crc32c_from_slots
    copy_crc32c_to_slots = _native.copy_crc32c_to_slots
    crc32c_many = _native.crc32c_many
    # An extension built before copy_crc32c_between existed (a stale in-place build):
    # the pure one, correct but not fused, rather than a failed import.
    # tests/shared/test_crc32c_between.py fails then, so a stale build is noticed.
    copy_crc32c_between = getattr(_native, "copy_crc32c_between", _pure_copy_between)
