"""``ctxmem bench recovery`` runs end to end on small images (the 1M-block figures are in
docs/reliability.md): a generated image and one written through the service, each
recovered by the real service, every sampled block found and read back intact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ctxmem_tools.bench.recovery import run
from tests.tools.ttyprobe import terminal_stderr


def test_recovery_bench_small(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "rec.json"
    with terminal_stderr(monkeypatch) as drawn:  # on a terminal: a bar over the blocks
        assert run(["--blocks", "3000", "--slab-size", "4MiB", "--through-service", "300",
                    "--dir", str(tmp_path / "imgs"), "--json", str(out)]) == 0
        err = drawn()
    assert "ctxmem bench recovery: 100%" in err and "3300/3300 blocks" in err, err
    assert "ETA" in err, err
    res = json.loads(out.read_text())
    rows = {r["source"]: r for r in res["results"]}
    assert rows["generated"]["recovered_blocks"] == 3000
    assert rows["service"]["recovered_blocks"] == 300
    assert all(r["verified"] == min(r["blocks"], 1000) for r in res["results"])
    assert res["machine"]["read_gb_s"] > 0
