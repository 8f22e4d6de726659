"""The data channel's contract, once for every transport (issue 27 item 3).

Namespace moves a batch's bytes through :meth:`DataChannel.write_grant` and
:meth:`DataChannel.read_grant` only (:mod:`ctxmem.transport.base`), with the control fast
path (:meth:`DataChannel.call`) where the channel carries it. This suite pins that
contract against the real service on loopback, the same test for each transport:
shared memory and TCP here, RDMA in the QEMU guest (marker ``vm``: the guest's
Soft-RoCE service of tests/vm/test_rdma_transport.py, started with its helpers; the
cases that need the control fast path, which RDMA does not carry, run over shm and TCP
only). A new transport adds itself to :data:`TRANSPORTS` and passes this file.

* round trips byte-exact at 64 KiB and 2 MiB, verified and not, answering what gRPC
  answers (``CTXMEM_FAST_OPS=0`` and its old name), the service counting the channel's
  own fast-path ops and no other channel's;
* partial hits (blocks after the run untouched), misses (buffers untouched);
* a batch with a duplicate key refused by the client and, sent anyway, by the service,
  on the channel, which stays usable;
* a grant is used once: a released lease, a committed or aborted allocation, a grant of
  the wrong kind or with the wrong number of buffers is refused before a byte moves;
* the error paths: a service without the fast path, a restart mid-session (reconnect,
  retry, still on the fast path), a verified get's no-reply Release waited for by
  ``flush``, by close and by the next gRPC call of the session.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import ctxmem
from ctxmem.transport.base import DataChannel, Grant
from ctxmem.transport.verified import ReadProgress
from ctxmem_common.errors import InvalidArgument
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.shm_ops import (
    decode_acquire_reply,
    decode_release_reply,
    encode_keys_request,
    encode_release,
)
from ctxmem_common.wire import SHM_OP_ACQUIRE, SHM_OP_ALLOCATE, SHM_OP_RELEASE
from tests.conftest import ServiceHandle
from tests.kit import blocks, byte_layout, salted_keys
from tests.vm.test_rdma_transport import loop_devices  # noqa: F401  (the guest's fixture)

BIG = byte_layout(2 << 20)  # 2 MiB blocks (K and V)
SMALL = byte_layout(64 << 10)  # 64 KiB blocks
IN_VM = os.environ.get("CTXMEM_VM") == "1"
_VM = [pytest.mark.vm, pytest.mark.skipif(
    not IN_VM, reason="needs the QEMU guest with Soft-RoCE; run: "
    "bash tests/vm/run.sh .venv/bin/pytest -m vm tests")]
TRANSPORTS = ["shm", "tcp", pytest.param("rdma", marks=_VM)]
FAST = ["shm", "tcp"]  # the channels that carry the control fast path
OPS = ("acquire", "release", "lookup", "allocate", "commit")


@dataclass
class Served:
    """A running service and the transport under test."""

    transport: str
    endpoint: str
    svc: Any

    def client(self, **kw: Any) -> ctxmem.Client:
        return ctxmem.Client(self.endpoint, transport=self.transport,  # type: ignore[arg-type]
                             **kw)

    def counts(self) -> dict[str, float]:
        """Every channel's fast-path op counters."""
        with ctxmem.Client(self.endpoint) as c:
            stats = c.stats()
        return {f"{t}_ops_{op}": stats.get(f"{t}_ops_{op}", 0.0)
                for t in ("shm", "tcp") for op in OPS}

    def leases(self) -> float:
        with ctxmem.Client(self.endpoint) as c:
            return c.stats()["leases"]


@pytest.fixture(scope="module")
def rdma_service(tmp_path_factory: pytest.TempPathFactory,
                 loop_devices: Callable[[int], str]  # noqa: F811
                 ) -> Iterator[Any]:
    """The guest's RDMA service (tests/vm/test_rdma_transport.py's own start-up)."""
    from tests.vm.test_rdma_transport import _keep_log, _start_service

    svc = _start_service(tmp_path_factory.mktemp("conformance"), loop_devices(72),
                         dram_size="64MiB")
    svc.start(timeout_s=180)
    yield svc
    svc.stop()
    _keep_log(svc, "conformance")


