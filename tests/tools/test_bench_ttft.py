"""``ctxmem bench ttft`` on the tiny model: runs end to end, writes JSON and a PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from ctxmem_tools.bench.ttft import run

QUICK = [
    "--model-config",
    "tiny",
    "--tokens-per-block",
    "32",
    "--new-tokens",
    "16",
    "--repeats",
    "1",
]


def test_bench_ttft_against_a_running_service(service: Any, tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "ttft.json", tmp_path / "ttft.png"
    rc = run(
        [
            *QUICK,
            "--lengths",
            "64,128",
            "--endpoint",
            service.endpoint,
            "--json",
            str(out_json),
            "--png",
            str(out_png),
        ]
    )
    assert rc == 0
    doc = json.loads(out_json.read_text())
    assert doc["benchmark"] == "ttft" and doc["params"]["model_config"] == "tiny"
    names = {(r["name"], r["prefix_tokens"]) for r in doc["results"]}
    for n in (64, 128):
        for name in (
            "ttft.recompute",
            "ttft.load_dram",
            "ttft.load_flash",
            "prefill.new_tokens",
            "speedup.load_dram",
            "get.flash_bandwidth",
        ):
            assert (name, n) in names
    for r in doc["results"]:
        assert set(r) >= {"name", "value", "unit", "prefix_tokens"}
        assert r["value"] > 0, r
    assert doc["checks"] == {"same_first_token": True, "flash_tiers_ok": True}
    assert doc["costmodel"]["snapshot"]["prefill"]["calibrated"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_ttft_starts_its_own_service(tmp_path: Path) -> None:
    out_json = tmp_path / "ttft.json"
    rc = run(
        [
            *QUICK,
            "--lengths",
            "64",
            "--no-flash",
            "--no-encryption",
            "--workdir",
            str(tmp_path / "svc"),
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    doc = json.loads(out_json.read_text())
    assert doc["params"]["encryption"] is False
    assert not any(r["name"] == "ttft.load_flash" for r in doc["results"])


def test_bench_ttft_rejects_lengths_off_the_block_grid(capsys: Any) -> None:
    assert run([*QUICK, "--lengths", "100"]) == 2
    assert "multiples" in capsys.readouterr().err
