"""``ctxmem bench --png`` and ``ctxmem chaos --png``: real PNGs with the bars and curves
the JSON says, from a quick real bench run and from the committed reports
(``--from-json``); a file that is not such a report is refused with a message.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from ctxmem_tools.bench.datapath import run as bench
from ctxmem_tools.chaos.cli import chaos_command
from ctxmem_tools.plots import bench_bars, plot_bench, plot_chaos
from tests.tools.ttyprobe import terminal_stderr

DOCS = Path(__file__).resolve().parents[2] / "docs"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG signature and IHDR chunk; fails on anything else."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    assert data[-8:-4] == b"IEND", f"{path} is truncated"
    w, h = struct.unpack(">II", data[16:24])
    return w, h


def expected_bars(doc: dict[str, Any]) -> list[str]:
    return [r["name"] for r in doc["results"]  # a NaN limit: no target, not drawn
            if not r["name"].startswith("limit_") and r["unit"] != "ms/batch"
            and r["limit"] == r["limit"]  # twins of a figure (another limit): not drawn
            and not r["name"].endswith(("_paired", "_of_two_pass"))]


def test_bench_png_from_a_quick_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quick real run on a terminal: the bar (steps, percent, ETA), then the figure."""
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    with terminal_stderr(monkeypatch) as drawn:
        assert bench(["--quick", "--batch-mib", "16", "--workdir", str(tmp_path / "work"),
                      "--json", str(out), "--png", str(png)]) == 0
        err = drawn()
    assert "ctxmem bench: 100%" in err and "14/14 steps" in err and "ETA" in err, err
    doc = json.loads(out.read_text())
    w, h = png_size(png)
    assert w > 600 and h > 600
    # Every figure is one bar (2 tags x 2 sizes x put/staged put/get/demote/cold get, the
    # verify pair of each size, the two Lookup percentiles), each its JSON fraction; its
    # twins against other limits (16 here: 8 *_paired, 8 *_of_two_pass: the put and the
    # staged put of each tag and size) are in the JSON only.
    bars = plot_bench(doc, str(tmp_path / "again.png"))
    assert [b.label for b in bars] == expected_bars(doc)
    assert len(bars) == 26
    assert len([r for r in doc["results"]
                if r["name"].endswith(("_paired", "_of_two_pass"))]) == 16
    fractions = {r["name"]: r["fraction_of_limit"] for r in doc["results"]}
    assert all(b.fraction == fractions[b.label] for b in bars)


def test_bench_png_from_committed_json(tmp_path: Path) -> None:
    png = tmp_path / "b.png"
    assert bench(["--from-json", str(DOCS / "bench-shm.json"), "--png", str(png)]) == 0
    png_size(png)
    doc = json.loads((DOCS / "bench-shm.json").read_text())
    assert [b.label for b in bench_bars(doc)] == expected_bars(doc)


def test_chaos_png_from_the_committed_campaign(tmp_path: Path) -> None:
    png = tmp_path / "c.png"
    assert chaos_command(["--from-json", str(DOCS / "chaos-10000.json"), "--png",
                          str(png)]) == 0
    w, h = png_size(png)
    assert w > 600 and h > 600
    report = json.loads((DOCS / "chaos-10000.json").read_text())
    drawn = plot_chaos(report, str(tmp_path / "again.png"))
    assert drawn["kinds"] == report["faults_by_kind"]
    assert len(drawn["kinds"]) == 28


def test_chaos_png_draws_the_timeline(tmp_path: Path) -> None:
    timeline = [{"t_s": 6.0 * i, "faults": 10 * i, "blocks_committed": 30 * i,
                 "blocks_served": 50 * i, "wrong_blocks": 0, "durable_blocks_lost": 0,
                 "restarts": i} for i in range(21)]
    report = {"faults_injected": 200, "blocks_committed": 600, "blocks_served": 1000,
              "wrong_blocks": 0, "faults_by_kind": {"bitflip_payload": 150, "eio_read": 50},
              "passed": True, "seed": 1, "timeline": timeline}
    drawn = plot_chaos(report, str(tmp_path / "t.png"))
    png_size(tmp_path / "t.png")
    assert drawn["timeline"]["faults"] == [p["faults"] for p in timeline]
    assert drawn["timeline"]["blocks_served"][-1] == 1000
    assert set(drawn["timeline"]["wrong_blocks"]) == {0}
    assert drawn["t_s"][-1] == 120.0


@pytest.mark.parametrize("command", [bench, chaos_command])
def test_from_json_refuses_a_wrong_file(tmp_path: Path, command: Any,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"something": "else"}))
    assert command(["--from-json", str(bad), "--png", str(tmp_path / "x.png")]) == 2
    assert "cannot draw" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(SystemExit):  # --from-json without --png
        command(["--from-json", str(bad)])
