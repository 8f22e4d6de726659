"""Issue 17 item 3: Acquire's packed answer (ctxmem_common.packed_slots).

A shared-memory session that sets ``want_packed`` gets its slots as little-endian arrays
instead of ``Slot`` messages; TCP sessions and clients that do not ask keep the repeated
``slots``; the client reads either form, and nothing in a malformed packed answer makes
it read outside its mapping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import ctxmem
from ctxmem.transport.base import TransportError
from ctxmem.transport.shm import ShmChannel
from ctxmem.transport.verified import ReadProgress
from ctxmem_common.codecs import crc32c
from ctxmem_common.layout import KVLayout
from ctxmem_common.packed_slots import PackedSlots, pack_acquire, unpack_acquire
from ctxmem_common.proto import ctxmem_pb2 as pb
from tests.adversary.raw import RawSession
from tests.kit import blocks, byte_layout, keys


def layout(nbytes: int) -> KVLayout:
    return byte_layout(nbytes)


@pytest.fixture
def svc(service_factory: Callable[..., Any]) -> Any:
    return service_factory(transports=["shm", "tcp"], flash_size=None)


def _acquire(raw: RawSession, ks: list[bytes], packed: bool) -> Any:
    return raw.call("Acquire", pb.AcquireRequest(
        session_id=raw.session_id, namespace_handle=raw.handle, keys=ks,
        want_packed=packed))


def _release(raw: RawSession, a: Any) -> None:
    raw.call("Release", pb.ReleaseRequest(session_id=raw.session_id, lease_ids=[a.lease_id]))


@pytest.fixture
def stored(svc: Any) -> Iterator[tuple[RawSession, list[bytes], list[np.ndarray]]]:
    """A raw shm session of 64 KiB blocks, 6 of them stored by a client."""
    lay = layout(64 << 10)
    ks, data = keys("raw", 6), blocks(6, 64 << 10, 1)
    with ctxmem.Client(svc.endpoint, transport="shm") as c:
        assert c.open_namespace(lay, model_id="m").put(ks, data).stored == 6
    with RawSession(svc.endpoint, lay, model_id="m") as raw:
        yield raw, ks, data


def test_packed_answer_holds_the_same_slots(
        stored: tuple[RawSession, list[bytes], list[np.ndarray]]) -> None:
    raw, ks, data = stored
    old = _acquire(raw, ks, packed=False)
    new = _acquire(raw, ks, packed=True)
    try:
        assert old.num_acquired == new.num_acquired == 6
        assert len(old.slots) == 6 and not old.slot_regions  # old clients: repeated slots
        assert not new.slots and not new.crc32c  # packed: the arrays only
        assert len(new.slot_offsets) == 6 * 8 and len(new.slot_crcs) == 6 * 4
        a, b = unpack_acquire(old, 6, 64 << 10), unpack_acquire(new, 6, 64 << 10)
        assert a.regions == b.regions and a.generations == b.generations
        assert a.lengths == b.lengths == [64 << 10] * 6
        assert b.crcs == [crc32c(d) for d in data] == a.crcs
        assert sorted(b.offsets) == sorted(a.offsets)  # two leases, same blocks
        assert len(set(zip(b.regions, b.offsets, strict=True))) == 6
    finally:
        _release(raw, old)
        _release(raw, new)


def test_tcp_session_keeps_the_repeated_slots(svc: Any) -> None:
    lay = layout(64 << 10)
    ks = keys("tcp", 3)
    with ctxmem.Client(svc.endpoint, transport="tcp") as c:
        assert c.open_namespace(lay, model_id="m").put(ks, blocks(3, 64 << 10, 2)).stored == 3
    with RawSession(svc.endpoint, lay, model_id="m", transport="tcp") as raw:
        a = _acquire(raw, ks, packed=True)
        _release(raw, a)
    assert a.num_acquired == 3 and len(a.slots) == 3 and not a.slot_regions


@pytest.mark.parametrize("nbytes", [64 << 10, 2 << 20])
@pytest.mark.parametrize("service_packs", [True, False], ids=["packed", "old-service"])
def test_shm_get_exact_bytes_in_either_form(
        svc: Any, monkeypatch: pytest.MonkeyPatch, nbytes: int, service_packs: bool) -> None:
    """The client over shm asks for the packed form; against a service that ignores the
    flag (simulated by clearing it on the way out) it reads the repeated slots."""
    seen: list[bool] = []
    n = 12 if nbytes == 64 << 10 else 4
    ks, data = keys(f"get{nbytes}{service_packs}", n), blocks(n, nbytes, nbytes)
    monkeypatch.setenv("CTXMEM_SHM_OPS", "0")  # the gRPC Acquire's forms, not the fast path
    with ctxmem.Client(svc.endpoint, transport="shm") as c:
        real = c._rpc

        def rpc(method: str, request: Any) -> Any:
            if method == "Acquire":
                if not service_packs:
                    request.want_packed = False
                r = real(method, request)
                seen.append(bool(r.slot_regions))
                return r
            return real(method, request)

        monkeypatch.setattr(c, "_rpc", rpc)
        ns = c.open_namespace(layout(nbytes), model_id="m")
        assert ns.put(ks, data).stored == n
        out = [np.zeros(nbytes, dtype=np.uint8) for _ in range(n)]
        assert ns.get(ks, out) == n
    assert seen and all(s == service_packs for s in seen)
    for got, want in zip(out, data, strict=True):
        assert np.array_equal(got, want)


def _packed(n: int, nbytes: int, **override: bytes) -> pb.AcquireResponse:
    r = pb.AcquireResponse(lease_id=b"L" * 16, num_acquired=n)
    pack_acquire(r, [1] * n, [0] * n, [i * nbytes for i in range(n)], [nbytes] * n,
                 list(range(n)))
    for name, value in override.items():
        setattr(r, name, value)
    return r


def test_unpack_checks_every_field() -> None:
    ok = unpack_acquire(_packed(3, 4096), 3, 4096)
    assert ok.offsets == [0, 4096, 8192] and ok.crcs == [0, 1, 2] and len(ok) == 3
    with pytest.raises(ValueError, match="num_acquired=3 but only 2"):
        unpack_acquire(_packed(3, 4096), 2, 4096)
    for name, width in [("slot_regions", 4), ("slot_generations", 4), ("slot_offsets", 8),
                        ("slot_lengths", 8), ("slot_crcs", 4)]:
        with pytest.raises(ValueError, match=f"{name} is {3 * width - 1} bytes"):
            r = _packed(3, 4096)
            unpack_acquire(_packed(3, 4096, **{name: getattr(r, name)[:-1]}), 3, 4096)
    with pytest.raises(ValueError, match="differ from the block size 8192"):
        unpack_acquire(_packed(3, 4096), 3, 8192)
    with pytest.raises(ValueError, match="slot_regions is 0 bytes"):  # arrays missing
        unpack_acquire(pb.AcquireResponse(lease_id=b"L" * 16, num_acquired=2), 2, 4096)
    old = pb.AcquireResponse(lease_id=b"L" * 16, num_acquired=2,
                             slots=[pb.Slot(region=1, offset=0, length=4096)], crc32c=[1])
    with pytest.raises(ValueError, match="1 slots and 1 CRCs"):
        unpack_acquire(old, 2, 4096)


def test_slot_outside_the_mapping_is_refused_before_any_copy(
        stored: tuple[RawSession, list[bytes], list[np.ndarray]]) -> None:
    """A hostile answer naming a real region but an offset past its end: TransportError
    before any copy (every slot of the batch is checked first): no block delivered, every
    buffer untouched."""
    raw, ks, _data = stored
    assert isinstance(raw.data, ShmChannel)
    a = _acquire(raw, ks[:2], packed=True)
    try:
        good = unpack_acquire(a, 2, 64 << 10)
        size = raw.data._region(good.regions[0], good.generations[0]).nbytes
        for off in (size - (64 << 10) + 1, size, 2**64 - 1):
            bad = PackedSlots(good.regions, good.generations, [good.offsets[0], off],
                              good.lengths, good.crcs)
            out = [bytearray(b"\x07" * (64 << 10)) for _ in range(2)]
            progress = ReadProgress()
            with pytest.raises(TransportError, match=r"slot 1 .* outside region"):
                raw.data.read_packed(a.lease_id, bad, [memoryview(b) for b in out], True,
                                     progress)
            assert progress.done == 0 and progress.bad is None
            assert out == [b"\x07" * (64 << 10)] * 2
    finally:
        _release(raw, a)


def test_packed_read_stops_at_a_mismatch(
        stored: tuple[RawSession, list[bytes], list[np.ndarray]]) -> None:
    raw, ks, data = stored
    assert isinstance(raw.data, ShmChannel)
    a = _acquire(raw, ks[:4], packed=True)
    try:
        good = unpack_acquire(a, 4, 64 << 10)
        crcs = list(good.crcs)
        crcs[2] ^= 1
        bad = PackedSlots(good.regions, good.generations, good.offsets, good.lengths, crcs)
        out = [bytearray(b"\x07" * (64 << 10)) for _ in range(4)]
        progress = ReadProgress()
        raw.data.read_packed(a.lease_id, bad, [memoryview(b) for b in out], True, progress)
    finally:
        _release(raw, a)
    assert progress.done == 2 and progress.bad == 2
    assert [bytes(b) for b in out[:2]] == [d.tobytes() for d in data[:2]]
    assert out[2] == bytes(64 << 10)  # scrubbed
    assert out[3] == b"\x07" * (64 << 10)  # untouched
