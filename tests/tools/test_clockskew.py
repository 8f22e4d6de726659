"""The chaos campaign's clock-skew emulation (``ctxmem_tools/chaos/clockskew``) shifts one
service's wall clock and nothing that a real clock step would leave consistent: a client
with a true clock still connects to a node shifted ahead or behind. Before the fix, gRPC's
``time_remaining()`` compared a deadline on C's clock with the shifted Python one, and a node
shifted ahead refused every Connect as "the caller's deadline passed" (98.5% of the put
blocks a pod campaign counted as refused)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ctxmem.client import Client
from ctxmem_tools.chaos.pod import SKEW_DIR
from ctxmem_tools.launcher import ServiceProcess, local_config
from tests.kit import byte_layout

LAYOUT = byte_layout(4 << 10)


def _env(skew_s: float) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(SKEW_DIR), os.environ.get("PYTHONPATH", "")]),
            "CTXMEM_CHAOS_CLOCK_SKEW_S": str(skew_s)}


def test_the_emulation_shifts_pythons_clock_only() -> None:
    """The shift is real where the service reads the time (else the tests using it prove
    nothing), and gRPC's module keeps the true clock."""
    code = ("import time; from grpc._cython import cygrpc; "
            "print(time.time() - time.clock_gettime(time.CLOCK_REALTIME), "
            "cygrpc.time.time() - time.clock_gettime(time.CLOCK_REALTIME))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **_env(300.0)},
                         capture_output=True, text=True, timeout=60, check=True).stdout
    python_s, grpc_s = (float(x) for x in out.split())
    assert 299.0 < python_s < 301.0, out
    assert abs(grpc_s) < 1.0, out


@pytest.mark.parametrize("skew_s", [300.0, -300.0], ids=["ahead", "behind"])
def test_a_node_with_a_shifted_clock_still_takes_connects(
        tmp_path: Path, skew_s: float, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = local_config(tmp_path)
    with monkeypatch.context() as mp:  # the service's environment only
        for k, v in _env(skew_s).items():
            mp.setenv(k, v)
        svc = ServiceProcess(tmp_path / "svc", cfg)
    try:
        with Client(svc.endpoint, transport="shm", timeout_s=10.0) as client:
            ns = client.open_namespace(LAYOUT, model_id="skew", tenant="alice")
            key = time.time_ns().to_bytes(32, "little")
            data = os.urandom(LAYOUT.block_nbytes)
            r = ns.put([key], [data])
            assert r.stored == 1
            buf = bytearray(LAYOUT.block_nbytes)
            assert ns.get([key], [buf]) == 1
            assert buf == data
    finally:
        svc.stop()
