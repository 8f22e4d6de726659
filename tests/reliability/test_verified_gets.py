"""Issue 13, case 1 (shim side) and case 5: every get checks each block's CRC32C in the
same pass as its copy into the caller's buffer, scrubs (zeroes) the buffer of a block that
failed, and leaves every buffer after it untouched: no buffer ever holds wrong bytes,
whatever happened to the block's bytes in DRAM (before or during the copy), whenever the
lease expired, whether the service went away between batches.

The bytes of a committed block are changed in DRAM by a raw client that maps the slab
(it acquired the block, so it may map the region, and a shared-memory mapping is
writable): the shim must not trust the slab.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import ctxmem
from ctxmem.transport import shm as shm_mod
from ctxmem.transport.base import TransportError
from ctxmem.transport.shm import ShmChannel
from ctxmem.transport.verified import ReadProgress, check_landed, copy_checked
from ctxmem_common.codecs import copy_crc32c, copy_crc32c_from_slots, crc32c
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.wire import SHM_OP_ACQUIRE, SHM_OP_RELEASE
from tests.adversary.raw import RawAllocation, RawSession
from tests.reliability.sentinel import BLOCK, LAYOUT, SENTINEL, content, get_checked, keys

N = 8
REAL_FROM_SLOTS = copy_crc32c_from_slots


def corrupt(raw: RawSession, key: bytes) -> None:
    """Change one byte of ``key``'s committed block in DRAM, through ``raw``'s mapping."""
    a = raw.call("Acquire", pb.AcquireRequest(session_id=raw.session_id,
                                               namespace_handle=raw.handle, keys=[key]))
    assert a.num_acquired == 1
    bad = bytearray(content(key))
    bad[BLOCK // 2] ^= 0xFF
    raw.write(RawAllocation(0, [a.slots[0]], [True]), [bytes(bad)])
    raw.call("Release", pb.ReleaseRequest(session_id=raw.session_id, lease_ids=[a.lease_id]))


_FAST_NAMES = {SHM_OP_ACQUIRE: "Acquire", SHM_OP_RELEASE: "Release"}


def on_calls(c: ctxmem.Client, monkeypatch: pytest.MonkeyPatch,
             hook: Callable[[str, int], None]) -> None:
    """Call ``hook(method, number of keys)`` before each Acquire or Release, whether it
    goes over gRPC or over the shared-memory fast path (``ShmChannel.call``)."""
    rpc = c._rpc
    call = ShmChannel.call

    def via_rpc(method: str, request: Any) -> Any:
        hook(method, len(getattr(request, "keys", ())))
        return rpc(method, request)

    def via_fast(self: ShmChannel, op: int, parts: Any, reply: bool = True,
                 meanwhile: Callable[[], None] | None = None) -> bytes:
        if op in _FAST_NAMES:
            n = len(parts[1]) // int.from_bytes(parts[0][4:8], "little") \
                if op == SHM_OP_ACQUIRE else 0
            hook(_FAST_NAMES[op], n)
        return call(self, op, parts, reply, meanwhile)

    monkeypatch.setattr(c, "_rpc", via_rpc)
    monkeypatch.setattr(ShmChannel, "call", via_fast)


@pytest.fixture(params=["1", "0"], ids=["fast", "grpc"])
def fast(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The shared-memory control fast path on (the default) and off (CTXMEM_SHM_OPS=0)."""
    monkeypatch.setenv("CTXMEM_SHM_OPS", request.param)
    return str(request.param)


@pytest.fixture
def svc(service_factory: Callable[..., Any]) -> Any:
    return service_factory(transports=["shm", "tcp"], flash_size=None, lease_ttl_s=1.0)


BlockCopy = Callable[[int, memoryview, memoryview, "int | None"], bool]


def copy_one(src: memoryview, dst: memoryview, want: int | None) -> bool:
    """One block as the channel's batch copy does it (fused copy + CRC, scrub on a
    mismatch; a plain copy unverified)."""
    done, _bad = REAL_FROM_SLOTS(src, [0], [src.nbytes], [dst], None if want is None else [want])
    return done == 1


