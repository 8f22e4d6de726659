"""The shared-memory channel's run and bounds check (ShmChannel._runs), in numpy.

Every copy of a get or a put goes through these runs: a slot must land in the run of its
own (region, generation) mapping, and a slot that ends past its region (or whose end
wraps past 2**64) must refuse the whole answer before any copy. The regions are mapped
here as plain memory (no service: what is checked is the client's arithmetic; the real
service's answers are checked in tests/integration/test_packed_acquire.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from ctxmem.transport.base import TransportError
from ctxmem.transport.shm import ShmChannel
from ctxmem_common.packed_slots import PackedSlots
from ctxmem_common.shm_ops import decode_acquire_reply, encode_acquire_reply

SIZE = 1 << 20
B = 64 << 10


def _channel(maps: dict[int, int]) -> ShmChannel:
    """A channel whose regions (id -> generation) are already mapped."""
    ch = ShmChannel.__new__(ShmChannel)
    ch._maps = {r: (g, None, memoryview(bytearray(SIZE))) for r, g in maps.items()}  # type: ignore[misc]
    return ch


def _both(regions: list[int], gens: list[int], offsets: list[int]) -> list[PackedSlots]:
    """The same slots as a fast-path answer (numpy arrays) and as plain lists."""
    n = len(regions)
    body = encode_acquire_reply(b"L" * 16, regions, gens, offsets, [B] * n, [0] * n, [1] * n)
    fast = decode_acquire_reply(body, n, B).slots
    assert fast.arrays is not None
    return [fast, PackedSlots(regions, gens, offsets, [B] * n, [0] * n)]


def test_runs_split_where_the_region_or_its_generation_changes() -> None:
    ch = _channel({1: 3, 2: 1})
    regions = [1, 1, 2, 2, 2, 1, 1]
    offsets = [0, B, 0, SIZE - B, B, 2 * B, SIZE - B]
    for slots in _both(regions, [3] * 2 + [1] * 3 + [3] * 2, offsets):
        runs = ch._runs(slots, 7, "")
        assert [(s, e) for s, e, _ in runs] == [(0, 2), (2, 5), (5, 7)]
        assert [r is ch._maps[k][2] for (_, _, r), k in zip(runs, (1, 2, 1), strict=True)] \
            == [True] * 3
        assert [(s, e) for s, e, _ in ch._runs(slots, 3, "")] == [(0, 2), (2, 3)]
        assert ch._runs(slots, 0, "") == []
    with pytest.raises(TransportError, match="8 buffers for 7 slots"):
        ch._runs(slots, 8, "")


def test_a_new_generation_of_the_same_region_is_its_own_run() -> None:
    ch = _channel({1: 3})
    asked: list[tuple[int, int]] = []

    def region(r: int, g: int) -> memoryview:
        asked.append((r, g))
        return ch._maps[r][2]

    ch._region = region  # type: ignore[method-assign]
    for slots in _both([1, 1, 1], [3, 4, 4], [0, 0, B]):
        asked.clear()
        assert [(s, e) for s, e, _ in ch._runs(slots, 3, "")] == [(0, 1), (1, 3)]
        assert asked == [(1, 3), (1, 4)]


@pytest.mark.parametrize(("bad", "offset"), [
    (0, SIZE - B + 1),  # the first slot ends one byte past its region
    (3, SIZE),  # the middle of a run starts at the region's end
    (4, 2**64 - B),  # its end wraps past 2**64 to 0
    (4, 2**64 - 1),  # its end wraps to B - 1, its offset is past the region
])
def test_a_slot_past_its_region_refuses_the_answer_naming_it(bad: int, offset: int) -> None:
    ch = _channel({1: 1, 2: 1})
    offsets = [0, B, 2 * B, 3 * B, 4 * B, 5 * B]
    offsets[bad] = offset
    for slots in _both([1, 1, 2, 2, 2, 2], [1] * 6, offsets):
        with pytest.raises(TransportError, match=rf"slot {bad} \[{offset}, {offset + B}\) "
                                                 rf"of lease x lies outside region "
                                                 rf"{1 if bad < 2 else 2} \({SIZE} bytes\)"):
            ch._runs(slots, 6, " of lease x")
        # Only the slots asked for are checked: a bad slot past them is not read.
        if bad:
            assert len(ch._runs(slots, bad, "")) == (1 if bad <= 2 else 2)


def test_ndarrays_of_plain_lists_match_the_decoded_arrays() -> None:
    fast, plain = _both([5, 6], [1, 2], [B, 2**63])
    for a, b in zip(fast.ndarrays(), plain.ndarrays(), strict=True):
        assert a.tolist() == b.tolist() and a.dtype.itemsize == b.dtype.itemsize
    assert fast == plain  # the arrays are not part of the slots' value
    assert isinstance(plain.ndarrays()[2], np.ndarray)


def test_a_length_that_wraps_the_end_past_2_64_is_refused() -> None:
    """A decoder refuses lengths other than the block size; the runs must not rely on
    it (the end would wrap to below the region's size)."""
    ch = _channel({1: 1})
    slots = PackedSlots([1, 1], [1, 1], [0, B], [B, 2**64 - 1], [0, 0])
    with pytest.raises(TransportError, match=rf"slot 1 \[{B}, {B + 2**64 - 1}\) lies"):
        ch._runs(slots, 2, "")
