"""Where CI runs the suite (``CTXMEM_REQUIRE_DEPS=1``, set by deploy/setup.sh's test run),
every package a test guards with ``pytest.importorskip`` must import: setup.sh installs
them all, so there a broken or missing install is a failure here, not a quiet row of skips
(issue 31: a skip guard must not hide a regression). Outside CI those tests skip as they
say. The packages are found in the tests themselves, so a new guard is covered too; the
few that CI's host stage cannot have are listed with why."""

from __future__ import annotations

import ast
import importlib
import os
import platform
import shutil
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
REQUIRED = os.environ.get("CTXMEM_REQUIRE_DEPS") == "1"

#: Guarded packages the host test stage does not have, and why.
NOT_ON_THE_HOST = {
    "pyverbs": "built from rdma-core for the guest stage (deploy/ci/pyverbs-wheel.sh), "
               "after the host tests",
    "sglang": "only in the sglang-cpu side venv (test_sglang_real.py runs the test there)",
}
if platform.machine() != "x86_64":
    NOT_ON_THE_HOST["helm_python"] = "helm-python-sdk ships x86_64 wheels only (pyproject.toml)"


def guarded() -> list[str]:
    """Every module named by ``pytest.importorskip("...")`` under tests/ (the guest's
    tests/vm aside), sorted."""
    names: set[str] = set()
    for path in TESTS.rglob("*.py"):
        if "vm" in path.relative_to(TESTS).parts[:1]:
            continue
        for n in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                    and n.func.attr == "importorskip" and n.args
                    and isinstance(n.args[0], ast.Constant)):
                names.add(str(n.args[0].value))
    return sorted(names)


def test_the_guards_are_found() -> None:
    names = guarded()
    assert {"lmcache", "torch", "transformers", "boto3", "tomllib"} <= set(names)
    # Every exemption is still a guard somewhere (none left over from a removed test).
    assert set(NOT_ON_THE_HOST) <= {n.split(".")[0] for n in names}


@pytest.mark.parametrize("name", [n for n in guarded()
                                  if n.split(".")[0] not in NOT_ON_THE_HOST])
def test_a_guarded_package_imports_where_ci_runs(name: str) -> None:
    if not REQUIRED:
        pytest.skip("CTXMEM_REQUIRE_DEPS is not 1 (deploy/setup.sh sets it for CI's run)")
    importlib.import_module(name)  # raises, failing the test, when the install is broken
    assert name in sys.modules


#: Programs deploy/setup.sh installs whose absence makes tests skip (skipif on them).
PROGRAMS = {
    "valgrind": "tests/tools/test_bench_stable.py (callgrind)",
    "gcc": "tests/tools/test_bench_stable.py, the native CRC32C helper",
    "promtool": "tests/ops/test_dashboards.py (Debian's prometheus package)",
    "py-spy": "tests/tools/test_bench_profile.py (the dev extra)",
}


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_a_program_setup_installs_is_there_where_ci_runs(program: str) -> None:
    if not REQUIRED:
        pytest.skip("CTXMEM_REQUIRE_DEPS is not 1 (deploy/setup.sh sets it for CI's run)")
    beside = Path(sys.executable).with_name(program)  # a venv's console script
    assert shutil.which(program) or beside.exists(), (
        f"{program} is missing, so {PROGRAMS[program]} would skip; deploy/setup.sh "
        f"installs it")
    if program == "valgrind":
        assert Path("/usr/include/valgrind/callgrind.h").exists()


def test_ci_requires_them_before_its_pytest_run() -> None:
    setup = (TESTS.parent / "deploy" / "setup.sh").read_text()
    tests = setup.split("run_tests() {", 1)[1]
    assert tests.index("export CTXMEM_REQUIRE_DEPS=1") < tests.index(
        'pytest" -q -m "not vm and not slow" tests')
