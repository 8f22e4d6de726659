"""`ctxmem bench pod` runs end to end on small sizes and reports every row."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ctxmem_tools.bench.pod import run


def test_bench_pod_small(tmp_path: Path) -> None:
    out = tmp_path / "pod.json"
    assert run(["--total-mib", "4", "--repeat", "1", "--lookups", "3", "--json",
                str(out)]) == 0
    rows = {r["name"]: r["value"] for r in json.loads(out.read_text())["results"]}
    assert rows["TCP loopback socket, 1 stream"] > 0
    for label in ("plaintext", "mTLS 1.3 between nodes"):
        assert rows[f"cross-node get, peer fetch ({label})"] > 0
        assert rows[f"local get, TCP ({label})"] > 0
    for case in ("all local", "half remote"):
        assert 0 < rows[f"10,000-key Lookup, {case}, p50"] <= rows[
            f"10,000-key Lookup, {case}, p99"]
    assert any(math.isnan(v) for k, v in rows.items() if "shared flash" in k)
