"""`ctxmem bench qos` runs end to end on small sizes: a victim tenant's gets idle and under
another tenant's flood (a spawned process), every row reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ctxmem_tools.bench.qos import run


def test_bench_qos_small(tmp_path: Path) -> None:
    out = tmp_path / "qos.json"
    assert run(["--rounds", "3", "--victim-mib", "1", "--flood-mib", "4", "--block-kib",
                "64", "--workdir", str(tmp_path), "--json", str(out)]) == 0
    rows = {r["name"]: r["value"] for r in json.loads(out.read_text())["results"]}
    for phase in ("idle", "flood"):
        for what in ("DRAM-hit get", "cold get"):
            assert 0 < rows[f"victim {what}, {phase}, p50"] <= rows[
                f"victim {what}, {phase}, p99"]
    for what in ("DRAM-hit get", "cold get"):
        assert rows[f"victim {what} p99, flood / idle (target <= 1.5)"] > 0
    assert rows["flood throughput (put + cold get)"] > 0
    assert rows["puts shed (the service's count)"] >= rows["flood puts shed (its count)"]


def test_bench_qos_missing_workdir_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as ex:
        run(["--workdir", str(tmp_path / "nope")])
    assert ex.value.code == 2