def _serve(request: pytest.FixtureRequest, transport: str,
           service_factory: Callable[..., ServiceHandle], flash: bool = False, **over: Any
           ) -> Served:
    """The service a case runs against: the guest's for RDMA, else a new one on
    loopback (DRAM only unless ``flash``; ``over``: more config)."""
    if transport == "rdma":
        svc = request.getfixturevalue("rdma_service")
        return Served(transport, svc.endpoint, svc)
    cfg: dict[str, Any] = {"encryption": False, "dram_size": "256MiB", "dram_slab": "16MiB",
                           **({} if flash else {"flash_size": None}), **over}
    svc = service_factory(**cfg)
    return Served(transport, svc.endpoint, svc)


@pytest.fixture(params=TRANSPORTS)
def served(request: pytest.FixtureRequest,
           service_factory: Callable[..., ServiceHandle]) -> Served:
    return _serve(request, request.param, service_factory)


@pytest.fixture(params=FAST)
def served_fast(request: pytest.FixtureRequest,
                service_factory: Callable[..., ServiceHandle]) -> Served:
    return _serve(request, request.param, service_factory)


def _channel(c: ctxmem.Client) -> DataChannel:
    return c._sessions["default"].channel


def _zeros(n: int, layout: ctxmem.KVLayout, fill: int = 0) -> list[np.ndarray]:
    return [np.full(layout.block_nbytes, fill, np.uint8) for _ in range(n)]


def _exercise(s: Served, layout: ctxmem.KVLayout, n: int, tag: str, verify: bool = True
              ) -> dict[str, Any]:
    """Put n blocks (half of them twice), look them up, get them back, miss one; what
    each call answered, the bytes checked."""
    keys = salted_keys(f"{s.transport}-{tag}", n)
    data = blocks(n, layout.block_nbytes, len(tag))
    with s.client(verify_gets=verify) as c:
        ns = c.open_namespace(layout, model_id="conformance")
        first = ns.put(keys[: n // 2], data[: n // 2])
        second = ns.put(keys, data)
        lookup = ns.lookup([*keys, b"\x01" * 32])
        tiers = ns.tiers([b"\x02" * 32, *keys])
        out = _zeros(n, layout)
        got = ns.get(keys, out)
        missing = _zeros(1, layout, 7)
        miss = ns.get([b"\x03" * 32], missing)
        ops = _channel(c).ops
        assert c.transport_in_use == s.transport
        ns.delete(keys)  # the guest's service is shared by the module's tests
    assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True)), \
        "a get returned other bytes than were put"
    assert np.all(missing[0] == 7), "a miss wrote into its buffer"
    return {"first": first, "second": second, "lookup": (lookup.num_hits, lookup.tiers),
            "tiers": tiers, "got": got, "miss": miss, "ops": ops}


def _moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before if after[k] != before[k]}


@pytest.mark.parametrize(("layout", "n"), [(SMALL, 64), (BIG, 12)], ids=["64KiB", "2MiB"])
def test_round_trips_are_exact_and_answer_what_grpc_answers(
        served: Served, monkeypatch: pytest.MonkeyPatch, layout: ctxmem.KVLayout,
        n: int) -> None:
    """Puts, lookups, tiers, gets (verified and not) and a miss: exact bytes, the same
    answers with the fast path as without it (either opt-out variable), and the fast
    path really taken on the channel's own socket (the service counted its ops, none
    on another channel's) or really not."""
    s = served
    assert (SMALL.block_nbytes, BIG.block_nbytes) == (64 << 10, 2 << 20)
    before = s.counts()
    fast = _exercise(s, layout, n, "fast")
    moved = _moved(before, s.counts())
    if fast.pop("ops"):
        # two puts (an ALLOCATE and a COMMIT each), lookup and tiers, two gets (hit, miss)
        own = s.transport
        assert moved.get(f"{own}_ops_allocate") == 2 and moved.get(f"{own}_ops_commit") == 2
        assert moved.get(f"{own}_ops_lookup") == 2
        assert moved.get(f"{own}_ops_acquire", 0) >= 2
        assert moved.get(f"{own}_ops_release", 0) >= 1
        assert all(k.startswith(f"{own}_") for k in moved), f"another channel's ops: {moved}"
    else:
        assert moved == {}, f"a channel without the fast path sent fast ops: {moved}"
    unverified = _exercise(s, layout, n, "unverified", verify=False)
    unverified.pop("ops")
    slow = []
    for env in ("CTXMEM_FAST_OPS", "CTXMEM_SHM_OPS"):  # the general name and the old one
        with monkeypatch.context() as m:
            m.setenv(env, "0")
            before = s.counts()
            answers = _exercise(s, layout, n, "slow-" + env)
            assert not answers.pop("ops")
            assert s.counts() == before, f"{env}=0 still used the fast path"
            slow.append(answers)
    assert fast == unverified == slow[0] == slow[1]
    assert fast["got"] == n and fast["miss"] == 0
    assert fast["first"].stored == n // 2 and fast["second"].existing == n // 2
    assert fast["lookup"] == (n, ["dram"] * n)


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
def test_a_partial_hit_fills_the_run_and_leaves_the_rest_untouched(
        served: Served, verify: bool) -> None:
    keys = salted_keys(f"{served.transport}-partial-{verify}", 10)
    data = blocks(10, SMALL.block_nbytes, 2)
    with served.client(verify_gets=verify) as c:
        ns = c.open_namespace(SMALL, model_id="conformance")
        assert ns.put(keys[:6], data[:6]).stored == 6
        assert ns.lookup(keys).num_hits == 6
        assert ns.exists(keys) == [True] * 6 + [False] * 4
        out = _zeros(10, SMALL, 7)
        assert ns.get(keys, out) == 6
        assert all(np.array_equal(a, b) for a, b in zip(data[:6], out[:6], strict=True))
        assert all(np.all(o == 7) for o in out[6:]), "a block after the run was written"
        # a hole in the middle: the run stops before it, the blocks after it stay put
        assert ns.delete(keys[2:3]) == 1
        out = _zeros(10, SMALL, 7)
        assert ns.get(keys, out) == 2
        assert all(np.all(o == 7) for o in out[2:])
        ns.delete(keys)


