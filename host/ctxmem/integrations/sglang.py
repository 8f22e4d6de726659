"""ctxmem as an SGLang HiCache storage backend (L3 under SGLang's host-memory tier).

Enable it through SGLang's dynamic backend option::

    python -m sglang.launch_server --model-path MODEL --page-size 64 \\
      --enable-hierarchical-cache --hicache-mem-layout page_first \\
      --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name":"ctxmem",
        "module_path":"ctxmem.integrations.sglang","class_name":"CtxmemHiCacheStorage",
        "interface_v1":1,"ctxmem.endpoint":"127.0.0.1:50051"}'

``interface_v1: 1`` makes SGLang call :meth:`batch_get_v1` / :meth:`batch_set_v1` with
host-pool indices; without it SGLang uses the generic :meth:`batch_get` /
:meth:`batch_set` with flat page tensors. Both work. Hybrid models (Mamba, SWA, DSA
indexer, the other "sidecar" pools) go through the v2 interface (:meth:`batch_exists_v2`,
:meth:`batch_get_v2`, :meth:`batch_set_v2` with ``PoolTransfer``\\ s): each host pool SGLang
registers (``register_mem_host_pool_v2``) gets its own namespace, keyed by the same page
hashes, and the per-pool hit policies (all pages, trailing pages, block groups) are
applied to what the service holds.

One SGLang page (``--page-size`` tokens of every layer, as the host pool's flat data
page) is one ctxmem block. Keys are SGLang's page hashes (SHA-256 chains over the page
tokens, seeded with the request's ``extra_key``/``cache_salt`` namespace, so they are
stable across restarts and salted per tenant by SGLang itself). The namespace carries the
model, the TP rank/size (MLA: one shared copy, as SGLang keeps MLA KV replicated), PP and
attention-CP rank/size, the dtype, the KV geometry and the host memory layout (the flat
page's byte order depends on it), and the weights' revision when the extra config's
``ctxmem.weights_revision`` gives one (a digest or checkpoint id: KV of other weights
under the same model name is never served).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from ctxmem.client import Namespace
from ctxmem.integrations._common import (
    RateLimitedLog,
    config_get,
    fit_key,
    open_namespace,
    resolve_endpoint,
    resolve_tls,
    shared_client,
    torch_dtype_name,
    weights_revision_of,
)
from ctxmem_common.errors import CtxmemError
from ctxmem_common.layout import KVLayout

log = logging.getLogger(__name__)


def page_key(key: str) -> bytes:
    """SGLang's 64-hex-digit page hash as its 32 bytes; any other key (v2 pool suffixes)
    as UTF-8, hashed down when longer than 64 bytes."""
    if len(key) == 64:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    return fit_key(b"s:" + key.encode())


def layout_for_pool(pool: Any, config: HiCacheStorageConfig) -> KVLayout:
    """The ctxmem layout of one host-pool page, checked against the pool's real page size."""
    page_nbytes = pool.get_dummy_flat_data_page().numel() * pool.dtype.itemsize
    dtype = torch_dtype_name(pool.dtype)
    mla = bool(config.is_mla_model)
    tp_rank, tp_size = (0, 1) if mla else (int(config.tp_rank), max(1, int(config.tp_size)))
    common: dict[str, Any] = {"dtype": dtype, "num_layers": int(pool.layer_num),
                              "tokens_per_block": int(pool.page_size),
                              "tp_rank": tp_rank, "tp_size": tp_size}
    candidates: list[KVLayout] = []
    rank = getattr(pool, "kv_lora_rank", None)
    if mla and rank:
        candidates.append(KVLayout(kv_lora_rank=int(rank),
                                   qk_rope_head_dim=int(getattr(pool, "qk_rope_head_dim", 0)),
                                   **common))
    heads, head_dim = getattr(pool, "head_num", None), getattr(pool, "head_dim", None)
    if heads and head_dim:
        v_dim = int(getattr(pool, "v_head_dim", head_dim) or head_dim)
        if (int(head_dim) + v_dim) % 2 == 0:
            candidates.append(KVLayout(num_kv_heads=int(heads),
                                       head_dim=(int(head_dim) + v_dim) // 2, **common))
    for layout in candidates:
        if layout.block_nbytes == page_nbytes:
            return layout
    # Any other pool: describe the page as opaque bytes of the right size.
    per_token = page_nbytes // int(pool.page_size)
    return KVLayout(dtype="uint8", num_layers=1, tokens_per_block=int(pool.page_size),
                    kv_lora_rank=per_token, qk_rope_head_dim=0, tp_rank=tp_rank,
                    tp_size=tp_size)


class CtxmemHiCacheStorage(HiCacheStorage):
    """HiCache L3 storage on a ctxmem service. Built by SGLang's ``StorageBackendFactory``
    as ``cls(storage_config, kwargs)``; the namespace opens when SGLang registers its
    host memory pool (it fixes the page geometry)."""

    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        self.extra = extra
        self.endpoint = resolve_endpoint(config_get(extra, "endpoint"))
        self.tenant = str(config_get(extra, "tenant", "default"))
        self.weights_revision = weights_revision_of(config_get(extra, "weights_revision"))
        self.client = shared_client(
            self.endpoint,
            transport=str(config_get(extra, "transport", "auto")),
            tenant_token=str(config_get(extra, "tenant_token", "")),
            timeout_s=float(config_get(extra, "timeout_s", 30.0)),
            tls=resolve_tls(lambda k, d: config_get(extra, k, d)),
        )
        self.mem_pool_host: Any = None
        self.ns: Namespace | None = None
        self.pools: dict[str, tuple[Any, Namespace]] = {}
        """v2: host pool and namespace per pool name (``kv`` is the anchor pool)."""
        self._lock = threading.Lock()
        self._warn = RateLimitedLog(log)
        self.stats = {"exists_calls": 0, "pages_read": 0, "pages_missed": 0,
                      "pages_written": 0, "pages_existing": 0, "errors": 0}
        pool = (kwargs or {}).get("mem_pool_host") if isinstance(kwargs, dict) else None
        if pool is not None:
            self.register_mem_pool_host(pool)

    # -- setup -----------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        ns = self._open(mem_pool_host, "kv")
        with self._lock:
            self.ns = ns
            self.pools["kv"] = (mem_pool_host, ns)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A v2 host pool (KV, Mamba, SWA, indexer...): its own namespace; ``kv`` is the
        anchor pool's namespace, so v1 and v2 calls share the KV pages."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if name == "kv" and self.ns is not None and host_pool is self.mem_pool_host:
            return
        ns = self._open(host_pool, name)
        with self._lock:
            self.pools[name] = (host_pool, ns)
            if name == "kv" and self.ns is None:
                self.ns, self.mem_pool_host = ns, host_pool

    def _open(self, mem_pool_host: Any, pool_name: str) -> Namespace:
        cfg = self.storage_config
        layout = layout_for_pool(mem_pool_host, cfg)
        tags = {
            "engine": "sglang",
            "sglang_mem_layout": str(getattr(mem_pool_host, "layout", "")),
            "sglang_pp": f"{cfg.pp_rank}/{cfg.pp_size}",
            "sglang_attn_cp": f"{cfg.attn_cp_rank}/{cfg.attn_cp_size}",
            "sglang_mla": "1" if cfg.is_mla_model else "0",
        }
        if getattr(cfg, "dcp_size", 1) > 1:
            tags["sglang_dcp"] = f"{cfg.dcp_rank}/{cfg.dcp_size}"
        if pool_name != "kv":
            tags["sglang_pool"] = pool_name
        model_id = str(config_get(self.extra, "model_id", "") or cfg.model_name or "model")
        return open_namespace(self.client, layout, model_id=model_id, tenant=self.tenant,
                              tags=tags, weights_revision=self.weights_revision)

    def _namespace(self) -> Namespace:
        if self.ns is None:
            raise CtxmemError("CtxmemHiCacheStorage used before SGLang registered its host "
                              "memory pool (register_mem_pool_host)")
        return self.ns

    def _page_bytes(self) -> int:
        return self._namespace().block_nbytes

    # -- existence -------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        try:
            return bool(self._namespace().exists([page_key(key)])[0])
        except CtxmemError as exc:
            self._failed("exists", exc)
            return False

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Leading pages stored (SGLang's prefix semantics), in one Lookup."""
        self.stats["exists_calls"] += 1
        if not keys:
            return 0
        try:
            ns = self._namespace()
            hits = ns.lookup([page_key(k) for k in keys]).num_hits
            if hits:
                ns.prefetch([page_key(k) for k in keys[:hits]])  # stage in DRAM now
            return hits
        except CtxmemError as exc:
            self._failed("lookup", exc)
            return 0

    # -- generic interface (flat page tensors) ----------------------------------------
    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        got = self.batch_get([key], [target_location] if target_location is not None else None)
        return got[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        if not keys:
            return []
        try:
            ns = self._namespace()
            if target_locations is None:
                target_locations = [self.mem_pool_host.get_dummy_flat_data_page()
                                    for _ in keys]
            n = ns.get([page_key(k) for k in keys], list(target_locations))
        except CtxmemError as exc:
            self._failed("get", exc)
            n = 0
        self.stats["pages_read"] += n
        self.stats["pages_missed"] += len(keys) - n
        return [target_locations[i] if i < n else None for i in range(len(keys))]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if not keys:
            return True
        try:
            res = self._namespace().put([page_key(k) for k in keys],
                                        [v.contiguous() for v in values])
        except CtxmemError as exc:
            self._failed("put", exc)
            return False
        self.stats["pages_written"] += res.stored
        self.stats["pages_existing"] += res.existing
        return True

    # -- zero-copy-style interface (host pool indices) --------------------------------
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Fill the host pool pages at ``host_indices`` (``page_size`` indices per key):
        one Acquire for the batch, one staging copy into the pool's layout."""
        if not keys:
            return []
        return self._read_pages(self.mem_pool_host, self._namespace(), keys, host_indices)

    def _read_pages(self, pool: Any, ns: Namespace, keys: list[str],
                    host_indices: torch.Tensor) -> list[bool]:
        """One Acquire for the leading stored run of ``keys``, one staging copy into the
        pool's pages at ``host_indices`` (``page_size`` indices per key)."""
        page = int(pool.page_size)
        staging = torch.empty((len(keys), ns.block_nbytes), dtype=torch.uint8)
        try:
            n = ns.get([page_key(k) for k in keys], [staging[i] for i in range(len(keys))])
        except CtxmemError as exc:
            self._failed("get", exc)
            n = 0
        for i in range(n):
            pool.set_from_flat_data_page(int(host_indices[i * page]),
                                         staging[i].view(pool.dtype))
        self.stats["pages_read"] += n
        self.stats["pages_missed"] += len(keys) - n
        return [i < n for i in range(len(keys))]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        if not keys:
            return []
        return self._write_pages(self.mem_pool_host, self._namespace(), keys, host_indices)

    def _write_pages(self, pool: Any, ns: Namespace, keys: list[str],
                     host_indices: torch.Tensor) -> list[bool]:
        page = int(pool.page_size)
        pages = [pool.get_data_page(int(host_indices[i * page]), flat=True).contiguous()
                 for i in range(len(keys))]
        try:
            res = ns.put([page_key(k) for k in keys], pages)
        except CtxmemError as exc:
            self._failed("put", exc)
            return [False] * len(keys)
        self.stats["pages_written"] += res.stored
        self.stats["pages_existing"] += res.existing
        return [True] * len(keys)

    # -- v2: hybrid models' pools (KV plus Mamba / SWA / indexer sidecars) -------------
    def _pool(self, name: Any) -> tuple[Any, Namespace]:
        key = str(getattr(name, "value", name))
        entry = self.pools.get(key)
        if entry is None:
            raise CtxmemError(f"SGLang pool {key!r} was never registered with "
                              f"register_mem_host_pool_v2; registered: {sorted(self.pools)}")
        return entry

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: Any = None) -> PoolTransferResult:
        """The usable prefix: leading KV pages, shrunk by every extra pool's hit policy
        (all pages / trailing pages gate it; block groups report their own verdict)."""
        self.stats["exists_calls"] += 1
        try:
            kv_pages = self._namespace().lookup([page_key(k) for k in keys]).num_hits \
                if keys else 0
            hit: dict[str, int] = {"kv": kv_pages} if kv_pages else {}
            restorable = set(range(1, kv_pages + 1))
            for t in pool_transfers or []:
                name = str(getattr(t.name, "value", t.name))
                _, ns = self._pool(t.name)
                have = [bool(x) for x in ns.tiers([page_key(k) for k in keys[:kv_pages]])]
                present = have.index(False) if False in have else len(have)
                policy = PoolHitPolicy(t.hit_policy)
                if policy == PoolHitPolicy.ALL_PAGES:
                    ok = set(range(1, present + 1))
                elif policy == PoolHitPolicy.TRAILING_PAGES:
                    tail = max(1, len(t.keys) if t.keys else 1)
                    ok = {p for p in range(1, kv_pages + 1)
                          if all(have[max(0, p - tail):p])}
                else:  # BLOCK_GROUPS: whole leading groups; never gates the KV hit
                    group = max(1, int(t.group_pages or 1))
                    full = present // group * group
                    if full:
                        hit[name] = full
                    continue
                if ok:
                    hit[name] = max(ok)
                restorable &= ok
        except CtxmemError as exc:
            self._failed("lookup", exc)
            return PoolTransferResult(0, {}, [])
        pages = sorted(restorable)
        return PoolTransferResult(pages[-1] if pages else 0, hit, pages)

    def _transfer_v2(self, transfers: list[PoolTransfer], write: bool) -> dict[str, list[bool]]:
        """Each pool's pages in one batched Get/Put; the pools whose transfers name the
        same pages (the KV pool and the pools SGLang moves page for page with it) as one
        block group (ctxmem.group): committed in every pool at once, loaded only where
        every pool's page is there and verifies."""
        out: dict[str, list[bool]] = {}
        bundles: dict[tuple[str, ...], list[tuple[str, Any, Namespace, Any]]] = {}
        for t in transfers:
            name = str(getattr(t.name, "value", t.name))
            keys = list(t.keys or [])
            try:
                pool, ns = self._pool(t.name)
            except CtxmemError as exc:
                self._failed("v2", exc)
                out[name] = [False] * len(keys)
                continue
            need = len(keys) * int(pool.page_size)
            if t.host_indices is None or t.host_indices.numel() != need:
                log.error("SGLang %s transfer for pool %s: %s host indices for %d pages "
                          "of %d tokens; skipped", "write" if write else "read", name,
                          None if t.host_indices is None else t.host_indices.numel(),
                          len(keys), int(pool.page_size))
                out[name] = [False] * len(keys)
                continue
            bundles.setdefault(tuple(keys), []).append((name, pool, ns, t.host_indices))
        for keys_t, members in bundles.items():
            keys = list(keys_t)
            if len(members) == 1 or not keys:
                name, pool, ns, idx = members[0]
                io = self._write_pages if write else self._read_pages
                for name, pool, ns, idx in members:
                    out[name] = io(pool, ns, keys, idx) if keys else []
                continue
            io_group = self._write_group if write else self._read_group
            done = io_group(members, keys)
            for name, *_ in members:
                out[name] = done
        return out

    def _read_group(self, members: list[tuple[str, Any, Namespace, Any]], keys: list[str]
                    ) -> list[bool]:
        """One group get of ``keys`` in every member pool; the leading pages whose every
        pool's block verified are copied into each pool's pages."""
        stagings = [torch.empty((len(keys), ns.block_nbytes), dtype=torch.uint8)
                    for _, _, ns, _ in members]
        nss = [ns for _, _, ns, _ in members]
        try:
            n = nss[0].client.open_group(nss).get(
                [page_key(k) for k in keys], [[st[i] for i in range(len(keys))]
                                              for st in stagings])
        except CtxmemError as exc:
            self._failed("get", exc)
            n = 0
        for (_, pool, _, idx), staging in zip(members, stagings, strict=True):
            page = int(pool.page_size)
            for i in range(n):
                pool.set_from_flat_data_page(int(idx[i * page]), staging[i].view(pool.dtype))
        self.stats["pages_read"] += n * len(members)
        self.stats["pages_missed"] += (len(keys) - n) * len(members)
        return [i < n for i in range(len(keys))]

    def _write_group(self, members: list[tuple[str, Any, Namespace, Any]], keys: list[str]
                     ) -> list[bool]:
        """One group put of ``keys``' pages of every member pool (one Commit)."""
        pages = [[pool.get_data_page(int(idx[i * int(pool.page_size)]), flat=True).contiguous()
                  for i in range(len(keys))] for _, pool, _, idx in members]
        nss = [ns for _, _, ns, _ in members]
        try:
            res = nss[0].client.open_group(nss).put([page_key(k) for k in keys], pages)
        except CtxmemError as exc:
            self._failed("put", exc)
            return [False] * len(keys)
        self.stats["pages_written"] += res.stored
        self.stats["pages_existing"] += res.existing
        return [True] * len(keys)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: Any = None) -> dict[str, list[bool]]:
        return self._transfer_v2(transfers, write=False)

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: Any = None) -> dict[str, list[bool]]:
        return self._transfer_v2(transfers, write=True)

    # -- the rest --------------------------------------------------------------------
    def clear(self) -> bool:
        """Not supported from the engine: ctxmem namespaces are shared by every engine of
        the deployment and outlive this one (delete keys or namespaces through the
        service)."""
        log.warning("CtxmemHiCacheStorage.clear(): ignored; ctxmem blocks are shared and "
                    "durable, delete them through the ctxmem service")
        return False

    def get_stats(self) -> dict[str, int]:
        return dict(self.stats)

    def close(self) -> None:
        self.ns = None

    def _failed(self, what: str, exc: Exception) -> None:
        self.stats["errors"] += 1
        self._warn.warning(what, "ctxmem %s failed (treated as a miss): %s", what, exc)
