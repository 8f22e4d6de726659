"""The vLLM flags docs/deploy.md gives, checked with vLLM's own code (side venv).

Run by ``test_vllm_real.py`` (``python tests/engines/vllm_flags_check.py WORKDIR``).
Every ``--kv-transfer-config '<JSON>'`` in docs/deploy.md is parsed by vLLM's CLI
parser (``EngineArgs.add_cli_args``), its connector resolved by vLLM's
``KVConnectorFactory`` and, for the offloading tier, the tier class by vLLM's
``SecondaryTierFactory``. Then the documented warning: ``--kv-offloading-size``
overwrites a configured connector (engine configs built from the tiny model).
Prints ``FLAGS OK``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def doc_configs() -> list[str]:
    text = (REPO / "docs" / "deploy.md").read_text()
    return re.findall(r"--kv-transfer-config '(\{.*?\})'", text, flags=re.S)


def main(workdir: Path) -> int:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm_e2e import build_model

    ok = True
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    configs = doc_configs()
    print("configs in docs/deploy.md:", len(configs), flush=True)
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
        else:  # LMCache's connectors import LMCache, which this venv does not carry
            ok = ok and name in KVConnectorFactory._registry
            print(name, "registered:", name in KVConnectorFactory._registry, flush=True)
        for tier in (cfg.kv_connector_extra_config or {}).get("secondary_tiers", []):
            tcls = SecondaryTierFactory.get_tier_class(tier)
            print("tier", tier["type"], "->", tcls.__module__, flush=True)
            ok = ok and tcls.__name__ == "CtxmemSecondaryTier"
    if seen != {"CtxmemConnector", "OffloadingConnector", "LMCacheConnectorV1",
                "LMCacheMPConnector"}:
        print("FAIL: docs/deploy.md lost a connector config:", sorted(seen))
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
