"""The control fast path on the TCP data channel over TLS: the OP frames (Lookup,
Acquire/Release, Allocate/Commit beside READ and WRITE) go through the TLS stream with
exact bytes and the same answers as gRPC. What every channel's fast path must do (exact
bytes at 64 KiB and 2 MiB, the same answers as gRPC, the negotiation, the reconnect, the
no-reply releases) is tests/host/test_datachannel_conformance.py, over TCP and shared
memory alike."""

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
from tests.kit import blocks, byte_layout, salted_keys

SMALL = byte_layout(64 << 10)  # 64 KiB blocks
TCP_OPS = ("tcp_ops_acquire", "tcp_ops_release", "tcp_ops_lookup", "tcp_ops_allocate",
           "tcp_ops_commit")


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
