"""``ctxmem demo`` end to end against a real service, with every warning shown
(``PYTHONWARNINGS=default``): it succeeds (the loaded KV reproduces the recompute, from DRAM
and cold from flash) and prints no deprecation or other warning (it printed four from
transformers, issue 31). A short prompt keeps it to seconds."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from tests.conftest import ServiceHandle

pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_the_demo_prints_no_warning(service_factory: Callable[..., ServiceHandle]) -> None:
    svc = service_factory()
    env = {**os.environ, "PYTHONWARNINGS": "default", "TRANSFORMERS_VERBOSITY": "warning"}
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from ctxmem_tools.cli import demo_command; "
                               "sys.exit(demo_command(sys.argv[1:]))",
         "--endpoint", svc.endpoint, "--prompt-tokens", "64", "--new-tokens", "16"],
        capture_output=True, text=True, timeout=300, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "demo OK" in out.stdout, text
    assert "hit rate 100% (4/4 blocks, from dram)" in out.stdout, text
    assert "hit rate 100% (4/4 blocks, from flash)" in out.stdout, text
    noisy = [line for line in text.splitlines()
             if "warn" in line.lower() or "deprecat" in line.lower()]
    assert noisy == [], text