def test_a_miss_answers_zero_and_writes_nothing(served: Served) -> None:
    with served.client() as c:
        ns = c.open_namespace(SMALL, model_id="conformance")
        out = _zeros(3, SMALL, 7)
        assert ns.get(salted_keys(f"{served.transport}-never", 3), out) == 0
        assert all(np.all(o == 7) for o in out)
        assert ns.lookup(salted_keys(f"{served.transport}-never", 3)).num_hits == 0


def test_a_batch_with_a_duplicate_key_is_refused(served: Served) -> None:
    """The client refuses it before anything is sent; sent anyway (an ALLOCATE or
    ACQUIRE frame where the channel carries them, else the gRPC call), the service
    refuses it with the same error, and the channel serves the next batch."""
    keys = salted_keys(f"{served.transport}-dup", 3)
    dup = [keys[0], keys[1], keys[0]]
    data = blocks(3, SMALL.block_nbytes, 4)
    with served.client() as c:
        ns = c.open_namespace(SMALL, model_id="conformance")
        with pytest.raises(InvalidArgument, match=r"keys\[2\] duplicates keys\[0\]"):
            ns.put(dup, data)
        with pytest.raises(InvalidArgument, match=r"keys\[2\] duplicates keys\[0\]"):
            ns.get(dup, _zeros(3, SMALL))
        assert ns.lookup(keys).num_hits == 0, "a refused put stored something"
        s = ns._open()
        ch = s.channel
        for op, method in ((SHM_OP_ALLOCATE, "Allocate"), (SHM_OP_ACQUIRE, "Acquire")):
            with pytest.raises(InvalidArgument, match="duplicates"):
                if ch.ops:
                    ch.call(op, encode_keys_request(ns.handle, b"".join(dup), 32))
                else:
                    req = (pb.AllocateRequest if method == "Allocate" else pb.AcquireRequest)
                    c._rpc(method, req(session_id=s.id, namespace_handle=ns.handle,
                                       keys=dup))
        assert ns.put(keys, data).stored == 3
        out = _zeros(3, SMALL)
        assert ns.get(keys, out) == 3
        assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
        ns.delete(keys)


def _lease(c: ctxmem.Client, ns: ctxmem.Namespace, keys: list[bytes], fast: bool) -> Grant:
    """A lease on ``keys`` as Namespace takes it: an ACQUIRE frame (``fast``) or a gRPC
    Acquire in the form the channel reads best."""
    s = ns._open()
    ch = s.channel
    if fast:
        rep = decode_acquire_reply(
            ch.call(SHM_OP_ACQUIRE, encode_keys_request(ns.handle, b"".join(keys), 32)),
            len(keys), ns.block_nbytes)
        return Grant.of_lease(rep.lease_id, rep.slots, rep.slots.crcs)
    a = c._rpc("Acquire", pb.AcquireRequest(session_id=s.id, namespace_handle=ns.handle,
                                            keys=keys, want_packed=ch.packed_slots))
    return Grant.of_acquire(a, len(keys), ns.block_nbytes, ch.packed_slots)


