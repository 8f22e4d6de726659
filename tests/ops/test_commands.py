"""The `ctxmem` subcommands pyproject.toml registers resolve to callables, and the new
ones run through the dispatcher's own loading (entry points are read from installed
metadata, so this checks the declarations in the source tree, not the installed copy)."""

from __future__ import annotations

import contextlib
import importlib
import io
import subprocess
import sys
from pathlib import Path

import pytest

# tomllib is 3.11+ (the project's CI Python); the project supports 3.10.
tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
REPO = Path(__file__).resolve().parents[2]


def commands() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return dict(project["entry-points"]["ctxmem.commands"])


def load(target: str) -> object:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def test_status_and_config_registered() -> None:
    assert commands()["status"] == "ctxmem_dpu.status.command:status_command"
    assert commands()["config"] == "ctxmem_common.configcheck:config_command"


@pytest.mark.parametrize("name", ["status", "config", "serve", "check"])
def test_entry_point_resolves(name: str) -> None:
    fn = load(commands()[name])
    assert callable(fn)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exc:
        fn(["--help"])  # type: ignore[operator]
    assert exc.value.code == 0
    assert f"ctxmem {name}" in out.getvalue()


def test_status_imports_no_shim_or_torch() -> None:
    """`ctxmem status` runs on a bare service install: no shim, no torch."""
    code = ("import sys, ctxmem_dpu.status.command, ctxmem_dpu.status.render; "
            "bad = [m for m in ('torch', 'ctxmem', 'ctxmem_tools') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
