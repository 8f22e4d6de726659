"""``ctxmem bench --peer lmcache``: LMCache's own storage manager (hot cache + O_DIRECT local
disk) runs beside ctxmem in the same run, and each of its rows is paired with ctxmem's.

The adapter's figures only mean something if LMCache really stored and returned the
bytes: the round compares every get with what was put, and a test corrupts a chunk file
on disk to check that a wrong read fails the round instead of posting a figure."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ctxmem_tools.bench.datapath import Result, run
from tests import kit


def _lmcache() -> Any:
    return pytest.importorskip("lmcache", reason="LMCache is not installed (the peer's tests "
                               "need it; see tests/engines/test_lmcache_backend.py)")


def test_quick_peer_run_pairs_every_lmcache_row_with_ctxmem(tmp_path: Path) -> None:
    lmcache = _lmcache()
    out = tmp_path / "bench.json"
    assert run(["--quick", "--batch-mib", "16", "--workdir", str(tmp_path / "work"),
                "--peer", "lmcache", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    peer = doc["peer"]
    assert peer["name"] == "lmcache" and peer["version"] == lmcache.__version__
    assert "never fsyncs" in peer["lmcache_fsync"]
    assert doc["params"]["peer"] == "lmcache"
    rows = {r["name"]: r for r in doc["results"]}
    fields = set(Result.__dataclass_fields__)
    seen = set()
    for pair in peer["pairs"]:
        seen.add((pair["row"], pair["size"]))
        c, lm = rows[pair["ctxmem"]], rows[pair["lmcache"]]
        assert set(c) == set(lm) == fields
        assert pair["ctxmem"].endswith("_xts"), "ctxmem's side runs with encryption on"
        assert pair["lmcache"].startswith("lmcache_")
        assert c["value"] > 0 and lm["value"] > 0 and lm["limit"] > 0, pair
        # CPU per row can round to 0 at tick granularity on a short phase: >= 0 each,
        # > 0 over all rows below.
        assert lm["client_cpu_s_per_gb"] >= 0 and lm["service_cpu_s_per_gb"] is None
        assert pair["lmcache_cpu_s_per_gb"] == lm["client_cpu_s_per_gb"]
        assert pair["ctxmem_value"] == c["value"] and pair["lmcache_value"] == lm["value"]
        for q in ("p50", "p99"):
            assert rows[f"{pair['lmcache']}_{q}"]["value"] > 0
    assert sum(p["lmcache_cpu_s_per_gb"] for p in peer["pairs"]) > 0
    assert seen == {(row, size) for size in ("2MiB", "64KiB") for row in (
        "DRAM-hit get", "cold flash get", "put (call returns)", "put until on disk",
        "put until durable")}
    assert not list((tmp_path / "work" / "lmcache-disk").glob("*.pt")), "chunk files left"


@pytest.fixture
def peer(tmp_path: Path) -> Any:
    _lmcache()
    from ctxmem_tools.bench.peer_lmcache import lmcache_peer

    with lmcache_peer(tmp_path / "disk", 64 * 1024, 16, "test") as p:
        yield p


def _blocks(n: int, seed: int) -> list[np.ndarray]:
    return kit.blocks(n, 64 << 10, seed)


def test_round_reads_back_from_disk_what_it_stored(peer: Any) -> None:
    bufs, outs = _blocks(16, 1), _blocks(16, 2)
    written: list[str] = []
    evict = peer.evict_to_disk

    def evict_and_look(keys: list[Any]) -> None:
        evict(keys)
        written.extend(p for p in peer._paths(keys) if os.path.getsize(p) == 64 * 1024)
        assert not any(peer.sm.storage_backends["LocalCPUBackend"].contains(k) for k in keys)

    peer.evict_to_disk = evict_and_look
    peer.round(0, bufs, outs)
    assert len(written) == 16, "every chunk was on disk, out of the hot cache, before the get"
    assert all(np.array_equal(a, b) for a, b in zip(bufs, outs, strict=True))
    assert all(len(t) == 1 and t[0] > 0 for t in peer.times.values())


def test_round_fails_when_lmcache_returns_other_bytes(peer: Any) -> None:
    from ctxmem_tools.bench.peer_lmcache import PeerMismatch

    bufs, outs = _blocks(16, 3), _blocks(16, 4)
    evict = peer.evict_to_disk

    def evict_and_corrupt(keys: list[Any]) -> None:
        evict(keys)
        path = peer._paths(keys)[5]
        with open(path, "r+b") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())

    peer.evict_to_disk = evict_and_corrupt
    with pytest.raises(PeerMismatch, match="lmcache_flash_get_64KiB round 0: block 5"):
        peer.round(0, bufs, outs)


def test_peer_without_lmcache_exits_naming_what_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "lmcache", None)  # import lmcache -> ImportError
    with pytest.raises(SystemExit) as ex:
        run(["--quick", "--peer", "lmcache", "--workdir", str(tmp_path / "w")])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert "LMCache is not importable" in err and "lmcache==0.5.6" in err
    assert not (tmp_path / "w").exists(), "nothing ran before the error"
