"""``ctxmem bench --peer mooncake``: Mooncake Store's CPU build (its own master process and
one client) runs beside ctxmem in the same run, and each of its rows is paired with
ctxmem's. The round compares every get with what was put, so a Mooncake that returned
wrong bytes fails the round instead of posting a figure (checked here by corrupting what
its get delivered)."""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ctxmem_tools.bench.datapath import Result, run
from ctxmem_tools.bench.peer_lmcache import PeerMismatch


def _mooncake() -> Any:
    if os.environ.get("CI"):  # deploy/setup.sh installs it: in CI a skip would hide a gap
        import mooncake.store
        return mooncake.store
    return pytest.importorskip("mooncake.store", reason="Mooncake Store's CPU wheel is not "
                               "installed (deploy/setup.sh installs it)")


def test_quick_peer_run_pairs_every_mooncake_row_with_ctxmem(tmp_path: Path) -> None:
    _mooncake()
    out = tmp_path / "bench.json"
    assert run(["--quick", "--batch-mib", "8", "--workdir", str(tmp_path / "work"),
                "--peer", "mooncake", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert "peer" not in doc and doc["params"]["peer"] == "mooncake"
    peer = doc["peer_mooncake"]
    assert peer["name"] == "mooncake" and peer["mooncake_checks"] == "none"
    rows = {r["name"]: r for r in doc["results"]}
    fields = set(Result.__dataclass_fields__)
    seen = set()
    for pair in peer["pairs"]:
        seen.add((pair["row"], pair["size"]))
        c, mc = rows[pair["ctxmem"]], rows[pair["mooncake"]]
        assert set(c) == set(mc) == fields
        assert pair["ctxmem"].endswith("_xts") and pair["mooncake"].startswith("mooncake_")
        assert c["value"] > 0 and mc["value"] > 0 and mc["limit"] > 0, pair
        assert mc["limit"] == c["limit"], "both held against the same limit (memcpy)"
        assert mc["service_cpu_s_per_gb"] is None and mc["client_cpu_s_per_gb"] >= 0
        assert pair["ratio"] == pytest.approx(c["value"] / mc["value"])
        for q in ("p50", "p99"):
            assert rows[f"{pair['mooncake']}_{q}"]["value"] > 0
    assert seen == {(row, size) for size in ("2MiB", "64KiB")
                    for row in ("DRAM-hit get", "put (call returns)")}
    log = tmp_path / "work" / "mooncake" / "mooncake_master.log"
    assert log.exists(), "the master ran with its log in the workdir"


def test_a_wrong_byte_from_mooncake_fails_the_round(tmp_path: Path) -> None:
    _mooncake()
    from ctxmem_tools.bench.peer_mooncake import mooncake_peer

    rng = np.random.default_rng(3)
    bufs = [rng.integers(0, 255, 64 * 1024, dtype=np.uint8) for _ in range(8)]
    outs = [np.empty(64 * 1024, np.uint8) for _ in range(8)]
    with mooncake_peer(tmp_path, 64 * 1024, 8, "test") as peer:
        peer.round(0, bufs, outs)  # a clean round passes and is timed
        assert all(len(t) == 1 for t in peer.times.values())
        real = peer.store

        class Corrupting:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            def batch_get_into(self, keys: list[str], ptrs: list[int],
                               sizes: list[int]) -> list[int]:
                got = real.batch_get_into(keys, ptrs, sizes)
                byte = ctypes.c_uint8.from_address(ptrs[5] + 100)
                byte.value ^= 0xFF
                return list(got)

        peer.store = Corrupting()
        try:
            with pytest.raises(PeerMismatch, match="mooncake round 1: block 5"):
                peer.round(1, bufs, outs)
        finally:
            peer.store = real


def test_peer_without_mooncake_exits_naming_what_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import -> ImportError
    with pytest.raises(SystemExit) as ex:
        run(["--quick", "--peer", "mooncake", "--workdir", str(tmp_path / "w")])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert "Mooncake Store is not importable" in err
    assert "mooncake-transfer-engine-non-cuda==0.3.13.post1" in err
    assert not (tmp_path / "w").exists(), "nothing ran before the error"


def test_bench_pod_pairs_the_cross_node_get_with_mooncakes(tmp_path: Path) -> None:
    _mooncake()
    from ctxmem_tools.bench.pod import run as run_pod

    out = tmp_path / "pod.json"
    assert run_pod(["--total-mib", "4", "--repeat", "1", "--lookups", "0",
                    "--no-shared-flash", "--peer", "mooncake", "--json", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    sock = rows["TCP loopback socket, 1 stream"]["value"]
    for size in ("2MiB", "64KiB"):
        r = rows[f"cross-node get, Mooncake B <- A over TCP ({size})"]
        assert r["value"] > 0 and r["limit"] == sock
    ratio = rows["cross-node get 2 MiB, ctxmem plaintext / Mooncake (ratio)"]["value"]
    assert ratio == pytest.approx(
        rows["cross-node get, peer fetch (plaintext)"]["value"]
        / rows["cross-node get, Mooncake B <- A over TCP (2MiB)"]["value"])


def test_cross_client_get_compares_the_bytes(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _mooncake()
    from ctxmem_tools.bench import peer_mooncake

    times = peer_mooncake.cross_client_gets(tmp_path / "ok", 64 * 1024, 1 << 20, 2)
    assert len(times) == 2 and min(times) > 0
    real = peer_mooncake._blocks
    # The holder (another process) puts the real blocks; this reader is made to expect
    # other bytes, as if Mooncake had served wrong ones: the round must fail.
    monkeypatch.setattr(peer_mooncake, "_blocks",
                        lambda seed, block, count: real(seed + 1, block, count))
    with pytest.raises(PeerMismatch, match="cross-client get round 0"):
        peer_mooncake.cross_client_gets(tmp_path / "bad", 64 * 1024, 1 << 20, 1)
