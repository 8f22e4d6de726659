"""The batch copies of a get and a put (``copy_crc32c_from_slots``, ``copy_crc32c_to_slots``)
on every CRC32C path (each native path this CPU runs, forced in turn, and the pure
fallback): the same bytes and CRCs as one ``copy_crc32c`` per block on random offsets and
lengths, every bound and size refused before any copy, a mismatch at the first, a middle
and the last block stopping there with that buffer zeroed and every later one untouched,
read-only sources for puts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from ctxmem_common.codecs import crc as crc_mod

FromSlots = Callable[..., tuple[int, int | None]]
ToSlots = Callable[..., list[int]]
SENTINEL = 0x5A
REGION = 4 << 20

_PURE = os.environ.get(crc_mod.ENV) == "pure"
if _PURE:
    PATHS = ["pure"]
else:
    from ctxmem_common.codecs import _crc32c_native as native  # type: ignore[attr-defined]

    PATHS = [*native.available(), "pure"]


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest) -> Iterator[tuple[FromSlots, ToSlots]]:
    """(from_slots, to_slots) of one path; the native module's choice restored after."""
    if request.param == "pure":
        yield crc_mod._pure_copy_from_slots, crc_mod._pure_copy_to_slots
        return
    before = native.implementation()
    native.set_implementation(request.param)
    try:
        yield native.copy_crc32c_from_slots, native.copy_crc32c_to_slots
    finally:
        native.set_implementation(before)


def _region() -> np.ndarray:
    return np.random.default_rng(5).integers(0, 256, REGION, dtype=np.uint8)


def _slots(seed: int, n: int) -> tuple[list[int], list[int]]:
    """Random offsets and lengths (0 to 300 KB, odd ones included) inside the region."""
    rng = np.random.default_rng(seed)
    lengths = [0, 1, 7, 1024, 65536, *rng.integers(0, 300_000, n - 5).tolist()]
    offsets = [int(rng.integers(0, REGION - ln + 1)) for ln in lengths]
    return offsets, lengths


def _crc(data: Any) -> int:
    return crc_mod._pure_crc32c(data)


def test_get_batch_equals_one_copy_per_block(path: tuple[FromSlots, ToSlots]) -> None:
    from_slots, _ = path
    region = _region()
    offsets, lengths = _slots(1, 40)
    crcs = [_crc(region[o : o + n]) for o, n in zip(offsets, lengths, strict=True)]
    for want in (crcs, None):
        dsts = [bytearray([SENTINEL]) * n for n in lengths]
        assert from_slots(region, offsets, lengths, dsts, want) == (len(dsts), None)
        for o, n, d in zip(offsets, lengths, dsts, strict=True):
            assert d == region[o : o + n].tobytes()


def test_put_batch_equals_one_copy_per_block(path: tuple[FromSlots, ToSlots]) -> None:
    _, to_slots = path
    src = _region()
    offsets, lengths = _slots(2, 40)
    # disjoint slots in a fresh region: one after the other
    dst_offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    region = np.full(sum(lengths) + 64, SENTINEL, dtype=np.uint8)
    srcs = [memoryview(src[o : o + n].tobytes()) for o, n in zip(offsets, lengths, strict=True)]
    got = to_slots(srcs, region, dst_offsets, lengths)
    assert got == [_crc(s) for s in srcs]
    for o, s in zip(dst_offsets, srcs, strict=True):
        assert region[o : o + s.nbytes].tobytes() == bytes(s)
    assert (region[sum(lengths):] == SENTINEL).all(), "wrote outside the slots"


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_get_batch_stops_at_the_first_mismatch(path: tuple[FromSlots, ToSlots],
                                               where: str) -> None:
    from_slots, _ = path
    region = _region()
    n, size = 8, 65536
    offsets, lengths = [i * size for i in range(n)], [size] * n
    crcs = [_crc(region[o : o + size]) for o in offsets]
    bad = {"first": 0, "middle": 3, "last": n - 1}[where]
    crcs[bad] ^= 1
    dsts = [bytearray([SENTINEL]) * size for _ in range(n)]
    assert from_slots(region, offsets, lengths, dsts, crcs) == (bad, bad)
    for i in range(bad):
        assert dsts[i] == region[offsets[i] : offsets[i] + size].tobytes()
    assert dsts[bad] == bytes(size), "the failed block's buffer is zeroed"
    for i in range(bad + 1, n):
        assert dsts[i] == bytearray([SENTINEL]) * size, "buffers after it untouched"


