"""``copy_crc32c_between`` (a staged put's copy: blocks of one buffer into ranges of
another, issue 27 item 1) on every CRC32C path this CPU runs and the pure fallback: the
same bytes and CRCs as ``crc32c`` of each source block, every range and overlap refused
before any copy (nothing written), a read-only destination refused."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import crc32c as ref
import numpy as np
import pytest

from ctxmem_common.codecs import crc as crc_mod

Between = Callable[..., list[int]]
_PURE = os.environ.get(crc_mod.ENV) == "pure"
if _PURE:
    PATHS = ["pure"]
else:
    from ctxmem_common.codecs import _crc32c_native as native  # type: ignore[attr-defined]

    PATHS = [*native.available(), "pure"]


@pytest.fixture(params=PATHS)
def between(request: pytest.FixtureRequest) -> Iterator[Between]:
    if request.param == "pure":
        yield crc_mod._pure_copy_between
        return
    before = native.implementation()
    native.set_implementation(request.param)
    try:
        yield native.copy_crc32c_between
    finally:
        native.set_implementation(before)


@pytest.mark.parametrize("length", [0, 1, 4095, 65536, 300_001])
def test_same_bytes_and_crcs_as_one_block_at_a_time(between: Between, length: int) -> None:
    rng = np.random.default_rng(length)
    src = rng.integers(0, 256, 2 << 20, dtype=np.uint8)
    dst = np.zeros(3 << 20, np.uint8)
    n = 5
    so = [int(x) for x in rng.integers(0, src.nbytes - length + 1, n)]
    do = [i * length + 7 * i for i in range(n)]  # distinct, unaligned
    got = between(src, so, dst, do, length)
    for i in range(n):
        block = src[so[i]:so[i] + length]
        assert np.array_equal(dst[do[i]:do[i] + length], block)
        assert got[i] == ref.crc32c(block.tobytes())


BAD = [
    pytest.param(([1 << 21], [0], 16), "lies outside src", id="src-end"),
    pytest.param(([0], [(1 << 20) - 8], 16), "lies outside", id="dst-end"),
    pytest.param(([0, 0], [0], 16), "src_offsets but", id="counts"),
    pytest.param(([2**64 - 8], [0], 16), "lies outside", id="wraps"),
]


@pytest.mark.parametrize(("args", "says"), BAD)
def test_bad_ranges_copy_nothing(between: Between, args: tuple[list[int], list[int], int],
                                 says: str) -> None:
    src = np.full(1 << 21, 7, np.uint8)
    dst = np.zeros(1 << 20, np.uint8)
    so, do, length = args
    with pytest.raises(ValueError, match=says):
        between(src, [0, *so], dst, [64, *do], length)  # a good first block, then the bad
    assert not dst.any(), "a refused batch wrote something"


def test_overlap_and_read_only_are_refused() -> None:
    if _PURE:
        pytest.skip("the overlap check is the native helper's")
    buf = np.zeros(1 << 20, np.uint8)
    with pytest.raises(ValueError, match="overlap"):
        native.copy_crc32c_between(buf, [0], buf, [8], 64)
    with pytest.raises(ValueError, match="read-only"):
        native.copy_crc32c_between(buf, [0], bytes(128), [0], 64)
