"""``ctxmem bench concurrency --quick``: 1 and 2 client processes over shm and TCP against a
real service. CI checks that the mode runs and that its figures are well formed (every
row present, values and limits positive, fractions = value / limit, CPU per GB
positive), never how fast anything is. The copy limit's sizing (bench/copylimit.py) is
checked as a unit: its working set must exceed the cache it reports."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ctxmem_tools.bench.concurrency import (
    COPY_METHODS,
    LIMIT_ROUND_FACTOR,
    REUSED_METHODS,
    plan,
)
from ctxmem_tools.bench.copylimit import (
    ASSUMED_CACHE,
    copier,
    last_level_cache_bytes,
    make_pairs,
    parse_cache_size,
    size_limit,
)
from ctxmem_tools.cli import bench_command


def test_quick_concurrency_bench_reports_every_row(tmp_path: Path) -> None:
    out = tmp_path / "cc.json"
    assert bench_command(["concurrency", "--quick", "--workdir", str(tmp_path / "work"),
                          "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["params"]["clients"] == [1, 2]
    assert doc["params"]["limit_rounds"] == 2 * LIMIT_ROUND_FACTOR
    assert set(doc["limits"]) == {"1", "2"}
    for lim in doc["limits"].values():
        assert all(lim[m] > 0 for m in COPY_METHODS)
        assert lim["best"] == max(lim[m] for m in COPY_METHODS)
        assert lim["best_reused"] == max(lim[m] for m in REUSED_METHODS) > 0
        assert all(lim[f"{m}_cpu_s_per_gb"] > 0 for m in COPY_METHODS)
    sizing = doc["limit_sizing"]
    assert sizing["batch"] == 8 << 20
    assert sizing["per_process_bytes"] == 2 * sizing["batch"] * sizing["pairs"]
    assert sizing["per_process_bytes"] >= 2 * sizing["cache_bytes"] > 0
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


MiB = 1 << 20


@pytest.mark.parametrize("cache", [1 * MiB, 32 * MiB, 33 * MiB, 256 * MiB])
@pytest.mark.parametrize("batch", [64 << 10, 2 * MiB, 8 * MiB, 32 * MiB, 100 * MiB])
def test_limit_working_set_exceeds_the_cache(batch: int, cache: int) -> None:
    s = size_limit(batch, cache)
    assert s.cache_bytes == cache and s.cache_from_sysfs and s.batch == batch
    assert s.pairs >= 2  # consecutive rounds never copy the same buffers
    assert s.per_process_bytes == 2 * batch * s.pairs
    assert s.per_process_bytes >= 2 * cache
    assert s.reuse_distance_bytes >= cache  # a pair is evicted before it comes round again
    assert f"{cache / MiB:g} MiB" in s.describe()


def test_limit_sizing_without_a_known_cache_assumes_one() -> None:
    s = size_limit(32 * MiB, None)
    assert not s.cache_from_sysfs and s.cache_bytes == ASSUMED_CACHE
    assert s.per_process_bytes >= 2 * ASSUMED_CACHE
    assert "assumed" in s.describe()


def _cache_dir(root: Path, idx: int, level: int, kind: str, size: str) -> None:
    d = root / f"index{idx}"
    d.mkdir(parents=True)
    for name, text in (("level", f"{level}\n"), ("type", f"{kind}\n"), ("size", f"{size}\n")):
        (d / name).write_text(text)


def test_last_level_cache_is_the_highest_data_or_unified_level(tmp_path: Path) -> None:
    _cache_dir(tmp_path, 0, 1, "Data", "48K")
    _cache_dir(tmp_path, 1, 1, "Instruction", "32K")
    _cache_dir(tmp_path, 2, 2, "Unified", "1024K")
    _cache_dir(tmp_path, 3, 3, "Unified", "32768K")
    assert last_level_cache_bytes(tmp_path) == 32 * MiB
    assert last_level_cache_bytes(tmp_path / "missing") is None
    assert [parse_cache_size(t) for t in ("512", "8M", "1G")] == [512, 8 * MiB, 1 << 30]
    with pytest.raises(ValueError, match="cache size"):
        parse_cache_size("lots")


@pytest.mark.parametrize("method", COPY_METHODS)
def test_limit_copy_rotates_over_its_pairs(method: str) -> None:
    s = size_limit(64 << 10, 256 << 10)
    pairs = make_pairs(s, seed=1)
    assert len(pairs) == s.pairs and all(not np.array_equal(a, b) for a, b in pairs)
    copy, close = copier(method, pairs, threads=2)
    try:
        copy(1)
        for i, (src, dst) in enumerate(pairs):
            assert np.array_equal(src, dst) == (i == 1)
        copy(s.pairs)  # round P comes back to pair 0
        assert np.array_equal(*pairs[0])
    finally:
        close()


def test_limit_copies_run_more_rounds_than_ops() -> None:
    """A copy round is milliseconds: the limit's best round is taken over more of them
    (one where every process had a core), the ops keep the rounds asked for."""
    phases = plan([2 * MiB, 64 << 10])
    assert {p.name for p in phases if p.kind == "copy"} == {*COPY_METHODS, *REUSED_METHODS}
    assert LIMIT_ROUND_FACTOR > 1
    for p in phases:
        assert p.rounds(8) == (8 * LIMIT_ROUND_FACTOR if p.kind == "copy" else 8)
