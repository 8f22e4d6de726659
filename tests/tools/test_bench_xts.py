"""``ctxmem bench xts --quick``: both AES-XTS implementations are measured side by side
(CI checks that it runs and reports well-formed figures, never their size)."""

from __future__ import annotations

import json
from pathlib import Path

from ctxmem_tools.cli import bench_command


def test_quick_xts_bench_reports_each_implementation(tmp_path: Path) -> None:
    out = tmp_path / "xts.json"
    assert bench_command(["xts", "--quick", "--sizes", "64KiB,1MiB", "--threads", "1,2",
                          "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    cases = {(r["impl"], r["size"], r["threads"]) for r in doc["results"]}
    assert cases == {(i, s, t) for i in ("openssl", "cryptography")
                     for s in (65536, 1 << 20) for t in (1, 2)}
    for r in doc["results"]:
        assert r["wall_us_per_record"] > 0 and r["cpu_us_per_record"] > 0, r
        assert r["gb_per_s"] > 0 and r["speed_vs_openssl"] > 0, r
    assert doc["active"].startswith(("openssl", "cryptography"))
