"""Verified reads of the channels that need no service: RDMA's landing rounds (with its
transfer stood in, no verbs) and the default per-block read of :class:`DataChannel`.
Each delivers only blocks whose CRC32C matches and stops at the first that does not
(RDMA leaves that block's buffer untouched, the default read scrubs it)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

import ctxmem.transport.rdma as rdma_mod
from ctxmem.transport.base import DataChannel, Grant
from ctxmem.transport.rdma import RdmaChannel
from ctxmem.transport.rdma_buffers import landing_rounds
from ctxmem.transport.verified import ReadProgress
from ctxmem_common.codecs import crc32c
from ctxmem_common.proto import ctxmem_pb2 as pb
from tests import kit

SENTINEL = 0xA5


def _blocks(n: int, size: int) -> list[bytes]:
    return [b.tobytes() for b in kit.blocks(n, size, 7)]


class _FakeRdma(RdmaChannel):
    """The channel with its transfer replaced by a copy from ``remote`` (addr -> bytes)."""

    def __init__(self, remote: dict[int, bytes]) -> None:  # no verbs: skip the real init
        self.remote = remote
        self.rounds: list[int] = []
        self._landing = np.empty(0, dtype=np.uint8)

    def transfer(self, op: str, items: Sequence[tuple[memoryview, int, int]]) -> None:
        assert op == "read"
        self.rounds.append(len(items))
        for view, raddr, _rkey in items:
            view[:] = self.remote[raddr]


@pytest.mark.parametrize("bad", [None, 0, 5])
def test_rdma_verified_read_delivers_only_checked_blocks(
        monkeypatch: pytest.MonkeyPatch, bad: int | None) -> None:
    size = 64 << 10
    blocks = _blocks(8, size)
    crcs = [crc32c(b) for b in blocks]
    remote = {0x1000 * (i + 1): b for i, b in enumerate(blocks)}
    if bad is not None:
        remote[0x1000 * (bad + 1)] = bytes(size)  # changed after commit
    monkeypatch.setattr(rdma_mod, "LANDING_BYTES", 3 * size)
    ch = _FakeRdma(remote)
    slots = [pb.Slot(length=size, remote_addr=0x1000 * (i + 1), rkey=9) for i in range(8)]
    dst = [bytearray([SENTINEL]) * size for _ in range(8)]
    progress = ReadProgress()
    ch.read_verified(b"\x01" * 16, slots, [memoryview(d) for d in dst], crcs, progress)
    good = 8 if bad is None else bad
    assert progress.done == good and progress.bad == bad
    for i in range(good):
        assert bytes(dst[i]) == blocks[i]
    for i in range(good, 8):
        assert dst[i].count(SENTINEL) == size
    assert all(r <= 3 for r in ch.rounds)  # rounds of at most LANDING_BYTES


class _PerBlock(DataChannel):
    name = "fake"

    def __init__(self, remote: list[bytes]) -> None:
        self.remote = remote

    def write(self, allocation_id: int, slots: Sequence[pb.Slot],
              views: Sequence[memoryview]) -> None:
        raise NotImplementedError

    def read(self, lease_id: int, slots: Sequence[pb.Slot],
             views: Sequence[memoryview]) -> None:
        for slot, v in zip(slots, views, strict=True):
            v[:] = self.remote[slot.offset]

    def _write_grant(self, grant: Grant, views: Sequence[memoryview]) -> list[int]:
        raise NotImplementedError

    def _read_grant(self, grant: Grant, views: Sequence[memoryview], verify: bool,
                    progress: ReadProgress) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def test_default_verified_read_stops_at_the_first_bad_block() -> None:
    size = 4096
    blocks = _blocks(4, size)
    crcs = [crc32c(b) for b in blocks]
    remote = list(blocks)
    remote[2] = bytes(size)
    ch = _PerBlock(remote)
    dst = [bytearray([SENTINEL]) * size for _ in range(4)]
    progress = ReadProgress()
    ch.read_verified(b"\x01" * 16, [pb.Slot(offset=i, length=size) for i in range(4)],
                     [memoryview(d) for d in dst], crcs, progress)
    assert (progress.done, progress.bad) == (2, 2)
    assert [bytes(d) for d in dst[:2]] == blocks[:2]
    assert dst[2].count(0) == size  # the failed block is scrubbed
    assert all(d.count(SENTINEL) == size for d in dst[3:])


def test_landing_rounds_hold_whole_blocks_within_capacity() -> None:
    assert landing_rounds([4, 4, 4, 4, 4], 8) == [(0, 2), (2, 4), (4, 5)]
    assert landing_rounds([10, 2, 2], 8) == [(0, 1), (1, 3)]  # too big: a round alone
    assert landing_rounds([], 8) == []
