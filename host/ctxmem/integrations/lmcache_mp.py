"""ctxmem as an L2 adapter of LMCache's multi-process (MP) server.

LMCache's MP server (``lmcache server``; what vLLM's ``LMCacheMPConnector`` and
``--kv-offloading-backend lmcache`` talk to) keeps its L1 in its own memory and loads
storage through L2 adapters. ctxmem is loaded by LMCache's ``plugin`` adapter type,
written against LMCache 0.5.6's ``lmcache.v1.distributed.l2_adapters``::

    lmcache server ... --l2-adapter '{"type": "plugin",
        "module_path": "ctxmem.integrations.lmcache_mp", "class_name": "CtxmemL2Adapter",
        "adapter_params": {"endpoint": "127.0.0.1:50051"}}'

``adapter_params`` (all optional): ``endpoint``, ``tenant``, ``transport``,
``tenant_token``, ``timeout_s``, ``workers`` (transfer threads, default 2), ``tls_ca_file``,
``tls_cert_file``, ``tls_key_file``, ``tls_server_name``, ``weights_revision`` (the
weights' digest or checkpoint id, part of the namespace). The in-process storage plugin
(:mod:`ctxmem.integrations.lmcache`) stays for LMCache's in-process engine.

Every call returns at once: tasks run on a thread pool and signal LMCache's event fds.
One ctxmem block is one LMCache object (a chunk of one KV rank and object group); the
namespace is (model, KV rank, object group, a digest of the cache salt, object bytes),
so hybrid models' groups and salted users never share blocks. "Lock" is a no-op: the
service pins blocks only for the duration of a get, and a block gone between lookup and
load is reported as a failed load, which LMCache's contract allows.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.platform import create_event_notifier

from ctxmem.client import Namespace
from ctxmem.integrations._common import (
    RateLimitedLog,
    fit_key,
    open_namespace,
    resolve_endpoint,
    resolve_tls,
    salt_tag,
    shared_client,
    weights_revision_of,
)
from ctxmem_common.layout import KVLayout

log = logging.getLogger(__name__)

_Ident = tuple[str, int, int, str, int]  # model, kv rank, group, salt, object bytes


def object_bytes(obj: Any) -> Any:
    """An LMCache memory object's payload as a flat uint8 tensor (zero copy)."""
    import torch

    raw = obj.raw_tensor if obj.raw_tensor is not None else obj.tensor
    return raw.view(torch.uint8).reshape(-1)[:int(obj.get_size())]


def desc_nbytes(desc: Any) -> int:
    """Bytes of one object of a ``MemoryLayoutDesc`` (0 when it gives none)."""
    total = 0
    for shape, dtype in zip(getattr(desc, "shapes", ()), getattr(desc, "dtypes", ()),
                            strict=False):
        n = 1
        for d in shape:
            n *= int(d)
        total += n * dtype.itemsize
    return total