def _end_lease(c: ctxmem.Client, ns: ctxmem.Namespace, lease_id: bytes, fast: bool
               ) -> list[bool]:
    """Release ``lease_id`` (a RELEASE frame, or gRPC); whether it was still valid."""
    s = ns._open()
    if fast:
        return decode_release_reply(s.channel.call(
            SHM_OP_RELEASE, [encode_release([lease_id], no_reply=False)]), 1)
    return list(c._rpc("Release", pb.ReleaseRequest(session_id=s.id,
                                                    lease_ids=[lease_id])).valid)


@pytest.mark.parametrize("via", ["grpc", "fast"])
def test_a_grant_is_used_once(served: Served, via: str) -> None:
    """A lease read through read_grant delivers exact bytes; once released it is
    refused before a byte moves (on shared memory nothing else would stop it: the slots
    stay mapped), and the service answers its second Release invalid. An allocation
    written through write_grant and committed is refused after, and the committed bytes
    stay; the wrong kind of grant and the wrong number of buffers are refused too."""
    keys = salted_keys(f"{served.transport}-grant-{via}", 4)
    data = blocks(4, SMALL.block_nbytes, 6)
    with served.client() as c:
        ns = c.open_namespace(SMALL, model_id="conformance")
        ch = ns._open().channel
        if via == "fast" and not ch.ops:
            pytest.skip(f"the {served.transport} channel carries no control fast path")
        fast = via == "fast"
        s = ns._open()
        # -- an allocation: written once, committed, then refused ----------------------
        a = c._rpc("Allocate", pb.AllocateRequest(session_id=s.id,
                                                  namespace_handle=ns.handle, keys=keys))
        alloc = Grant.allocation(a.allocation_id, a.slots)
        views = [memoryview(d) for d in data]
        with pytest.raises(InvalidArgument, match="pass one buffer per slot"):
            ch.write_grant(alloc, views[:3])
        with pytest.raises(InvalidArgument, match="only a lease is readable"):
            ch.read_grant(alloc, views, True, ReadProgress())
        crcs = ch.write_grant(alloc, views)
        alloc.release()
        assert c._rpc("Commit", pb.CommitRequest(session_id=s.id, allocation_id=alloc.id,
                                                 crc32c=crcs)).committed == 4
        with pytest.raises(InvalidArgument, match="already committed or aborted"):
            ch.write_grant(alloc, [memoryview(bytes(SMALL.block_nbytes))] * 4)
        # -- a lease: read once, released, then refused --------------------------------
        lease = _lease(c, ns, keys, fast)
        with pytest.raises(InvalidArgument, match="only an allocation is writable"):
            ch.write_grant(lease, views)
        with pytest.raises(InvalidArgument, match="5 buffers for the 4 slots"):
            ch.read_grant(lease, [*views, views[0]], True, ReadProgress())
        out = _zeros(4, SMALL)
        progress = ReadProgress()
        ch.read_grant(lease, [memoryview(o) for o in out], True, progress)
        assert (progress.done, progress.bad) == (4, None)
        assert all(np.array_equal(a_, b) for a_, b in zip(data, out, strict=True))
        part = _zeros(2, SMALL)  # fewer buffers: the leading blocks, unchecked
        ch.read_grant(lease, [memoryview(o) for o in part], False, ReadProgress())
        assert all(np.array_equal(a_, b) for a_, b in zip(data[:2], part, strict=True))
        lease.release()
        assert _end_lease(c, ns, lease.id, fast) == [True]
        again = _zeros(4, SMALL, 7)
        with pytest.raises(InvalidArgument, match="already released"):
            ch.read_grant(lease, [memoryview(o) for o in again], True, ReadProgress())
        assert all(np.all(o == 7) for o in again), "a released lease wrote a buffer"
        assert _end_lease(c, ns, lease.id, fast) == [False]  # gone on the service too
        # the committed blocks are the bytes written, whatever was tried after
        out = _zeros(4, SMALL)
        assert ns.get(keys, out) == 4
        assert all(np.array_equal(a_, b) for a_, b in zip(data, out, strict=True))
        ns.delete(keys)


# -- error paths of the control fast path (shm and TCP; RDMA carries none) ------------