@pytest.mark.parametrize("case", ["offset", "length", "huge", "size", "count", "readonly",
                                  "crc"])
def test_get_batch_refuses_before_any_copy(path: tuple[FromSlots, ToSlots], case: str) -> None:
    from_slots, _ = path
    region = _region()
    size = 4096
    offsets, lengths = [0, size, 2 * size], [size] * 3
    crcs: list[int] | None = [_crc(region[o : o + size]) for o in offsets]
    dsts: list[Any] = [bytearray([SENTINEL]) * size for _ in range(3)]
    match = r"slot 2 .* outside the region"
    if case == "offset":
        offsets[2] = REGION - size + 1
    elif case == "length":
        lengths[2] = REGION
        dsts[2] = bytearray([SENTINEL]) * REGION
    elif case == "huge":
        offsets[2] = 2**64 - 1
    elif case == "size":
        dsts[2] = bytearray([SENTINEL]) * (size + 1)
        match = "buffer 2 is 4097 bytes but its slot is 4096"
    elif case == "count":
        crcs = [0, 0]
        match = "3 buffers but 3 offsets, 3 lengths and 2 crcs"
    elif case == "readonly":
        dsts[2] = bytes(size)
        match = "read-only"
    elif case == "crc":
        assert crcs is not None
        crcs[2] = 1 << 32
        match = "crcs"
    with pytest.raises(ValueError, match=match):
        from_slots(region, offsets, lengths, dsts, crcs)
    for d in dsts[:2]:
        assert d == bytearray([SENTINEL]) * size, "nothing copied on a refused batch"


def test_put_batch_refuses_before_any_copy(path: tuple[FromSlots, ToSlots]) -> None:
    _, to_slots = path
    size = 4096
    region = np.full(4 * size, SENTINEL, dtype=np.uint8)
    srcs = [memoryview(bytes([i]) * size) for i in range(3)]
    with pytest.raises(ValueError, match=r"slot 2 .* outside the region"):
        to_slots(srcs, region, [0, size, 3 * size + 1], [size] * 3)
    with pytest.raises(ValueError, match="buffer 1 is 4095 bytes"):
        to_slots([srcs[0], srcs[1][1:], srcs[2]], region, [0, size, 2 * size], [size] * 3)
    with pytest.raises(ValueError, match="read-only"):
        to_slots(srcs, bytes(4 * size), [0, size, 2 * size], [size] * 3)
    assert (region == SENTINEL).all(), "nothing copied on a refused batch"


def test_put_batch_takes_read_only_sources(path: tuple[FromSlots, ToSlots]) -> None:
    """A put's buffers may be read-only (bytes, a frozen numpy array): only read."""
    _, to_slots = path
    size = 65536
    a = np.arange(size, dtype=np.uint8)
    a.flags.writeable = False
    srcs: list[Any] = [bytes(range(256)) * (size // 256), a, memoryview(bytes(size))]
    region = np.zeros(3 * size, dtype=np.uint8)
    assert to_slots(srcs, region, [2 * size, 0, size], [size] * 3) == [_crc(s) for s in srcs]
    assert region[2 * size :].tobytes() == bytes(srcs[0])
    assert region[:size].tobytes() == a.tobytes()


def test_empty_batches(path: tuple[FromSlots, ToSlots]) -> None:
    from_slots, to_slots = path
    region = bytearray(16)
    assert from_slots(region, [], [], [], []) == (0, None)
    assert to_slots([], region, [], []) == []


@pytest.mark.skipif(_PURE, reason="the native module is not under test")
def test_native_batch_argument_errors() -> None:
    region = bytearray(64)
    with pytest.raises(TypeError, match="dsts must be a sequence"):
        native.copy_crc32c_from_slots(region, [0], [8], 5)
    with pytest.raises(ValueError, match=r"offsets\[0\] must be an int"):
        native.copy_crc32c_from_slots(region, ["0"], [8], [bytearray(8)])
    with pytest.raises(ValueError, match=r"lengths\[0\] must be an int"):
        native.copy_crc32c_from_slots(region, [0], [-8], [bytearray(8)])
    with pytest.raises(ValueError, match="overlaps its slot"):
        native.copy_crc32c_to_slots([memoryview(region)[8:16]], region, [12], [8])
