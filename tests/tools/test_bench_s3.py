"""``ctxmem bench s3 --quick``: every S3 client beside the native path through one real
service (CI checks that it runs, reads back byte-exact and reports well-formed figures,
never their size). NIXL and the AWS CLI come from their cached package directories
(deploy/ci/site.sh), as in tests/engines/test_s3_clients.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engines.test_s3_clients import side_site

REPO = Path(__file__).resolve().parents[2]


def test_quick_s3_bench_reports_each_client(tmp_path: Path) -> None:
    pytest.importorskip("boto3")
    pytest.importorskip("awscrt", reason="deploy/setup.sh installs awscrt")
    nixl, awscli = side_site("nixl"), side_site("awscli")
    out = tmp_path / "s3.json"
    roots = [str(REPO / d) for d in ("shared", "dpu", "host", "tools")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*roots, *sys.path[1:], nixl])}
    proc = subprocess.run([sys.executable, "-m", "ctxmem_common.cli", "bench", "s3", "--quick",
                           "--awscli-site", awscli, "--json", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["skipped"] == {}, doc["skipped"]
    rows = {(r["client"], r["op"]): r for r in doc["results"]}
    assert set(rows) == {(c, op) for c in ("native", "boto3", "nixl", "awscrt", "aws-cli")
                         for op in ("put", "get")}
    for r in rows.values():
        assert r["mb_s"] > 0 and r["of_native"] > 0, r