@pytest.mark.parametrize("transport", FAST)
def test_a_service_without_the_fast_path_serves_a_new_client(
        request: pytest.FixtureRequest, service_factory: Callable[..., ServiceHandle],
        transport: str) -> None:
    """``service.shm_op_max_bytes: 0`` (an older service has no Health ``shm_ops`` /
    ``tcp_ops`` either): the client stays on gRPC and the data frames, same bytes."""
    s = _serve(request, transport, service_factory, service={"shm_op_max_bytes": 0})
    answers = _exercise(s, SMALL, 16, "old-service")
    assert not answers["ops"]
    assert answers["got"] == 16 and answers["lookup"][0] == 16
    assert all(v == 0 for v in s.counts().values())


def test_a_restart_reconnects_and_retries_over_the_fast_path(
        served_fast: Served) -> None:
    """The service restarts (every session gone): the next op finds the connection
    closed or its session unknown, and the client reconnects, reopens its namespace and
    retries, still on the fast path."""
    s = served_fast
    keys = salted_keys("restart", 8)
    data = blocks(8, SMALL.block_nbytes, 3)
    with s.client() as c:
        ns = c.open_namespace(SMALL, model_id="conformance")
        assert ns.put(keys, data).stored == 8
        old = c._sessions["default"]
        s.svc.restart()
        assert ns.lookup(keys).num_hits == 0  # DRAM-only: the restart lost every block
        assert c._sessions["default"] is not old
        assert ns.put(keys, data).stored == 8
        out = _zeros(8, SMALL)
        assert ns.get(keys, out) == 8
        assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
        assert _channel(c).ops
    assert s.counts()[f"{s.transport}_ops_acquire"] >= 1


def test_flush_and_close_wait_for_no_reply_releases(served_fast: Served) -> None:
    """A verified get's Release goes flagged no-reply (the get does not wait for it);
    ``flush`` is the barrier close uses: after it the releases have been served (one
    answered RELEASE behind ten), a second flush sends nothing, and once a client
    closes no lease of it is held (without that wait ``ctxmem status`` scraped right
    after a client exited could show its lease: CI caught it)."""
    s = served_fast
    counter = f"{s.transport}_ops_release"
    keys = salted_keys("flush", 8)  # 8 blocks of 64 KiB
    with s.client() as c:
        ns = c.open_namespace(SMALL, model_id="conformance")
        ns.put(keys, blocks(8, SMALL.block_nbytes, 4))
        before = s.counts()[counter]
        for _ in range(10):
            assert ns.get(keys, _zeros(8, SMALL)) == 8
        ch = _channel(c)
        assert ch.ops and ch.unanswered
        ch.flush()
        assert s.leases() == 0
        assert s.counts()[counter] - before == 11, "ten releases and the barrier"
        ch.flush()  # nothing unanswered since: no frame sent
        assert s.counts()[counter] - before == 11
    for round_ in range(20):
        with s.client() as c:
            ns = c.open_namespace(SMALL, model_id="conformance")
            assert ns.get(keys, _zeros(8, SMALL)) == 8
            assert _channel(c).ops, "the fast path was not negotiated"
        leases = s.leases()
        assert leases == 0, f"round {round_}: {leases} lease(s) still held after close"


@pytest.mark.parametrize("transport", FAST)
def test_a_grpc_call_does_not_overtake_a_no_reply_release(
        request: pytest.FixtureRequest, service_factory: Callable[..., ServiceHandle],
        transport: str) -> None:
    """Evict and Delete go over gRPC, a verified get's Release went on the data channel
    without an answer: the client waits for the channel before the gRPC call, so the
    blocks are no longer leased when the Evict arrives and every one is evicted."""
    s = _serve(request, transport, service_factory, flash=True)
    keys = salted_keys("overtake", 16)
    with s.client() as c:
        ns = c.open_namespace(SMALL, model_id="conformance")
        ns.put(keys, blocks(16, SMALL.block_nbytes, 5))
        ch = _channel(c)
        assert ch.ops, "the fast path was not negotiated"
        for round_ in range(5):
            assert ns.get(keys, _zeros(16, SMALL)) == 16
            assert ch.unanswered, "a verified get's Release should go without an answer"
            assert ns.evict(keys[:1]) == 1, f"round {round_}: the leased block was kept"
            assert not ch.unanswered, "the gRPC call did not wait for the channel"
            ns.put(keys[:1], blocks(1, SMALL.block_nbytes, 5))  # back in DRAM
        assert ns.delete(keys) == 16
