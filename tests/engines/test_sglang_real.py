"""SGLang's own HiCache code driving ctxmem, in CI (no GPU, no SGLang server).

``sglang==0.5.23`` cannot be installed into the main venv (it requires a CUDA torch), so
``deploy/ci/engine-venv.sh sglang-cpu`` builds a side venv with SGLang ``--no-deps`` next
to the CPU torch, and ``test_sglang_backend.py`` runs under pytest in that venv: SGLang's
``HiCacheStorage``, ``HiCacheStorageConfig``, ``PoolTransfer``/``PoolTransferResult`` and
``StorageBackendFactory`` are real there; the host pools are stand-ins (SGLang's
``MHATokenToKVPoolHost`` and Mamba/SWA host pools import its CUDA stack). An SGLang
server does not run: it needs CUDA. ``CTXMEM_SKIP_ENGINE_VENVS=1`` skips this.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_sglang_backend_under_real_sglang() -> None:
    if os.environ.get("CTXMEM_SKIP_ENGINE_VENVS") == "1":
        pytest.skip("CTXMEM_SKIP_ENGINE_VENVS=1: the sglang-cpu side environment is off")
    if os.environ.get("CTXMEM_IN_SIDE_VENV") == "1":
        pytest.skip("already inside the side venv")
    out = subprocess.run(["bash", str(REPO / "deploy" / "ci" / "engine-venv.sh"),
                          "sglang-cpu"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, ("could not build the sglang-cpu side environment "
                                 "(deploy/ci/engine-venv.sh sglang-cpu):\n"
                                 + out.stderr[-3000:])
    python = out.stdout.strip().splitlines()[-1]
    roots = [str(REPO / d) for d in ("shared", "dpu", "host", "tools")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(roots), "CTXMEM_IN_SIDE_VENV": "1"}
    run = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                          "tests/engines/test_sglang_backend.py"], cwd=REPO,
                         capture_output=True, text=True, timeout=600, env=env)
    tail = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail, tail
