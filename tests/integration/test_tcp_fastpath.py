"""The control fast path on the TCP data channel (Lookup, Acquire/Release, Allocate/Commit
as binary OP frames beside READ and WRITE) against the real service: exact bytes, the
same answers as gRPC, with and without TLS, the reconnect after a restart, and both sides
of the negotiation (a client that opts out or predates it, a service that does not offer
it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ctxmem
from ctxmem.transport.tcp import TcpChannel
from ctxmem_tools.bench.security_pki import make_pki
from tests.conftest import ServiceHandle
from tests.integration.test_shm_fastpath import BIG, SMALL
from tests.kit import blocks, salted_keys

TCP_OPS = ("tcp_ops_acquire", "tcp_ops_release", "tcp_ops_lookup", "tcp_ops_allocate",
           "tcp_ops_commit")
SHM_OPS = tuple(name.replace("tcp_", "shm_") for name in TCP_OPS)


def _counts(svc: ServiceHandle, names: tuple[str, ...] = TCP_OPS,
            tls: ctxmem.TlsConfig | None = None) -> dict[str, float]:
    if tls is None:
        stats = svc.stats()
    else:
        with ctxmem.Client(svc.endpoint, tls=tls) as c:
            stats = c.stats()
    return {k: stats[k] for k in names}


def _channel(client: ctxmem.Client) -> TcpChannel:
    ch = client._sessions["default"].channel
    assert isinstance(ch, TcpChannel)
    return ch


def _exercise(svc: ServiceHandle, layout: ctxmem.KVLayout, n: int, tag: str,
              verify: bool = True, tls: ctxmem.TlsConfig | None = None) -> dict[str, Any]:
    """Put n blocks over TCP (half of them twice), look them up, get them back; what each
    call answered, with the bytes the gets returned."""
    keys = salted_keys(tag, n)
    data = blocks(n, layout.block_nbytes, len(tag))
    with ctxmem.Client(svc.endpoint, transport="tcp", verify_gets=verify, tls=tls) as c:
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


def _check_fast_counts(before: dict[str, float], after: dict[str, float]) -> None:
    """Two puts (one ALLOCATE and COMMIT each), lookup + tiers, two gets (hit, miss)."""
    assert after["tcp_ops_allocate"] - before["tcp_ops_allocate"] == 2
    assert after["tcp_ops_commit"] - before["tcp_ops_commit"] == 2
    assert after["tcp_ops_lookup"] - before["tcp_ops_lookup"] == 2
    assert after["tcp_ops_acquire"] - before["tcp_ops_acquire"] >= 2
    assert after["tcp_ops_release"] - before["tcp_ops_release"] >= 1


@pytest.mark.parametrize(("layout", "n"), [(SMALL, 64), (BIG, 12)], ids=["64KiB", "2MiB"])
def test_exact_bytes_and_the_same_answers_as_grpc(
        service_factory: Callable[..., ServiceHandle], monkeypatch: pytest.MonkeyPatch,
        layout: ctxmem.KVLayout, n: int) -> None:
    """Every call over the TCP fast path answers what gRPC answers, the bytes are exact,
    and the fast path was really taken (the service counted its TCP ops, none on the
    shared-memory socket) or really not (either opt-out variable)."""
    svc = service_factory(encryption=False, flash_size=None, dram_size="256MiB",
                          dram_slab="16MiB")
    before, shm_before = _counts(svc), _counts(svc, SHM_OPS)
    fast = _exercise(svc, layout, n, "fast")
    assert fast.pop("ops")
    _check_fast_counts(before, _counts(svc))
    assert _counts(svc, SHM_OPS) == shm_before, "a TCP client used the shm socket"
    unverified = _exercise(svc, layout, n, "unverified", verify=False)
    assert unverified.pop("ops")
    answers = []
    for env in ("CTXMEM_FAST_OPS", "CTXMEM_SHM_OPS"):  # the general name and the old one
        with monkeypatch.context() as m:
            m.setenv(env, "0")
            before = _counts(svc)
            slow = _exercise(svc, layout, n, "slow-" + env)
            assert not slow.pop("ops")
            assert _counts(svc) == before, f"{env}=0 still used the fast path"
            answers.append(slow)
    assert fast == unverified == answers[0] == answers[1]
    assert fast["got"] == n and fast["miss"] == 0
    assert fast["first"].stored == n // 2 and fast["second"].existing == n // 2
    assert fast["lookup"].num_hits == n


def test_over_tls_exact_bytes_and_the_same_answers(
        service_factory: Callable[..., ServiceHandle], tmp_path: Path) -> None:
    """The OP frames go through the TLS stream like READ and WRITE: the same answers with
    the fast path as without it, over a TLS 1.3 data connection."""
    pki = make_pki(tmp_path / "pki")
    svc = service_factory(encryption=False, flash_size=None, dram_size="64MiB",
                          dram_slab="2MiB", transports=["tcp"],
                          tls={"cert_file": str(pki.server_cert),
                               "key_file": str(pki.server_key), "client_ca_file": ""})
    tls = ctxmem.TlsConfig(ca_file=str(pki.ca))
    before = _counts(svc, tls=tls)
    fast = _exercise(svc, SMALL, 16, "tls", tls=tls)
    assert fast.pop("ops")
    _check_fast_counts(before, _counts(svc, tls=tls))
    with pytest.MonkeyPatch.context() as m:
        m.setenv("CTXMEM_FAST_OPS", "0")
        before = _counts(svc, tls=tls)
        slow = _exercise(svc, SMALL, 16, "tls-slow", tls=tls)
        assert not slow.pop("ops") and _counts(svc, tls=tls) == before
    assert fast == slow and fast["got"] == 16
    # A 3.2 MB LOOKUP body and its 100 KB answer, both through the TLS stream's chunks
    with ctxmem.Client(svc.endpoint, transport="tcp", tls=tls) as c:
        ns = c.open_namespace(SMALL, model_id="fast")
        before = _counts(svc, tls=tls)["tcp_ops_lookup"]
        many = salted_keys("tls", 100_000)  # a chain: its first 16 keys are the ones put
        assert ns.lookup(many).num_hits == 16
        assert ns.tiers(many) == ["dram"] * 16 + [""] * (100_000 - 16)
        assert _counts(svc, tls=tls)["tcp_ops_lookup"] == before + 2


def test_a_service_without_the_fast_path_serves_a_new_client(
        service_factory: Callable[..., ServiceHandle]) -> None:
    """service.shm_op_max_bytes: 0 (an older service has no Health.tcp_ops either): the
    client stays on gRPC and READ/WRITE frames, and gets the same bytes."""
    svc = service_factory(encryption=False, flash_size=None,
                          service={"shm_op_max_bytes": 0})
    answers = _exercise(svc, SMALL, 16, "old-service")
    assert not answers["ops"]
    assert answers["got"] == 16 and answers["lookup"].num_hits == 16
    assert all(v == 0 for v in _counts(svc).values())


def test_a_restart_reconnects_and_retries_over_the_fast_path(
        service_factory: Callable[..., ServiceHandle]) -> None:
    """The service restarts (every session gone): the next op finds the connection closed,
    and the client reconnects, reopens its namespace and retries, still on the fast
    path."""
    svc = service_factory(encryption=False, flash_size=None)
    keys = salted_keys("restart", 8)
    data = blocks(8, SMALL.block_nbytes, 3)
    with ctxmem.Client(svc.endpoint, transport="tcp") as c:
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
    assert _counts(svc)["tcp_ops_acquire"] >= 1


def test_a_verified_get_holds_no_lease_once_the_client_closes(
        service_factory: Callable[..., ServiceHandle]) -> None:
    """A verified get's Release goes flagged no-reply; the channel's close (and `flush`)
    waits until the service has served it, so no lease is held once close returns."""
    svc = service_factory(encryption=False, flash_size=None, dram_size="256MiB")
    keys = salted_keys("close", 4)
    with ctxmem.Client(svc.endpoint, transport="tcp") as c:
        c.open_namespace(SMALL, model_id="fast").put(keys, blocks(4, SMALL.block_nbytes, 3))
    for round_ in range(10):
        with ctxmem.Client(svc.endpoint, transport="tcp") as c:
            ns = c.open_namespace(SMALL, model_id="fast")
            before = svc.stats()["tcp_ops_release"]
            assert ns.get(keys, [np.zeros(SMALL.block_nbytes, np.uint8) for _ in keys]) == 4
            assert _channel(c).ops, "the fast path was not negotiated"
            if round_ == 0:  # the release sent no-reply, then flush's barrier
                _channel(c).flush()
                stats = svc.stats()
                assert stats["leases"] == 0 and stats["tcp_ops_release"] - before == 2
        leases = svc.stats()["leases"]
        assert leases == 0, f"round {round_}: {leases} lease(s) still held after close"
