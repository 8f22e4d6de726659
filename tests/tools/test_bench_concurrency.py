"""``ctxmem bench concurrency --quick``: 1 and 2 client processes over shm and TCP against a
real service. CI checks that the mode runs and that its figures are well formed (every
row present, values and limits positive, fractions = value / limit, CPU per GB
positive), never how fast anything is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ctxmem_tools.bench.concurrency import COPY_METHODS
from ctxmem_tools.cli import bench_command


def test_quick_concurrency_bench_reports_every_row(tmp_path: Path) -> None:
    out = tmp_path / "cc.json"
    assert bench_command(["concurrency", "--quick", "--workdir", str(tmp_path / "work"),
                          "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["params"]["clients"] == [1, 2]
    assert set(doc["limits"]) == {"1", "2"}
    for lim in doc["limits"].values():
        assert all(lim[m] > 0 for m in COPY_METHODS)
        assert lim["best"] == max(lim[m] for m in COPY_METHODS)
    rows = {(r["transport"], r["clients"], r["op"], r["block"]): r for r in doc["results"]}
    want = {(t, n, op, b) for t in ("shm", "tcp") for n in (1, 2) for op in ("put", "get")
            for b in (2 << 20, 64 << 10)}
    assert set(rows) == want
    for (_, n, _, _), r in rows.items():
        assert r["value"] > 0 and r["unit"] == "GB/s"
        assert r["limit"] == doc["limits"][str(n)]["best"]
        assert r["fraction_of_limit"] == pytest.approx(r["value"] / r["limit"])
        assert r["meets_fraction"] == (r["fraction_of_limit"] >= 0.8)
        assert 0 < r["p50_ms"] <= r["p99_ms"]
        assert r["service_cpu_s_per_gb"] > 0 and r["client_cpu_s_per_gb"] > 0
        if n == 1:
            assert r["p99_ratio"] == pytest.approx(1.0)
    for (t, n, op, b), r in rows.items():
        one = rows[(t, 1, op, b)]
        assert r["p99_ratio"] == pytest.approx(r["p99_ms"] / one["p99_ms"])
        assert r["meets_p99"] == (r["p99_ratio"] <= n)


def test_concurrency_bench_needs_one_client_to_compare_with(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as ex:
        bench_command(["concurrency", "--clients", "2,4", "--workdir", str(tmp_path)])
    assert ex.value.code == 2