class CtxmemL2Adapter(L2AdapterInterface):
    """LMCache MP L2 adapter backed by a ctxmem service."""

    def __init__(self, config: Any = None, l1_memory_desc: Any = None) -> None:
        super().__init__(max_capacity_bytes=0)  # the service evicts on its own
        params: dict[str, Any] = dict(config or {}) if isinstance(config, dict) else dict(
            getattr(config, "__dict__", {}))
        self.client = shared_client(
            resolve_endpoint(params.get("endpoint")),
            transport=str(params.get("transport", "auto")),
            tenant_token=str(params.get("tenant_token", "")),
            timeout_s=float(params.get("timeout_s", 30.0)),
            tls=resolve_tls(lambda k, d: params.get(k, d)))
        self.tenant = str(params.get("tenant", "default"))
        self.weights_revision = weights_revision_of(params.get("weights_revision"))
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._pool = ThreadPoolExecutor(max_workers=max(1, int(params.get("workers", 2))),
                                        thread_name_prefix="ctxmem-l2")
        self._lock = threading.Lock()
        self._next_id = 0
        self._stores: dict[int, L2StoreResult] = {}
        self._lookups: dict[int, Bitmap] = {}
        self._loads: dict[int, Bitmap] = {}
        self._ns: dict[_Ident, Namespace] = {}
        self._sizes: dict[tuple[str, int, int], int] = {}
        """Object bytes last stored per (model, rank, group): lookups without a layout."""
        self._warn = RateLimitedLog(log)

    # -- helpers ------------------------------------------------------------------------
    def _namespace(self, ident: _Ident) -> Namespace:
        with self._lock:
            ns = self._ns.get(ident)
        if ns is not None:
            return ns
        model, rank, group, salt, nbytes = ident
        layout = KVLayout(dtype="uint8", num_layers=1, tokens_per_block=1,
                          kv_lora_rank=nbytes, qk_rope_head_dim=0)
        tags = {"engine": "lmcache-mp", "lmcache_kv_rank": str(rank),
                "lmcache_object_group": str(group)}
        if salt:
            tags["cache_salt"] = salt_tag(salt)
        ns = open_namespace(self.client, layout, model_id=model, tenant=self.tenant,
                            tags=tags, weights_revision=self.weights_revision)
        with self._lock:
            self._ns[ident] = ns
        return ns

    def _task(self) -> int:
        with self._lock:
            self._next_id += 1
            return self._next_id

    @staticmethod
    def _groups(keys: list[Any], nbytes: Callable[[int, Any], int]
                ) -> dict[_Ident, list[int]]:
        """Indices of ``keys`` per namespace (a batch may mix ranks, groups, salts)."""
        out: dict[_Ident, list[int]] = {}
        for i, k in enumerate(keys):
            ident = (k.model_name, int(k.kv_rank), int(k.object_group_id), k.cache_salt,
                     nbytes(i, k))
            out.setdefault(ident, []).append(i)
        return out

    # -- event fds ----------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return int(self._store_efd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_efd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_efd.fileno())

    # -- store --------------------------------------------------------------------------
    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        task = self._task()
        self._pool.submit(self._store, task, list(keys), list(objects))
        return task

    def _store(self, task: int, keys: list[Any], objects: list[Any]) -> None:
        ok, total = True, 0
        stored: list[Any] = []
        sizes: list[int] = []
        try:
            bufs = [object_bytes(o) for o in objects]
            for ident, idx in self._groups(keys, lambda i, k: int(bufs[i].numel())).items():
                self._sizes[ident[:3]] = ident[4]
                ns = self._namespace(ident)
                res = ns.put([fit_key(bytes(keys[i].chunk_hash)) for i in idx],
                             [bufs[i] for i in idx])
                total += res.stored * ident[4]
                stored.extend(keys[i] for i in idx)
                sizes.extend([ident[4]] * len(idx))
        except Exception as exc:  # the whole task fails; LMCache may retry it
            self._warn.warning("store", "ctxmem L2 store failed: %s", exc)
            ok = False
        with self._lock:
            self._stores[task] = L2StoreResult(ok, total if ok else 0)
        if ok and stored:
            self._notify_keys_stored(stored, sizes)
        self._store_efd.notify()

    def pop_completed_store_tasks(self) -> dict[int, L2StoreResult]:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    # -- lookup and lock ----------------------------------------------------------------
    def submit_lookup_and_lock_task(self, keys: list[Any],
                                    group_layout_descs: dict[int, Any]) -> int:
        task = self._task()
        self._pool.submit(self._lookup, task, list(keys), dict(group_layout_descs or {}))
        return task

    def _nbytes_for(self, key: Any, descs: dict[int, Any]) -> int:
        n = desc_nbytes(descs.get(int(key.object_group_id)))
        return n or self._sizes.get((key.model_name, int(key.kv_rank),
                                     int(key.object_group_id)), 0)

    def _lookup(self, task: int, keys: list[Any], descs: dict[int, Any]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            for ident, idx in self._groups(keys, lambda i, k: self._nbytes_for(k, descs)
                                           ).items():
                if ident[4] <= 0:
                    continue  # no layout known for this group: a miss
                tiers = self._namespace(ident).tiers(
                    [fit_key(bytes(keys[i].chunk_hash)) for i in idx])
                for i, tier in zip(idx, tiers, strict=True):
                    if tier:
                        bitmap.set(i)
        except Exception as exc:  # never leave LMCache waiting: a failure is a miss
            self._warn.warning("lookup", "ctxmem L2 lookup failed (misses): %s", exc)
        with self._lock:
            self._lookups[task] = bitmap
        self._lookup_efd.notify()

    def query_lookup_and_lock_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        return None  # nothing is locked (see the module docstring)

    # -- load ---------------------------------------------------------------------------
    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        task = self._task()
        self._pool.submit(self._load, task, list(keys), list(objects))
        return task

    def _load(self, task: int, keys: list[Any], objects: list[Any]) -> None:
        bitmap = Bitmap(len(keys))
        accessed: list[Any] = []
        try:
            bufs = [object_bytes(o) for o in objects]
            for ident, idx in self._groups(keys, lambda i, k: int(bufs[i].numel())).items():
                ns = self._namespace(ident)
                # One key at a time would cost an RPC each; a get stops at the first
                # miss, so ask for the run from each not-yet-loaded key onwards.
                start = 0
                while start < len(idx):
                    run = idx[start:]
                    n = ns.get([fit_key(bytes(keys[i].chunk_hash)) for i in run],
                               [bufs[i] for i in run])
                    for i in run[:n]:
                        bitmap.set(i)
                        accessed.append(keys[i])
                    start += n + 1  # skip the key that missed
        except Exception as exc:  # never leave LMCache waiting: a failure is a miss
            self._warn.warning("load", "ctxmem L2 load failed (misses): %s", exc)
        with self._lock:
            self._loads[task] = bitmap
        if accessed:
            self._notify_keys_accessed(accessed)
        self._load_efd.notify()

    def query_load_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._loads.pop(task_id, None)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._store_efd.close()
        self._lookup_efd.close()
        self._load_efd.close()
