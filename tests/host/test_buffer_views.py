"""The client's buffer views for a batch (ctxmem.buffers.Staged).

A batch of flat uint8 numpy arrays is viewed in one pass (``_flat_uint8_batch``); any
buffer that is not one sends the whole batch through the per-buffer checks, so the views
and the errors (naming the buffer's index) are the same either way.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ctxmem.buffers import Staged, _flat_uint8_batch
from ctxmem_common.errors import InvalidArgument

N = 4096


def _flat(k: int) -> list[np.ndarray]:
    return [np.full(N, i, np.uint8) for i in range(k)]


def test_flat_uint8_batch_views_each_array_in_place() -> None:
    bufs = _flat(5)
    views = _flat_uint8_batch(bufs, N, writable=True)
    assert views is not None and len(views) == 5
    for i, (buf, view) in enumerate(zip(bufs, views, strict=True)):
        assert view.format == "B" and view.nbytes == N and not view.readonly
        view[0] = 200 + i  # the same memory, not a copy
        assert buf[0] == 200 + i


class _Sub(np.ndarray):
    pass


@pytest.mark.parametrize("odd", [
    np.zeros(N, np.int8),  # not uint8 (each case fails exactly one of the checks)
    np.zeros((N, 1), np.uint8),  # not flat
    np.zeros(2 * N, np.uint8)[::2],  # not contiguous
    np.zeros(N + 1, np.uint8),  # not the block size
    np.zeros(N, np.uint8).view(_Sub),  # a subclass
    bytearray(N),  # not numpy
])
def test_one_odd_buffer_takes_the_whole_batch_off_the_batch_path(odd: Any) -> None:
    bufs: list[Any] = [*_flat(3), odd]
    assert _flat_uint8_batch(bufs, N, writable=True) is None


def test_read_only_refused_for_a_get_only() -> None:
    bufs = _flat(3)
    bufs[2].flags.writeable = False
    assert _flat_uint8_batch(bufs, N, writable=True) is None
    assert _flat_uint8_batch(bufs, N, writable=False) is not None
    with pytest.raises(InvalidArgument, match=r"buffers\[2\] is read-only"):
        Staged(bufs, N, writable=True)


def test_mixed_batch_views_the_same_bytes_and_names_the_bad_buffer() -> None:
    flat = _flat(3)
    mixed: list[Any] = [*flat, np.full(N // 2, 7, np.uint16), bytearray(b"\x09" * N)]
    views = Staged(mixed, N, writable=True).views
    assert [bytes(v) for v in views[:3]] == [bytes(b) for b in flat]
    assert bytes(views[3]) == b"\x07\x00" * (N // 2) and bytes(views[4]) == b"\x09" * N
    with pytest.raises(InvalidArgument, match=r"buffers\[1\] is 4097 bytes"):
        Staged([flat[0], np.zeros(N + 1, np.uint8)], N, writable=False)
    with pytest.raises(InvalidArgument, match=r"buffers\[1\]: numpy array is not C-cont"):
        Staged([flat[0], np.zeros(2 * N, np.uint8)[::2]], N, writable=False)
    assert Staged([], N, writable=True).views == []
