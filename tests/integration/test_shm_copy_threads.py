"""A shared-memory batch copied by several threads (``Client(copy_threads=...)``,
``ShmChannel.read_packed`` / ``write_packed``) against a real service.

The contract: the read is the same as a single-threaded one as seen by the caller —
``done`` is the index of the first block that fails its CRC32C, that buffer is zeroed, no
block after it is reported delivered, and a buffer after it holds zeros (another part had
already written it: scrubbed) or is untouched, never other bytes. Puts and gets split
across threads move exact bytes. ``COPY_THREADS_MIN_BYTES`` is lowered so that a small
batch is split (the split is by block count, so which buffers another part wrote is known).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import ctxmem
from ctxmem.transport import shm as shm_mod
from ctxmem.transport.base import TransportError
from ctxmem.transport.shm import ShmChannel
from ctxmem.transport.verified import ReadProgress
from ctxmem_common.errors import InvalidArgument, Unavailable
from ctxmem_common.packed_slots import PackedSlots, unpack_acquire
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.shm_ops import encode_release
from ctxmem_common.wire import SHM_OP_RELEASE
from tests.adversary.raw import RawSession
from tests.kit import blocks, byte_layout, keys

BLOCK = 64 << 10
N = 8
SENTINEL = 0x07
LAYOUT = byte_layout(BLOCK)


@pytest.fixture
def split_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_mod, "COPY_THREADS_MIN_BYTES", 0)


@pytest.fixture
def svc(service_factory: Callable[..., Any]) -> Any:
    return service_factory(transports=["shm"], flash_size=None)


@pytest.fixture
def stored(svc: Any) -> Iterator[tuple[RawSession, list[bytes], list[np.ndarray]]]:
    ks, data = keys("threads", N), blocks(N, BLOCK, 3)
    with ctxmem.Client(svc.endpoint, transport="shm", copy_threads=1) as c:
        assert c.open_namespace(LAYOUT, model_id="m").put(ks, data).stored == N
    with RawSession(svc.endpoint, LAYOUT, model_id="m") as raw:
        yield raw, ks, data


def _read(raw: RawSession, ks: list[bytes], threads: int, bad: list[int],
          verify: bool = True, progress: ReadProgress | None = None
          ) -> tuple[ReadProgress, list[bytearray]]:
    """read_packed of ``ks`` with ``threads`` copy threads and the committed CRCs of the
    blocks in ``bad`` altered (as if their slots had changed)."""
    ch = raw.data
    assert isinstance(ch, ShmChannel)
    ch.copy_threads = threads
    a = raw.call("Acquire", pb.AcquireRequest(session_id=raw.session_id,
                                              namespace_handle=raw.handle, keys=ks,
                                              want_packed=True))
    try:
        good = unpack_acquire(a, len(ks), BLOCK)
        crcs = [c ^ 1 if i in bad else c for i, c in enumerate(good.crcs)]
        slots = PackedSlots(good.regions, good.generations, good.offsets, good.lengths, crcs)
        out = [bytearray([SENTINEL]) * BLOCK for _ in ks]
        progress = ReadProgress() if progress is None else progress
        ch.read_packed(a.lease_id, slots, [memoryview(b) for b in out], verify, progress)
    finally:
        raw.call("Release", pb.ReleaseRequest(session_id=raw.session_id,
                                              lease_ids=[a.lease_id]))
    return progress, out


@pytest.mark.usefixtures("split_everything")
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("bad", [[0], [3], [N - 1], [2, 5]])
def test_a_split_read_stops_at_the_first_mismatch(
        stored: tuple[RawSession, list[bytes], list[np.ndarray]], threads: int,
        bad: list[int]) -> None:
    raw, ks, data = stored
    progress, out = _read(raw, ks, threads, bad)
    first = bad[0]
    assert (progress.done, progress.bad) == (first, first)
    for i in range(first):
        assert out[i] == data[i].tobytes(), f"block {i} before the failed one delivered"
    assert out[first] == bytes(BLOCK), "the failed block's buffer is zeroed"
    cuts = [N * j // threads for j in range(threads + 1)]
    part_of_first = next(j for j in range(threads) if cuts[j] <= first < cuts[j + 1])
    for i in range(first + 1, N):
        # A later part ran to its end, or to its own failed block, and what it wrote was
        # scrubbed; the rest of the failed block's own part was never written.
        j = next(j for j in range(threads) if cuts[j] <= i < cuts[j + 1])
        own_bad = [b for b in bad if cuts[j] <= b < cuts[j + 1]]
        written = j > part_of_first and (not own_bad or i <= own_bad[0])
        want = bytes(BLOCK) if written else bytes([SENTINEL]) * BLOCK
        assert out[i] == want, f"block {i} after the failed one ({threads} threads)"


@pytest.mark.usefixtures("split_everything")
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("verify", [True, False])
def test_a_split_read_delivers_every_block(
        stored: tuple[RawSession, list[bytes], list[np.ndarray]], threads: int,
        verify: bool) -> None:
    raw, ks, data = stored
    progress, out = _read(raw, ks, threads, [], verify)
    assert (progress.done, progress.bad) == (N, None)
    assert out == [d.tobytes() for d in data]


@pytest.mark.usefixtures("split_everything")
@pytest.mark.parametrize("threads", [2, 3])
def test_split_puts_and_gets_move_exact_bytes(svc: Any, threads: int) -> None:
    """Through the Client: a put whose copy+CRC is split across threads is committed (the
    service checks every CRC) and a split get returns exactly those bytes, across two
    batches."""
    ks, data = keys(f"e2e{threads}", 2 * N), blocks(2 * N, BLOCK, threads)
    with ctxmem.Client(svc.endpoint, transport="shm", copy_threads=threads,
                       max_batch_bytes=N * BLOCK) as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        assert ns.put(ks, data).stored == 2 * N
        out = [np.zeros(BLOCK, dtype=np.uint8) for _ in ks]
        assert ns.get(ks, out) == 2 * N
        ch = c._sessions["default"].channel
        assert isinstance(ch, ShmChannel) and ch.copy_threads == threads
        assert ch._pool is not None, "the batch was split"
    for got, want in zip(out, data, strict=True):
        assert np.array_equal(got, want)


def test_copy_threads_option(svc: Any) -> None:
    with pytest.raises(InvalidArgument, match="copy_threads=0"):
        ctxmem.Client(svc.endpoint, transport="shm", copy_threads=0)
    with ctxmem.Client(svc.endpoint, transport="shm") as c:
        c.open_namespace(LAYOUT, model_id="m")
        ch = c._sessions["default"].channel
        assert isinstance(ch, ShmChannel)
        assert ch.copy_threads == c.copy_threads >= 1


@pytest.mark.usefixtures("split_everything")
def test_a_stalled_copy_thread_breaks_the_channel_after_its_timeout(
        stored: tuple[RawSession, list[bytes], list[np.ndarray]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait on a helper thread is bounded by the channel's timeout: a part still
    copying then makes the read raise, with the first part's blocks delivered, and
    the channel refuses further use (the client reconnects)."""
    raw, ks, _data = stored
    ch = raw.data
    assert isinstance(ch, ShmChannel)
    real = shm_mod.copy_crc32c_from_slots
    release = threading.Event()

    def stalled(*args: Any) -> tuple[int, int | None]:
        if threading.current_thread() is not threading.main_thread():
            release.wait(30)
        return real(*args)

    monkeypatch.setattr(shm_mod, "copy_crc32c_from_slots", stalled)
    monkeypatch.setattr(ch, "_timeout_s", 0.3)
    try:
        progress = ReadProgress()
        with pytest.raises(TransportError, match=r"did not finish within 0\.3 s"):
            _read(raw, ks, 2, [], progress=progress)
        assert (progress.done, progress.bad) == (N // 2, None), "the first part counts"
        with pytest.raises(Unavailable, match="broken"):
            ch.call(SHM_OP_RELEASE, [encode_release([], no_reply=False)])
    finally:
        release.set()
