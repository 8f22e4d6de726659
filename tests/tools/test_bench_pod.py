"""`ctxmem bench pod` runs end to end on small sizes and reports every row."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ctxmem_tools.bench.pod import run


def test_bench_pod_small(tmp_path: Path) -> None:
    out = tmp_path / "pod.json"
    assert run(["--total-mib", "4", "--repeat", "1", "--lookups", "3", "--flash-blocks",
                "8", "--workdir", str(tmp_path), "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    rows = {r["name"]: r["value"] for r in results}
    assert rows["TCP loopback socket, 1 stream"] > 0
    for label in ("plaintext", "mTLS 1.3 between nodes"):
        assert rows[f"cross-node get, peer fetch ({label})"] > 0
        assert rows[f"local get, TCP ({label})"] > 0
    for case in ("all local", "half remote"):
        assert 0 < rows[f"10,000-key Lookup, {case}, p50"] <= rows[
            f"10,000-key Lookup, {case}, p99"]
    assert math.isfinite(rows["10,000-key Lookup, remote part (half remote - all local), "
                              "median of call pairs"])
    flash = [r for r in results if "shared flash" in r["name"]]
    assert flash, "no shared-flash rows"
    for r in flash:  # every shared-flash figure comes with its O_DIRECT limit
        assert r["value"] > 0 and r["limit"] > 0 and not math.isnan(r["limit"])


def test_bench_pod_missing_workdir_is_a_usage_error_before_any_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no" / "such"
    with pytest.raises(SystemExit) as ex:
        run(["--workdir", str(missing), "--lookups", "0"])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert f"--workdir {missing}: not an existing directory" in err
    assert "Traceback" not in err