def block_by_block(copy: BlockCopy) -> Callable[..., tuple[int, int | None]]:
    """A stand-in for the channel's batch copy that goes block by block through ``copy``
    (block index counted over the whole get), so a test can act between two blocks."""
    count = 0

    def batch(region: memoryview, offsets: list[int], lengths: list[int],
              dsts: list[memoryview], crcs: list[int] | None = None) -> tuple[int, int | None]:
        nonlocal count
        r = memoryview(region)
        for i, (off, n, dst) in enumerate(zip(offsets, lengths, dsts, strict=True)):
            block = count
            count += 1
            if not copy(block, r[off : off + n], dst, None if crcs is None else crcs[i]):
                return i, i
        return len(dsts), None

    return batch


@pytest.fixture
def raw(svc: Any) -> Iterator[RawSession]:
    with RawSession(svc.endpoint, LAYOUT, model_id="m") as r:
        yield r


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_block_changed_in_dram_is_a_miss_and_nothing_past_it_is_written(
        svc: Any, raw: RawSession, transport: str) -> None:
    ks = keys(transport, N)
    with ctxmem.Client(svc.endpoint, transport=transport) as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        assert ns.put(ks, [content(k) for k in ks]).stored == N
        corrupt(raw, ks[5])
        assert get_checked(ns, ks, scrubbed=True) == 5
        assert get_checked(ns, ks[:5]) == 5


