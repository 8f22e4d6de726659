"""The vLLM connector's logic, free of vLLM imports (tested without vLLM installed).

:mod:`ctxmem.integrations.vllm` adapts vLLM's objects (``Request``, ``SchedulerOutput``,
``KVCacheBlocks``, the forward context) to the two classes here:

* :class:`SchedulerCore` -- answers "how many more tokens can be loaded" from a Lookup
  per TP rank (side-effect free; the minimum over ranks, so every rank can load what the
  scheduler promised), sends Prefetch once per request, and plans loads and saves.
* :class:`WorkerCore` -- gathers full blocks out of the paged cache and puts them, gets
  matched blocks and scatters them in (all layers at once, or layer by layer), and
  reports blocks that failed to load so ``kv_load_failure_policy="recompute"`` recovers.

Keys are vLLM's own block hashes (``request.block_hashes``): a chain over the tokens
(and vLLM's extra keys: ``cache_salt``, LoRA, multimodal hashes). The namespace adds the
model, the TP rank/size (in the layout), the KV dtype, the hash algorithm and a digest
of the request's ``cache_salt``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

from ctxmem.client import Client, Namespace
from ctxmem.integrations._common import (
    RateLimitedLog,
    tier_rank,
)
from ctxmem.integrations.vllm_types import (
    NULL_BLOCK,
    CoreMetadata,
    Namespaces,
    NamespaceSpec,
    TransferSpec,
    block_keys,
)
from ctxmem_common.errors import CtxmemError, Shed
from ctxmem_common.layout import KVLayout

__all__ = ["CoreMetadata", "NamespaceSpec", "SchedulerCore", "TransferSpec", "WorkerCore",
           "block_keys"]

log = logging.getLogger(__name__)

BlockIds = Sequence[int] | Sequence[Sequence[int]]
"""One group's block ids, or (vLLM's hybrid allocator) a tuple of every group's."""


def per_group(ids: BlockIds, num_groups: int) -> list[list[int]]:
    """``ids`` as a list of every group's block ids: a flat list is group 0's (the
    other groups, if any, then hold no blocks: :data:`NULL_BLOCK`)."""
    flat = not len(ids) or isinstance(ids[0], int)
    out = [list(cast(Sequence[int], ids))] if flat else \
        [list(g) for g in cast(Sequence[Sequence[int]], ids)]
    n = max((len(g) for g in out), default=0)
    while len(out) < num_groups:
        out.append([NULL_BLOCK] * n)
    return out[:num_groups]


@dataclass
class _ReqState:
    salt: str | None
    keys: list[bytes]
    local_blocks: int = 0
    hit_blocks: int = 0
    hit_tiers: list[str] = field(default_factory=list)
    """The service tier of each hit block, as the Lookup answered (rank 0's; the
    outermost over ranks where they differ): ``dram``, ``flash``, and with a pod tier
    ``peer`` or ``shared_flash``."""
    block_ids: list[int] = field(default_factory=list)
    group_ids: list[list[int]] = field(default_factory=list)
    """Groups 1, 2, ...'s block ids (a model with several KV cache groups)."""
    saved_upto: int = -1
    prefetched: bool = False
    load_failed: bool = False
    """A load of this request fell short and vLLM recomputes it: no second load."""


