"""``ctxmem bench stable --quick``: callgrind instruction counts of the client's put and get
against a real service. CI checks that the mode runs and its counts are well formed
(every phase counted, per block = total / blocks, a 2 MiB block costs more than a
64 KiB one), never their size. Skipped, saying why, where valgrind, its callgrind.h or
a C compiler is missing (deploy/setup.sh installs valgrind)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ctxmem_tools.cli import bench_command

MISSING = [what for what, ok in (
    ("valgrind", shutil.which("valgrind")),
    ("gcc", shutil.which("gcc") or shutil.which("cc")),
    ("valgrind/callgrind.h", Path("/usr/include/valgrind/callgrind.h").exists()),
) if not ok]


@pytest.mark.skipif(bool(MISSING), reason=f"instruction counts need {MISSING} "
                    "(apt-get install valgrind gcc)")
def test_quick_stable_bench_counts_every_phase(tmp_path: Path) -> None:
    out = tmp_path / "stable.json"
    assert bench_command(["stable", "--quick", "--workdir", str(tmp_path / "work"),
                          "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {r["name"]: r for r in doc["results"]}
    assert set(rows) == {"put_64KiB_shm", "get_64KiB_shm", "put_2MiB_shm", "get_2MiB_shm"}
    batch = doc["params"]["batch_mib"] << 20
    for r in rows.values():
        assert r["instructions"] > 0
        assert r["blocks"] == doc["params"]["rounds"] * batch // r["block"]
        assert r["instructions_per_block"] == pytest.approx(r["instructions"] / r["blocks"])
        assert r["instructions_per_gb"] == pytest.approx(
            r["instructions"] / (doc["params"]["rounds"] * batch / 1e9))
    # A 2 MiB block is copied and checked 32x the bytes of a 64 KiB one.
    assert rows["get_2MiB_shm"]["instructions_per_block"] > \
        rows["get_64KiB_shm"]["instructions_per_block"]


def test_stable_bench_batch_must_hold_a_block(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as ex:
        bench_command(["stable", "--batch-mib", "1", "--workdir", str(tmp_path)])
    assert ex.value.code == 2