def test_expired_lease_keeps_the_verified_blocks(
        svc: Any, raw: RawSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease expires while block 3 is copied and block 5 changes meanwhile: blocks
    0-4 passed their check and count; 5 fails and is scrubbed, 6 and 7 are not written."""
    ks = keys("lease", N)

    def slow_copy(block: int, src: memoryview, dst: memoryview, want: int | None) -> bool:
        ok = copy_one(src, dst, want)
        if block == 3:
            corrupt(raw, ks[5])
            time.sleep(1.6)  # past lease_ttl_s: Release will say the lease expired
        return ok

    with ctxmem.Client(svc.endpoint, transport="shm") as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        assert ns.put(ks, [content(k) for k in ks]).stored == N
        monkeypatch.setattr(shm_mod, "copy_crc32c_from_slots", block_by_block(slow_copy))
        assert get_checked(ns, ks, scrubbed=True) == 5


def test_unverified_get_whose_lease_expired_is_a_miss(
        svc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``verify_gets=False`` on shared memory, a channel that ``maps_slots`` (nothing on
    the service's side checks the lease while the shim copies out of the slab): a lease
    that expired during the copy makes the batch a miss, its slots may have been reused
    meanwhile. The same get with the lease still valid at Release returns every block."""
    ks = keys("unverified-lease", N)

    def slow_copy(block: int, src: memoryview, dst: memoryview, want: int | None) -> bool:
        ok = copy_one(src, dst, want)
        if block == 3:
            time.sleep(1.6)  # past lease_ttl_s: Release will say the lease expired
        return ok

    with ctxmem.Client(svc.endpoint, transport="shm", verify_gets=False) as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        assert c._sessions["default"].channel.maps_slots
        assert ns.put(ks, [content(k) for k in ks]).stored == N
        monkeypatch.setattr(shm_mod, "copy_crc32c_from_slots", block_by_block(slow_copy))
        assert ns.get(ks, [bytearray(BLOCK) for _ in ks]) == 0
        monkeypatch.setattr(shm_mod, "copy_crc32c_from_slots", REAL_FROM_SLOTS)
        out = [bytearray(BLOCK) for _ in ks]
        assert ns.get(ks, out) == N
        assert [bytes(o) for o in out] == [content(k) for k in ks]


@pytest.mark.parametrize("changed", ["copied", "not_yet_copied"])
def test_slot_changed_mid_copy_never_yields_a_wrong_block(
        svc: Any, monkeypatch: pytest.MonkeyPatch, changed: str) -> None:
    """A writer changes block 3's slot while it is being copied out (the copy is split in
    two halves with the change in between, through the client's own writable mapping of
    the slab). A byte the copy already stored: the buffer holds the committed bytes, which
    is what was checked, so the block is delivered, exact. A byte not copied yet: the
    buffer would hold it, so the check fails, the buffer is scrubbed and the run ends."""
    ks = keys(f"midcopy-{changed}", N)

    def racy_copy(block: int, src: memoryview, dst: memoryview, want: int | None) -> bool:
        if block != 3 or want is None:
            return copy_one(src, dst, want)
        half = src.nbytes // 2
        crc = copy_crc32c(src[:half], dst[:half])
        at = half // 2 if changed == "copied" else half + half // 2
        src[at] ^= 0xFF  # the slot itself, as any mapper of the slab could
        return check_landed(dst, copy_crc32c(src[half:], dst[half:], crc), want)

    with ctxmem.Client(svc.endpoint, transport="shm") as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        assert ns.put(ks, [content(k) for k in ks]).stored == N
        monkeypatch.setattr(shm_mod, "copy_crc32c_from_slots", block_by_block(racy_copy))
        if changed == "copied":
            assert get_checked(ns, ks[:4]) == 4
        else:
            assert get_checked(ns, ks, scrubbed=True) == 3


@pytest.mark.parametrize(("when", "served"), [("before_acquire", 2), ("before_release", 4)])
def test_service_restart_between_batches_leaves_later_buffers_untouched(
        svc: Any, monkeypatch: pytest.MonkeyPatch, when: str, served: int, fast: str
) -> None:
    """Batches of two blocks; the DRAM-only service restarts (losing every block) before
    the second batch's Acquire, or after its copy and before its Release. Blocks already
    verified count; nothing past them is written."""
    ks = keys("restart", N)
    with ctxmem.Client(svc.endpoint, transport="shm", max_batch_bytes=2 * BLOCK) as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        assert ns.put(ks, [content(k) for k in ks]).stored == N
        assert isinstance(c._sessions["default"].channel, ShmChannel)
        assert c._sessions["default"].channel.ops == (fast == "1")
        seen = {"Acquire": 0, "Release": 0}
        method_at = "Acquire" if when == "before_acquire" else "Release"

        def restart_once(method: str, n: int) -> None:
            if method in seen:
                seen[method] += 1
                if method == method_at and seen[method] == 2:
                    svc.restart()

        on_calls(c, monkeypatch, restart_once)
        assert get_checked(ns, ks) == served


def test_a_retry_goes_on_from_the_first_undelivered_block(
        svc: Any, monkeypatch: pytest.MonkeyPatch, fast: str) -> None:
    """A channel that fails after delivering three blocks: the retry acquires only the
    other five, and the get returns all eight."""
    ks = keys("retry", N)
    real = ShmChannel.read_packed  # a shm get reads Acquire's packed answer
    failed = False

    def flaky(self: ShmChannel, lease_id: bytes, slots: Any, views: Any, verify: bool,
              progress: ReadProgress) -> None:
        nonlocal failed
        if not failed:
            failed = True
            real(self, lease_id, slots, views[:3], verify, progress)
            raise TransportError("injected: channel dropped after three blocks")
        real(self, lease_id, slots, views, verify, progress)

    with ctxmem.Client(svc.endpoint, transport="shm") as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        assert ns.put(ks, [content(k) for k in ks]).stored == N
        acquired: list[int] = []

        def spy(method: str, n: int) -> None:
            if method == "Acquire":
                acquired.append(n)

        on_calls(c, monkeypatch, spy)
        monkeypatch.setattr(ShmChannel, "read_packed", flaky)
        assert get_checked(ns, ks) == N
        assert acquired == [N, N - 3]


def test_unverified_get_still_works(svc: Any) -> None:
    ks = keys("unverified", N)
    with ctxmem.Client(svc.endpoint, transport="shm", verify_gets=False) as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        assert ns.put(ks, [content(k) for k in ks]).stored == N
        assert get_checked(ns, ks) == N


def test_copy_checked_scrubs_a_mismatch() -> None:
    src = memoryview(np.arange(3 * BLOCK + 7, dtype=np.uint64).view(np.uint8))
    dst = bytearray([SENTINEL]) * src.nbytes
    assert not copy_checked(src, memoryview(dst), crc32c(src) ^ 1)
    assert dst.count(0) == len(dst), "a block that failed leaves zeros, not its bytes"
    assert copy_checked(src, memoryview(dst), crc32c(src))
    assert bytes(dst) == bytes(src)