class SchedulerCore:
    """Scheduler-side logic. ``block_size`` is vLLM's (tokens per block)."""

    def __init__(self, client: Client, spec: NamespaceSpec, block_size: int, *,
                 save_decode: bool = True, prefetch: bool = True,
                 async_load: bool = False) -> None:
        self.namespaces = Namespaces(client, spec)
        self.async_load = async_load
        self.spec = spec
        self.block_size = block_size
        self.save_decode = save_decode
        self.prefetch_enabled = prefetch
        self._reqs: dict[str, _ReqState] = {}
        self._pending_loads: dict[str, TransferSpec] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ctxmem-prefetch")
        self._warn = RateLimitedLog(log)
        self.tokens_of: Callable[[str], Sequence[int]] | None = None
        """Set to a request's token ids to put them into saves (KV events need them)."""

    def _state(self, req_id: str, hashes: Sequence[Any], salt: str | None) -> _ReqState:
        st = self._reqs.get(req_id)
        if st is None:
            st = _ReqState(salt=salt, keys=block_keys(hashes))
            self._reqs[req_id] = st
        elif len(st.keys) < len(hashes):
            st.keys.extend(block_keys(hashes[len(st.keys):]))
        return st

    def on_new_request(self, req_id: str, hashes: Sequence[Any], salt: str | None) -> None:
        """First sight of a request: ask the service to stage its blocks in DRAM."""
        st = self._state(req_id, hashes, salt)
        if self.prefetch_enabled and not st.prefetched and st.keys:
            st.prefetched = True
            keys = list(st.keys)
            self._pool.submit(self._prefetch, keys, salt)

    def _prefetch(self, keys: list[bytes], salt: str | None) -> None:
        try:
            if self.spec.heads is not None:
                from ctxmem.integrations.vllm_layout import head_keys

                self.namespaces.get(0, salt).prefetch(head_keys(keys,
                                                                range(self.spec.heads[0])))
                return
            for rank in range(self.spec.tp_size):
                self.namespaces.group(rank, salt).prefetch(keys)
        except CtxmemError as exc:
            self._warn.warning("prefetch", "ctxmem prefetch failed: %s", exc)

    def lookup_hits(self, keys: Sequence[bytes], salt: str | None,
                    tiers: list[str] | None = None) -> int:
        """Leading ``keys`` stored on every TP rank (0 when the service is unreachable).
        ``tiers``, when given, receives the service tier of each hit block: the one
        farthest from the engine over the ranks (a peer's block outranks flash, flash
        outranks DRAM)."""
        if not keys:
            return 0
        hits = len(keys)
        found: list[str] = []
        try:
            if self.spec.heads is not None:
                hits, found = self._lookup_heads(keys, salt)
            for rank in range(self.spec.tp_size if self.spec.heads is None else 0):
                res = self.namespaces.group(rank, salt).lookup(keys)
                hits = min(hits, res.num_hits)
                found = [max(a, b, key=tier_rank) for a, b in
                         zip(found or res.tiers, res.tiers, strict=False)]
                if hits == 0:
                    break
        except CtxmemError as exc:
            self._warn.warning("lookup", "ctxmem lookup failed (no external hit): %s", exc)
            return 0
        if tiers is not None:
            tiers[:] = found[:hits] + [""] * max(0, hits - len(found))
        return hits

    def _lookup_heads(self, keys: Sequence[bytes], salt: str | None
                      ) -> tuple[int, list[str]]:
        """Head-sliced: blocks whose every KV head is stored, and each one's tier (the
        farthest of its heads')."""
        from ctxmem.integrations.vllm_layout import head_keys

        assert self.spec.heads is not None
        total = self.spec.heads[0]
        res = self.namespaces.get(0, salt).lookup(head_keys(keys, range(total)))
        hits = res.num_hits // total
        tiers = [max(res.tiers[i * total:(i + 1) * total] or [""], key=tier_rank)
                 for i in range(hits)]
        return hits, tiers

    def hit_sources(self, req_id: str, num_external_tokens: int) -> dict[str, int]:
        """``num_external_tokens`` split by the service tier each loaded block came
        from (keys: tier names, ``""`` when the service did not say)."""
        st = self._reqs.get(req_id)
        if st is None or num_external_tokens <= 0:
            return {}
        n = min(-(-num_external_tokens // self.block_size), len(st.hit_tiers))
        out: dict[str, int] = {}
        left = num_external_tokens
        # The first loaded block may be partly computed locally: the last blocks are full.
        for tier in reversed(st.hit_tiers[:n]):
            take = min(self.block_size, left)
            out[tier] = out.get(tier, 0) + take
            left -= take
        if left > 0:
            out[""] = out.get("", 0) + left
        return out

    def num_new_matched_tokens(self, req_id: str, hashes: Sequence[Any], num_tokens: int,
                               num_computed_tokens: int, salt: str | None) -> int:
        """Tokens beyond ``num_computed_tokens`` that ctxmem can supply. Side-effect free
        towards the service (a Lookup); may be called repeatedly. At least the last
        prompt token is always left for the engine to compute."""
        st = self._state(req_id, hashes, salt)
        if not st.prefetched:
            self.on_new_request(req_id, hashes, salt)
        max_blocks = min(len(st.keys), max(0, num_tokens - 1) // self.block_size)
        local = num_computed_tokens // self.block_size
        st.local_blocks = local
        st.hit_blocks = 0
        st.hit_tiers = []
        if local >= max_blocks or st.load_failed:
            return 0
        st.hit_blocks = self.lookup_hits(st.keys[local:max_blocks], salt, st.hit_tiers)
        return max(0, (local + st.hit_blocks) * self.block_size - num_computed_tokens)

    def _set_ids(self, st: _ReqState, ids: BlockIds, append: bool = False) -> None:
        groups = per_group(ids, self.spec.num_groups)
        if append:
            st.block_ids = st.block_ids + groups[0]
            st.group_ids = [(st.group_ids[g - 1] if g - 1 < len(st.group_ids) else [])
                            + groups[g] for g in range(1, len(groups))]
        else:
            st.block_ids, st.group_ids = groups[0], groups[1:]

    @staticmethod
    def _slice(st: _ReqState, start: int, stop: int) -> list[list[int]]:
        return [list(g[start:stop]) for g in st.group_ids]

    def update_after_alloc(self, req_id: str, block_ids: BlockIds,
                           num_external_tokens: int) -> None:
        """``block_ids``: the request's blocks, one list per KV cache group (or group 0's
        alone)."""
        st = self._reqs.get(req_id)
        if st is None:
            return
        self._set_ids(st, block_ids)
        if num_external_tokens <= 0 or req_id in self._pending_loads:
            return
        n = min(num_external_tokens // self.block_size, st.hit_blocks)
        start = st.local_blocks
        self._pending_loads[req_id] = TransferSpec(
            req_id, st.salt, st.keys[start:start + n], list(st.block_ids[start:start + n]),
            is_async=self.async_load, group_block_ids=self._slice(st, start, start + n))
        st.saved_upto = max(st.saved_upto, start + n)

    def build(self, new_reqs: Sequence[tuple[str, BlockIds]],
              cached_reqs: Sequence[tuple[str, BlockIds | None, bool]],
              tokens_after_step: Mapping[str, int],
              hashes_of: Callable[[str], tuple[Sequence[Any], int, int]]) -> CoreMetadata:
        """Plan this step. ``new_reqs``: (id, all block ids); ``cached_reqs``: (id, new
        block ids or None, resumed from preemption) -- block ids one list per KV cache
        group (or group 0's alone); ``tokens_after_step``: computed
        tokens once this step ran; ``hashes_of(id)`` -> (block hashes, publishable count,
        prompt length)."""
        meta = CoreMetadata()
        for req_id, block_ids in new_reqs:
            st = self._reqs.get(req_id)
            if st is not None:
                self._set_ids(st, block_ids)
        for req_id, new_ids, resumed in cached_reqs:
            st = self._reqs.get(req_id)
            if st is None or new_ids is None:
                continue
            self._set_ids(st, new_ids, append=not resumed)
        meta.loads = list(self._pending_loads.values())
        self._pending_loads.clear()
        for req_id, tokens in tokens_after_step.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            hashes, publishable, prompt_len = hashes_of(req_id)
            self._state(req_id, hashes, st.salt)
            limit = tokens if self.save_decode else min(tokens, prompt_len)
            full = min(limit // self.block_size, len(st.keys), publishable, len(st.block_ids))
            if st.saved_upto < 0:
                # First save of this request: blocks before the ctxmem hit may be missing
                # there (they came from vLLM's own prefix cache); find where to start.
                st.saved_upto = self.lookup_hits(st.keys[:st.local_blocks], st.salt) \
                    if st.local_blocks else 0
                if st.saved_upto == st.local_blocks:
                    st.saved_upto += st.hit_blocks
            if full > st.saved_upto:
                spec = TransferSpec(req_id, st.salt, st.keys[st.saved_upto:full],
                                    st.block_ids[st.saved_upto:full],
                                    group_block_ids=self._slice(st, st.saved_upto, full))
                if self.tokens_of is not None:
                    spec.parent = st.keys[st.saved_upto - 1] if st.saved_upto else None
                    spec.token_ids = list(self.tokens_of(req_id))[
                        st.saved_upto * self.block_size:full * self.block_size]
                meta.saves.append(spec)
                st.saved_upto = full
        return meta

    def load_failed(self, req_id: str) -> None:
        """vLLM recomputes ``req_id`` after its load fell short: offer it no more hits
        (the same blocks would fall short again)."""
        st = self._reqs.get(req_id)
        if st is not None:
            st.load_failed = True

    def request_finished(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
        self._pending_loads.pop(req_id, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class WorkerCore:
    """Worker-side logic for one TP rank."""

    def __init__(self, client: Client, spec: NamespaceSpec, tp_rank: int, *,
                 layerwise: bool = False) -> None:
        self.namespaces = Namespaces(client, spec)
        self.tp_rank = tp_rank
        self.layerwise = layerwise
        self.layer_names: list[str] = []
        self.caches: list[Any] = []
        self.fmt: Any = None
        self.group_caches: list[list[Any]] = []
        """Every KV cache group's layer caches, group 0 (``caches``) first."""
        self.group_fmts: list[Any] = []
        self._errors: set[int] = set()
        self._errors_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ctxmem-load")
        self._layer_loads: list[tuple[Future[int], TransferSpec, Any]] = []
        self._layer_index: dict[str, int] = {}
        self._async_done: set[str] = set()
        self._async_failed: set[str] = set()
        self._async_lock = threading.Lock()
        self._warn = RateLimitedLog(log)
        self.stats = {"loaded_blocks": 0, "failed_blocks": 0, "saved_blocks": 0,
                      "shed_blocks": 0}
        self.stored: list[TransferSpec] = []
        """Saves the service accepted since :meth:`take_stored` (for KV events)."""

    def register(self, caches: Mapping[str, Any], *, hint: str | None = None,
                 kv_layout: str = "NHD", num_kv_heads: int | None = None) -> KVLayout:
        from ctxmem.integrations.vllm_layout import detect_format

        self.layer_names = list(caches)
        self.caches = [caches[n] for n in self.layer_names]
        self._layer_index = {n: i for i, n in enumerate(self.layer_names)}
        self.fmt = detect_format(self.caches[0], hint=hint, kv_layout=kv_layout,
                                 num_kv_heads=num_kv_heads)
        self.group_caches, self.group_fmts = [self.caches], [self.fmt]
        return self._check(0, self.caches, self.fmt)

    def register_groups(self, groups: Sequence[Mapping[str, Any]], *,
                        hint: str | None = None, kv_layout: str = "NHD") -> list[KVLayout]:
        """Every KV cache group's layer caches (a model with several groups: vLLM's
        hybrid allocator), group 0 first. Their blocks load all at once (layer-wise
        loading covers one group only: it is turned off here, with a warning)."""
        from ctxmem.integrations.vllm_layout import detect_format

        if len(groups) == 1:
            return [self.register(groups[0], hint=hint, kv_layout=kv_layout)]
        if self.layerwise:
            log.warning("ctxmem.layerwise loads one KV cache group; this model has %d: "
                        "its blocks load all layers at once", len(groups))
            self.layerwise = False
        self.register(groups[0], hint=hint, kv_layout=kv_layout)
        layouts = [self.namespaces.spec.groups[0][1](self.tp_rank)]
        for g, caches in enumerate(groups[1:], start=1):
            tensors = list(caches.values())
            fmt = detect_format(tensors[0], hint=hint, kv_layout=kv_layout)
            self.group_caches.append(tensors)
            self.group_fmts.append(fmt)
            layouts.append(self._check(g, tensors, fmt))
        return layouts

    def _check(self, group: int, caches: Sequence[Any], fmt: Any) -> KVLayout:
        spec = self.namespaces.spec
        layout = spec.groups[group][1](self.tp_rank) if spec.groups else \
            spec.layout_for_rank(self.tp_rank)
        got = len(caches) * fmt.layer_block_nbytes
        heads = self.namespaces.spec.heads
        if heads is not None and heads[1] != fmt.num_heads:
            raise CtxmemError(
                f"ctxmem.tp_shared: this rank's cache holds {fmt.num_heads} KV heads, "
                f"the model's split expects {heads[1]}; turn ctxmem.tp_shared off")
        if got != layout.block_nbytes * (heads[1] if heads is not None else 1):
            raise CtxmemError(
                f"ctxmem: the paged KV cache of KV cache group {group} gives {got} bytes "
                f"per block ({len(caches)} layers of {fmt}), the namespace layout "
                f"{layout} expects {layout.block_nbytes}; set ctxmem.kv_format or report "
                f"this layout")
        return layout

    @property
    def multi_group(self) -> bool:
        return len(self.group_caches) > 1

    # -- loads -----------------------------------------------------------------------
    def _fetch(self, spec: TransferSpec, staging: Any) -> int:
        from ctxmem.integrations.vllm_layout import block_views

        try:
            if isinstance(staging, list):  # several KV cache groups: one block group
                grp = self.namespaces.group(self.tp_rank, spec.salt)
                return grp.get(spec.keys, [block_views(t) for t in staging])
            ns = self.namespaces.get(self.tp_rank, spec.salt)
            if self.namespaces.spec.heads is not None:
                return self._fetch_heads(ns, spec, staging)
            return ns.get(spec.keys, block_views(staging))
        except CtxmemError as exc:
            self._warn.warning("get", "ctxmem get failed (blocks will be recomputed): %s", exc)
            return 0

    def _fetch_heads(self, ns: Namespace, spec: TransferSpec, staging: Any) -> int:
        """Get this rank's heads of each block; return the leading whole blocks."""
        import torch

        from ctxmem.integrations.vllm_layout import (
            block_views,
            from_head_major,
            head_axis,
            head_keys,
        )

        heads = self.namespaces.spec.rank_heads(self.tp_rank)
        nb = len(spec.keys)
        shape = list(self.fmt.block_shape)
        del shape[head_axis(self.fmt)]
        rows = torch.empty((nb, len(heads), len(self.caches), *shape), dtype=self.fmt.dtype)
        n = ns.get(head_keys(spec.keys, heads), block_views(rows.view(nb * len(heads), -1)))
        blocks = n // len(heads)
        staging[:blocks].copy_(from_head_major(rows[:blocks], self.fmt))
        return blocks

    def _fail(self, spec: TransferSpec, n: int) -> None:
        if n < len(spec.block_ids):
            with self._errors_lock:
                if not spec.group_block_ids:
                    self._errors.update(spec.block_ids[n:])
                for ids in spec.groups() if spec.group_block_ids else ():
                    # vLLM's null block (a sliding-window group's, before the window)
                    # is no request's: never reported
                    self._errors.update(b for b in ids[n:] if b != NULL_BLOCK)
            self.stats["failed_blocks"] += len(spec.block_ids) - n
        self.stats["loaded_blocks"] += n

    def _staging(self, spec: TransferSpec) -> Any:
        """Where a load's blocks land before the scatter: one tensor, or one per KV cache
        group (a list) for a model with several."""
        import torch

        out = [torch.empty((len(spec.keys), len(c), *f.block_shape), dtype=f.dtype)
               for c, f in zip(self.group_caches or [self.caches], self.group_fmts
                               or [self.fmt], strict=True)]
        return out if self.multi_group else out[0]

    def _scatter(self, spec: TransferSpec, staging: Any, n: int) -> None:
        """The first ``n`` loaded blocks into the paged caches: every group's, except
        where a group's block is the null block (a sliding-window group keeps no block
        before its window: that part of the block group is read, and dropped)."""
        from ctxmem.integrations.vllm_layout import scatter_blocks

        if not isinstance(staging, list):
            scatter_blocks(self.caches, self.fmt, spec.block_ids[:n], staging[:n])
            return
        for ids, caches, fmt, data in zip(spec.groups(), self.group_caches,
                                          self.group_fmts, staging, strict=True):
            rows = [i for i, b in enumerate(ids[:n]) if b != NULL_BLOCK]
            if rows:
                scatter_blocks(caches, fmt, [ids[i] for i in rows], data[rows])

    def start_load(self, meta: CoreMetadata) -> None:
        """All layers now (sync), or fetch in the background and scatter per layer."""
        self._layer_loads = []
        for spec in meta.loads:
            if not spec.keys:
                continue
            staging = self._staging(spec)
            if spec.is_async:
                self._pool.submit(self._load_async, spec, staging)
                continue
            if self.layerwise:
                fut = self._pool.submit(self._fetch, spec, staging)
                self._layer_loads.append((fut, spec, staging))
                continue
            n = self._fetch(spec, staging)
            self._scatter(spec, staging, n)
            self._fail(spec, n)

    def _load_async(self, spec: TransferSpec, staging: Any) -> None:
        n = 0
        try:
            n = self._fetch(spec, staging)
            self._scatter(spec, staging, n)
        except Exception as exc:  # never leave the request waiting: report and recompute
            self._warn.warning("async", "ctxmem async load failed: %s", exc)
            n = 0
        finally:
            # Several KV cache groups: vLLM cannot map a block id back to a request (ids
            # are per group), so a short load fails the request as a whole (recomputed).
            whole = bool(spec.group_block_ids) and n < len(spec.keys)
            if whole:
                self.stats["failed_blocks"] += len(spec.keys) - n
                self.stats["loaded_blocks"] += n
            else:
                self._fail(spec, n)
            with self._async_lock:
                self._async_done.add(spec.req_id)
                if whole:
                    self._async_failed.add(spec.req_id)

    def take_finished_loads(self) -> set[str]:
        """Requests whose asynchronous load finished (their failed blocks, if any, are
        already in :meth:`take_load_errors`)."""
        with self._async_lock:
            done, self._async_done = self._async_done, set()
        return done

    def take_finished_and_failed_loads(self) -> tuple[set[str], set[str]]:
        """:meth:`take_finished_loads`, and of those the requests (of a model with
        several KV cache groups) whose load fell short: each to be recomputed whole."""
        with self._async_lock:
            done, self._async_done = self._async_done, set()
            failed, self._async_failed = self._async_failed, set()
        return done, failed

    def wait_for_layer(self, layer_name: str) -> None:
        from ctxmem.integrations.vllm_layout import scatter_blocks

        layer = self._layer_index.get(layer_name)
        if layer is None or not self._layer_loads:
            return
        for fut, spec, staging in self._layer_loads:
            n = fut.result()
            scatter_blocks(self.caches, self.fmt, spec.block_ids[:n], staging[:n],
                           layers=[layer])
        if layer == len(self.caches) - 1:
            for fut, spec, _ in self._layer_loads:
                self._fail(spec, fut.result())
            self._layer_loads = []

    def finish_loads(self) -> None:
        """Account layer-wise loads whose last layer was never waited for."""
        for fut, spec, staging in self._layer_loads:
            from ctxmem.integrations.vllm_layout import scatter_blocks

            n = fut.result()
            scatter_blocks(self.caches, self.fmt, spec.block_ids[:n], staging[:n])
            self._fail(spec, n)
        self._layer_loads = []

    def take_load_errors(self) -> set[int]:
        with self._errors_lock:
            errors, self._errors = self._errors, set()
        return errors

    # -- saves -----------------------------------------------------------------------
    def save(self, meta: CoreMetadata) -> None:
        """Put this step's full blocks (after the forward wrote them). A failed put is
        logged and dropped: a dropped save is just a future miss."""
        from ctxmem.integrations.vllm_layout import block_views, gather_blocks

        for spec in meta.saves:
            if not spec.keys:
                continue
            if self.multi_group:
                self._save_groups(spec)
                continue
            try:
                ns = self.namespaces.get(self.tp_rank, spec.salt)
                staging = gather_blocks(self.caches, self.fmt, spec.block_ids)
                keys = spec.keys
                if self.namespaces.spec.heads is not None:
                    from ctxmem.integrations.vllm_layout import head_keys, head_major

                    heads = self.namespaces.spec.rank_heads(self.tp_rank)
                    keys = head_keys(spec.keys, heads)
                    staging = head_major(staging, self.fmt).view(len(keys), -1)
                res = ns.put(keys, block_views(staging))
                self.stats["saved_blocks"] += res.stored // (
                    len(keys) // max(1, len(spec.keys)))
                if spec.token_ids:
                    self.stored.append(spec)
            except Shed as exc:  # the service's stores are backed up: dropped, counted
                self.stats["shed_blocks"] += len(spec.keys)
                self._warn.warning("shed", "ctxmem shed a save (blocks not saved): %s", exc)
            except CtxmemError as exc:
                self._warn.warning("put", "ctxmem put failed (blocks not saved): %s", exc)

    def _save_groups(self, spec: TransferSpec) -> None:
        """Put each key's blocks of every KV cache group as one block group (committed in
        all of the group's namespaces at once). A key one group no longer holds (its
        block is the null block) is left out: half a group is never stored."""
        from ctxmem.integrations.vllm_layout import block_views, gather_blocks

        groups = spec.groups()
        rows = [i for i in range(len(spec.keys))
                if all(i < len(ids) and ids[i] != NULL_BLOCK for ids in groups)]
        if not rows:
            return
        keys = [spec.keys[i] for i in rows]
        try:
            grp = self.namespaces.group(self.tp_rank, spec.salt)
            staging = [gather_blocks(c, f, [ids[i] for i in rows]) for ids, c, f in
                       zip(groups, self.group_caches, self.group_fmts, strict=True)]
            res = grp.put(keys, [block_views(t) for t in staging])
            self.stats["saved_blocks"] += res.stored // len(groups)
            if spec.token_ids and len(rows) == len(spec.keys):
                self.stored.append(spec)
        except Shed as exc:
            self.stats["shed_blocks"] += len(keys)
            self._warn.warning("shed", "ctxmem shed a save (blocks not saved): %s", exc)
        except CtxmemError as exc:
            self._warn.warning("put", "ctxmem put failed (blocks not saved): %s", exc)

    def take_stored(self) -> list[TransferSpec]:
        stored, self.stored = self.stored, []
        return stored

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
