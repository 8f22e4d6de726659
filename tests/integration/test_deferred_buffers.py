"""A put's or get's buffers are viewed while the service answers its first Allocate or
Acquire (``ctxmem.buffers.DeferredStaged``, ``DataChannel.call(meanwhile=...)``). A bad
buffer is still refused with the same error, and the request it followed is undone: the
lease ended, the allocation aborted, no byte written into any buffer, nothing stored.
Real service, shared memory and TCP, each with the control fast path and over gRPC."""

from __future__ import annotations

import traceback
from collections.abc import Callable

import numpy as np
import pytest

import ctxmem
from ctxmem.buffers import DeferredStaged
from ctxmem_common.errors import Unavailable
from ctxmem_common.shm_ops import encode_keys_request
from ctxmem_common.wire import SHM_OP_LOOKUP
from tests.conftest import ServiceHandle
from tests.kit import blocks, byte_layout, salted_keys

SMALL = byte_layout(64 << 10)  # 64 KiB blocks
N = SMALL.block_nbytes
PATHS = [("shm", "1"), ("tcp", "1"), ("shm", "0"), ("tcp", "0")]  # (transport, fast ops)


def _read_only() -> np.ndarray:
    frozen = np.full(N, 9, np.uint8)
    frozen.flags.writeable = False
    return frozen


@pytest.mark.parametrize(("transport", "fast"), PATHS)
def test_a_bad_get_buffer_of_stored_blocks_ends_the_lease_and_writes_nothing(
        service_factory: Callable[..., ServiceHandle], monkeypatch: pytest.MonkeyPatch,
        transport: str, fast: str) -> None:
    """The blocks are stored, so the Acquire leases them before the buffers are looked
    at: the read-only buffer is refused by name, no other buffer is written, no lease is
    left, and the same get with good buffers then serves every block."""
    monkeypatch.setenv("CTXMEM_FAST_OPS", fast)
    svc = service_factory(encryption=False, flash_size=None, dram_size="128MiB")
    keys, data = salted_keys("get", 4), blocks(4, N, 1)
    with ctxmem.Client(svc.endpoint, transport=transport) as c:  # type: ignore[arg-type]
        ns = c.open_namespace(SMALL, model_id="deferred")
        assert ns.put(keys, data).stored == 4
        out = [np.zeros(N, np.uint8), np.zeros(N, np.uint8), _read_only(), np.zeros(N, np.uint8)]
        with pytest.raises(ctxmem.InvalidArgument, match=r"buffers\[2\] is read-only"):
            ns.get(keys, out)
        assert all(not o.any() for i, o in enumerate(out) if i != 2), "a buffer was written"
        assert (out[2] == 9).all()
        good = [np.zeros(N, np.uint8) for _ in keys]
        assert ns.get(keys, good) == 4
        assert all(np.array_equal(a, b) for a, b in zip(good, data, strict=True))
    assert svc.stats()["leases"] == 0, "the refused get left its lease"


@pytest.mark.parametrize(("transport", "fast"), PATHS)
def test_a_bad_put_buffer_aborts_the_allocation_and_stores_nothing(
        service_factory: Callable[..., ServiceHandle], monkeypatch: pytest.MonkeyPatch,
        transport: str, fast: str) -> None:
    """New keys, so the Allocate reserves slots before the buffers are looked at: the
    buffer of the wrong size is refused by name, the allocation is aborted (none left
    open), nothing is stored, and a put of good buffers then stores every block."""
    monkeypatch.setenv("CTXMEM_FAST_OPS", fast)
    svc = service_factory(encryption=False, flash_size=None, dram_size="128MiB")
    keys, data = salted_keys("put", 3), blocks(3, N, 2)
    with ctxmem.Client(svc.endpoint, transport=transport) as c:  # type: ignore[arg-type]
        ns = c.open_namespace(SMALL, model_id="deferred")
        with pytest.raises(ctxmem.InvalidArgument, match=r"buffers\[1\] is 100 bytes"):
            ns.put(keys, [data[0], np.zeros(100, np.uint8), data[2]])
        assert ns.lookup(keys).num_hits == 0, "a block of the refused put was stored"
        assert svc.stats()["allocations"] == 0, "the refused put left its allocation open"
        assert ns.put(keys, data).stored == 3
        # Every key stored now: the Allocate reserves nothing, the bad buffer is still
        # refused (not silently skipped as an existing block).
        with pytest.raises(ctxmem.InvalidArgument, match=r"buffers\[0\] is 100 bytes"):
            ns.put(keys[:1], [np.zeros(100, np.uint8)])
        out = [np.zeros(N, np.uint8) for _ in keys]
        assert ns.get(keys, out) == 3
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
    assert svc.stats()["allocations"] == 0


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_the_buffers_are_viewed_while_the_request_is_outstanding(
        service_factory: Callable[..., ServiceHandle], monkeypatch: pytest.MonkeyPatch,
        transport: str) -> None:
    """On the fast path the views are built inside the channel's call, after the
    ACQUIRE / ALLOCATE was sent and before its answer is read (the overlap this is for)."""
    svc = service_factory(encryption=False, flash_size=None, dram_size="128MiB")
    where: list[list[str]] = []
    prepare = DeferredStaged.prepare

    def recording(self: DeferredStaged) -> None:
        where.append([f.name for f in traceback.extract_stack()])
        prepare(self)

    monkeypatch.setattr(DeferredStaged, "prepare", recording)
    keys, data = salted_keys("overlap", 8), blocks(8, N, 3)
    with ctxmem.Client(svc.endpoint, transport=transport) as c:  # type: ignore[arg-type]
        ns = c.open_namespace(SMALL, model_id="deferred")
        assert c._sessions["default"].channel.ops, "the fast path was not negotiated"
        assert ns.put(keys, data).stored == 8
        assert where and all("_meanwhile" in stack for stack in where[:1]), where[:1]
        where.clear()
        assert ns.get(keys, [np.zeros(N, np.uint8) for _ in keys]) == 8
        assert where and "_meanwhile" in where[0], "the get viewed its buffers before asking"


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_meanwhile_that_raises_breaks_the_channel_and_the_client_reconnects(
        service_factory: Callable[..., ServiceHandle], transport: str) -> None:
    """If the work run while waiting raises, the answer is left unread in the stream: the
    channel must not be used again (its next call says why), and the next namespace call
    reconnects and is answered correctly."""
    svc = service_factory(encryption=False, flash_size=None, dram_size="128MiB")
    keys, data = salted_keys("broken", 2), blocks(2, N, 4)
    with ctxmem.Client(svc.endpoint, transport=transport) as c:  # type: ignore[arg-type]
        ns = c.open_namespace(SMALL, model_id="deferred")
        assert ns.put(keys, data).stored == 2
        ch = c._sessions["default"].channel
        assert ch.ops, "the fast path was not negotiated"

        def boom() -> None:
            raise KeyboardInterrupt

        body = encode_keys_request(ns.handle, b"".join(keys), len(keys[0]), prefix=True)
        with pytest.raises(KeyboardInterrupt):
            ch.call(SHM_OP_LOOKUP, body, meanwhile=boom)
        with pytest.raises(Unavailable, match="interrupted before its answer was read"):
            ch.call(SHM_OP_LOOKUP, body)
        assert ns.lookup(keys).num_hits == 2  # on a new channel
        assert c._sessions["default"].channel is not ch
