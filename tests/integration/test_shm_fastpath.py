"""The shared-memory control fast path (Acquire/Release, Lookup, Allocate/Commit as binary
frames on the data socket) against the real service: exact bytes, the same answers as
gRPC, the reconnect after a restart, and both sides of the negotiation (an old client, an
old service)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import ctxmem
from ctxmem.transport.shm import ShmChannel
from tests.conftest import ServiceHandle
from tests.kit import blocks, byte_layout, salted_keys

BIG = byte_layout(2 << 20)  # 2 MiB blocks (K and V)
SMALL = byte_layout(64 << 10)  # 64 KiB blocks
FAST_OPS = ("shm_ops_acquire", "shm_ops_release", "shm_ops_lookup", "shm_ops_allocate",
            "shm_ops_commit")


def _fast_counts(svc: ServiceHandle) -> dict[str, float]:
    stats = svc.stats()
    return {k: stats[k] for k in FAST_OPS}


def _channel(client: ctxmem.Client) -> ShmChannel:
    ch = client._sessions["default"].channel
    assert isinstance(ch, ShmChannel)
    return ch


def _exercise(svc: ServiceHandle, layout: ctxmem.KVLayout, n: int, tag: str,
              verify: bool = True) -> dict[str, Any]:
    """Put n blocks (half of them twice), look them up, get them back; what each call
    answered, with the bytes the gets returned."""
    keys = salted_keys(tag, n)
    data = blocks(n, layout.block_nbytes, len(tag))
    with ctxmem.Client(svc.endpoint, transport="shm", verify_gets=verify) as c:
        ns = c.open_namespace(layout, model_id="fast")
        first = ns.put(keys[: n // 2], data[: n // 2])
        second = ns.put(keys, data)
        lookup = ns.lookup([*keys, b"\x01" * 32])
        tiers = ns.tiers([b"\x02" * 32, *keys])
        out = [np.zeros(layout.block_nbytes, np.uint8) for _ in range(n)]
        got = ns.get(keys, out)
        missing = [np.full(layout.block_nbytes, 7, np.uint8)]
        miss = ns.get([b"\x03" * 32], missing)
        ops = _channel(c).ops
    assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True)), \
        "a get returned other bytes than were put"
    assert np.all(missing[0] == 7), "a miss wrote into its buffer"
    return {"first": first, "second": second, "lookup": lookup, "tiers": tiers, "got": got,
            "miss": miss, "ops": ops}


def test_layouts_are_the_sizes_named() -> None:
    assert (SMALL.block_nbytes, BIG.block_nbytes) == (64 << 10, 2 << 20)


@pytest.mark.parametrize(("layout", "n"), [(SMALL, 64), (BIG, 12)], ids=["64KiB", "2MiB"])
def test_exact_bytes_and_the_same_answers_as_grpc(
        service_factory: Callable[..., ServiceHandle], monkeypatch: pytest.MonkeyPatch,
        layout: ctxmem.KVLayout, n: int) -> None:
    """Every call over the fast path answers what gRPC answers, the bytes are exact, and
    the fast path was really taken (the service counted its ops) or really not."""
    svc = service_factory(encryption=False, flash_size=None, dram_size="256MiB",
                          dram_slab="16MiB")
    before = _fast_counts(svc)
    fast = _exercise(svc, layout, n, "fast")
    after = _fast_counts(svc)
    assert fast["ops"]
    # two puts, one allocation and commit each; lookup + tiers; two gets (hit, miss)
    assert after["shm_ops_allocate"] - before["shm_ops_allocate"] == 2
    assert after["shm_ops_commit"] - before["shm_ops_commit"] == 2
    assert after["shm_ops_lookup"] - before["shm_ops_lookup"] == 2
    assert after["shm_ops_acquire"] - before["shm_ops_acquire"] >= 2
    assert after["shm_ops_release"] - before["shm_ops_release"] >= 1
    unverified = _exercise(svc, layout, n, "unverified", verify=False)
    monkeypatch.setenv("CTXMEM_SHM_OPS", "0")
    before = _fast_counts(svc)
    slow = _exercise(svc, layout, n, "slow")
    assert not slow["ops"]
    assert _fast_counts(svc) == before, "CTXMEM_SHM_OPS=0 still used the fast path"
    for answers in (fast, unverified):
        answers.pop("ops")
    slow.pop("ops")
    assert fast == slow == unverified
    assert fast["got"] == n and fast["miss"] == 0
    assert fast["first"].stored == n // 2 and fast["second"].existing == n // 2
    assert fast["lookup"].num_hits == n


def test_a_service_without_the_fast_path_serves_a_new_client(
        service_factory: Callable[..., ServiceHandle]) -> None:
    """service.shm_op_max_bytes: 0 (an older service has no Health.shm_ops either): the
    client stays on gRPC and gets the same bytes."""
    svc = service_factory(encryption=False, flash_size=None,
                          service={"shm_op_max_bytes": 0})
    answers = _exercise(svc, SMALL, 16, "old-service")
    assert not answers["ops"]
    assert answers["got"] == 16
    assert all(v == 0 for v in _fast_counts(svc).values())


def test_a_restart_reconnects_and_retries_over_the_fast_path(
        service_factory: Callable[..., ServiceHandle]) -> None:
    """The service restarts (every session gone): the next fast-path op is answered
    'unknown session' or finds the socket closed, and the client reconnects, reopens its
    namespace and retries, still on the fast path."""
    svc = service_factory(encryption=False, flash_size=None)
    keys = salted_keys("restart", 8)
    data = blocks(8, SMALL.block_nbytes, 3)
    with ctxmem.Client(svc.endpoint, transport="shm") as c:
        ns = c.open_namespace(SMALL, model_id="fast")
        assert ns.put(keys, data).stored == 8
        old = c._sessions["default"]
        svc.restart()
        assert ns.lookup(keys).num_hits == 0  # DRAM-only: the restart lost every block
        assert c._sessions["default"] is not old
        assert ns.put(keys, data).stored == 8
        out = [np.zeros(SMALL.block_nbytes, np.uint8) for _ in range(8)]
        assert ns.get(keys, out) == 8
        assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
        assert _channel(c).ops
    assert _fast_counts(svc)["shm_ops_acquire"] >= 1



def test_a_verified_get_holds_no_lease_once_the_client_closes(
        service_factory: Callable[..., ServiceHandle]) -> None:
    """A verified get's Release goes flagged no-reply (the get does not wait for it); the
    client's close waits until the service has served it, so nothing the client did is
    still held when close returns. Without that wait `ctxmem status` scraped right after a
    client exited could show its lease (CI caught it)."""
    svc = service_factory(encryption=False, flash_size=None, dram_size="256MiB")
    keys = salted_keys("close", 4)
    data = blocks(4, SMALL.block_nbytes, 3)
    with ctxmem.Client(svc.endpoint, transport="shm") as c:
        c.open_namespace(SMALL, model_id="fast").put(keys, data)
    for round_ in range(20):
        with ctxmem.Client(svc.endpoint, transport="shm") as c:
            ns = c.open_namespace(SMALL, model_id="fast")
            out = [np.zeros(SMALL.block_nbytes, np.uint8) for _ in keys]
            assert ns.get(keys, out) == len(keys)
            assert _channel(c).ops, "the fast path was not negotiated"
        leases = svc.stats()["leases"]
        assert leases == 0, f"round {round_}: {leases} lease(s) still held after close"


def test_flush_waits_for_no_reply_releases(
        service_factory: Callable[..., ServiceHandle]) -> None:
    """`ShmChannel.flush` is the barrier close uses: after it, the releases sent without
    an answer have been served, with the channel still open."""
    svc = service_factory(encryption=False, flash_size=None, dram_size="256MiB")
    keys = salted_keys("flush", 8)
    with ctxmem.Client(svc.endpoint, transport="shm") as c:
        ns = c.open_namespace(SMALL, model_id="fast")
        ns.put(keys, blocks(8, SMALL.block_nbytes, 4))
        before = svc.stats()["shm_ops_release"]
        for _ in range(10):
            assert ns.get(keys, [np.zeros(SMALL.block_nbytes, np.uint8) for _ in keys]) == 8
        _channel(c).flush()
        stats = svc.stats()
        assert stats["leases"] == 0
        assert stats["shm_ops_release"] - before == 11, "ten releases and the barrier"
        _channel(c).flush()  # nothing unanswered since: no frame sent
        assert svc.stats()["shm_ops_release"] - before == 11


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_grpc_call_does_not_overtake_a_no_reply_release(
        service_factory: Callable[..., ServiceHandle], transport: str) -> None:
    """Evict and Delete go over gRPC, a verified get's Release went on the data channel
    without an answer: the client waits for the channel before the gRPC call, so the
    blocks are no longer leased when the Evict arrives and every one is evicted."""
    svc = service_factory(encryption=False, dram_size="256MiB")
    keys = salted_keys("overtake", 16)
    with ctxmem.Client(svc.endpoint, transport=transport) as c:
        ns = c.open_namespace(SMALL, model_id="fast")
        ns.put(keys, blocks(16, SMALL.block_nbytes, 5))
        ch = c._sessions["default"].channel
        assert ch.ops, "the fast path was not negotiated"
        for round_ in range(5):
            assert ns.get(keys, [np.zeros(SMALL.block_nbytes, np.uint8) for _ in keys]) == 16
            assert ch.unanswered, "a verified get's Release should go without an answer"
            assert ns.evict(keys[:1]) == 1, f"round {round_}: the leased block was kept"
            assert not ch.unanswered, "the gRPC call did not wait for the channel"
            ns.put(keys[:1], blocks(1, SMALL.block_nbytes, 5))  # back in DRAM for the next round
        assert ns.delete(keys) == 16
