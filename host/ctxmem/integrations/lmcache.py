"""ctxmem as an LMCache storage backend (LMCache's storage plugin interface).

Enable it in the LMCache config (``LMCACHE_CONFIG_FILE``)::

    chunk_size: 256
    local_cpu: true            # LMCache's L1; also the allocator this plugin loads into
    storage_plugins: ["ctxmem"]
    extra_config:
      storage_plugin.ctxmem.module_path: ctxmem.integrations.lmcache
      storage_plugin.ctxmem.class_name: CtxmemBackend
      ctxmem.endpoint: "127.0.0.1:50051"   # or $CTXMEM_ENDPOINT
      ctxmem.tenant: "default"
      ctxmem.transport: "auto"             # shm | tcp | auto
      ctxmem.weights_revision: ""          # the weights' digest: KV of others never served

Each LMCache chunk is one ctxmem block. The namespace is chosen per key from what
LMCache's ``CacheEngineKey`` carries -- model name, world size, worker id (the TP rank),
KV dtype and every ``lmcache.tag.*`` request tag -- plus the chunk geometry (layers, KV
heads, head size, chunk size, MLA or not, memory format). A ``cachesalt``/``cache_salt``
tag (LMCache's per-tenant salt, e.g. from ``kv_transfer_params``) becomes the namespace
tag ``cache_salt`` as a digest (two salts never share blocks; the salt is not sent). The
block key is the chunk hash. Because the namespace and the keys are derived from the
engine's own deterministic data, a restarted engine (same ``PYTHONHASHSEED`` with
LMCache's ``builtin`` hash, or a sha256 ``pre_caching_hash_algorithm``) finds what a
previous one stored, and a restarted service recovers its index from flash.

Several KV groups (hybrid models; :mod:`ctxmem.integrations.lmcache_groups`): each
group's bytes go to a namespace with that group's layout and the tag ``lmcache_kv_group``
``<i>/<n>``, and the namespaces form one block group (:mod:`ctxmem.group`): a chunk is
committed in every group at once, and hits and loads only when every group holds it and
verifies.

Partial last chunks (``save_unfull_chunk: true``) go to a sibling namespace (tag
``lmcache_partial=1``) padded to a full block, with the token count in the block's last
four bytes (a partial chunk always leaves at least one token of slack there).

Failures degrade to misses: ``contains`` answers False, gets return nothing, and puts are
dropped with a rate-limited warning, so LMCache recomputes instead of stalling.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import (
    AllocatorBackendInterface,
    StoragePluginInterface,
)

from ctxmem.client import Namespace
from ctxmem.group import NamespaceGroup
from ctxmem.integrations._common import (
    RateLimitedLog,
    config_get,
    fit_key,
    open_namespace,
    resolve_endpoint,
    resolve_tls,
    salt_tag,
    shared_client,
    torch_dtype_name,
    weights_revision_of,
)
from ctxmem.integrations.lmcache_groups import (
    KVGroup,
    expected_format,
    group_bytes,
    group_layout,
    kv_groups,
)
from ctxmem_common.errors import CtxmemError

log = logging.getLogger(__name__)

_SALT_TAGS = ("cachesalt", "cache_salt")
_TRAILER = 4  # bytes of token count at the end of a padded partial chunk


def _unit(nss: list[Namespace]) -> NamespaceGroup:
    """The KV groups' namespaces as one block group (one namespace: that namespace's
    own calls, as before groups)."""
    return nss[0].client.open_group(nss)


def encode_chunk_key(key: CacheEngineKey) -> bytes:
    """The ctxmem block key of an LMCache key: its chunk hash (int or bytes), plus the
    layer id for layer-wise keys. Type-prefixed so an int and a bytes hash never collide."""
    h = key.chunk_hash
    if isinstance(h, (bytes, bytearray)):
        raw = b"\x01" + bytes(h)
    else:
        value = int(h)
        length = max(8, (value.bit_length() + 8) // 8)
        raw = b"\x00" + value.to_bytes(length, "big", signed=True)
    layer_id = getattr(key, "layer_id", None)
    if layer_id is not None:
        raw = fit_key(raw)[:61] + b"\x02" + int(layer_id).to_bytes(2, "big")
    return fit_key(raw)


class CtxmemBackend(StoragePluginInterface):
    """LMCache storage plugin backed by a ctxmem service.

    Constructed by LMCache's ``storage_plugin_launcher`` with keyword arguments
    ``config, metadata, local_cpu_backend, loop, dst_device``. Memory objects returned by
    gets are allocated from ``local_cpu_backend`` (LMCache's own allocator backend).
    """

    def __init__(
        self,
        config: Any = None,
        metadata: Any = None,
        local_cpu_backend: Any = None,
        loop: asyncio.AbstractEventLoop | None = None,
        dst_device: str = "cpu",
    ) -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        if metadata is None:
            raise ValueError("CtxmemBackend needs LMCache's engine metadata")
        if local_cpu_backend is None:
            raise ValueError("CtxmemBackend needs LMCache's local_cpu_backend (its allocator)")
        extra = dict(getattr(config, "extra_config", None) or {})
        self.extra = extra
        self.endpoint = resolve_endpoint(config_get(extra, "endpoint"))
        self.tenant = str(config_get(extra, "tenant", "default"))
        # Part of the namespace: KV of other weights under the same model name is never
        # served (LMCache knows no revision: the setting, else none).
        self.weights_revision = weights_revision_of(config_get(extra, "weights_revision"))
        self.client = shared_client(
            self.endpoint,
            transport=str(config_get(extra, "transport", "auto")),
            tenant_token=str(config_get(extra, "tenant_token", "")),
            timeout_s=float(config_get(extra, "timeout_s", 30.0)),
            tls=resolve_tls(lambda k, d: config_get(extra, k, d)),
        )
        self.chunk_size = int(getattr(config, "chunk_size", None) or metadata.chunk_size)
        self.layerwise = bool(getattr(config, "use_layerwise", False))
        self.use_mla = bool(metadata.use_mla)
        self.fmt = expected_format(config, layerwise=self.layerwise, use_mla=self.use_mla)
        self._warn = RateLimitedLog(log)
        self._namespaces: dict[tuple[Any, ...], Namespace] = {}
        self._ns_lock = threading.Lock()
        self._put_lock = threading.Lock()
        self._put_keys: set[CacheEngineKey] = set()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ctxmem-lmcache-put")
        self._closed = False

    def __str__(self) -> str:
        return f"CtxmemBackend({self.endpoint})"

    # -- namespaces and layouts ------------------------------------------------------
    def _groups_now(self) -> list[KVGroup]:
        """The KV groups, read at each use (LMCache builds them when the engine registers
        its KV caches, after this backend exists). Layer-wise chunks have one group."""
        groups = kv_groups(self.metadata)
        return groups[:1] if self.layerwise else groups

    def _tags(self, group: KVGroup, key: CacheEngineKey, partial: bool) -> dict[str, str]:
        tags = {
            "engine": "lmcache",
            "lmcache_world_size": str(key.world_size),
            "lmcache_worker_id": str(key.worker_id),
            "lmcache_dtype": torch_dtype_name(key.dtype),
            "lmcache_fmt": self.fmt.name,
        }
        if self.layerwise:
            tags["lmcache_layerwise"] = "1"
        if partial:
            tags["lmcache_partial"] = "1"
        if group.count > 1:
            tags["lmcache_kv_group"] = f"{group.index}/{group.count}"
        for name, value in key.tags or ():
            if name in _SALT_TAGS:
                tags["cache_salt"] = salt_tag(str(value))
            else:
                tags[f"lmcache_tag_{name}"] = str(value)
        return tags

    def _namespace(self, key: CacheEngineKey, partial: bool = False,
                   group: KVGroup | None = None) -> Namespace:
        group = group or self._groups_now()[0]
        ident = (key.model_name, key.world_size, key.worker_id, str(key.dtype),
                 key.tags, partial, group)
        ns = self._namespaces.get(ident)
        if ns is not None:
            return ns
        with self._ns_lock:
            ns = self._namespaces.get(ident)
            if ns is None:
                model_id = str(config_get(self.extra, "model_id", key.model_name)) or "model"
                layout = group_layout(group, key, chunk_size=self.chunk_size,
                                      layerwise=self.layerwise, use_mla=self.use_mla,
                                      extra=self.extra)
                ns = open_namespace(self.client, layout, model_id=model_id,
                                    tenant=self.tenant, tags=self._tags(group, key, partial),
                                    weights_revision=self.weights_revision)
                self._namespaces[ident] = ns
            return ns

    def _namespaces_of(self, key: CacheEngineKey, partial: bool = False
                       ) -> list[Namespace]:
        """One namespace per KV group, in the groups' order."""
        return [self._namespace(key, partial, g) for g in self._groups_now()]

    @staticmethod
    def _runs(keys: Sequence[CacheEngineKey]) -> list[tuple[int, int]]:
        """Runs of consecutive keys that share a namespace, as (start, stop)."""
        runs: list[tuple[int, int]] = []
        start = 0
        for i in range(1, len(keys) + 1):
            if i == len(keys) or _ident(keys[i]) != _ident(keys[start]):
                runs.append((start, i))
                start = i
        return runs

    # -- geometry of memory objects --------------------------------------------------
    def _shapes(self, num_tokens: int) -> list[torch.Size]:
        """The shapes LMCache's engine allocates a chunk in: one per KV group, each
        ``[kv, layers, tokens, hidden]`` (layer-wise: one layer, in its format)."""
        shapes = [torch.Size(s) for s in self.metadata.get_shapes(num_tokens)]
        if not self.layerwise:
            return shapes
        kv, _, tokens, hidden = shapes[0]
        if self.fmt == MemoryFormat.KV_T2D:
            return [torch.Size([tokens, kv, hidden])]
        if self.fmt == MemoryFormat.KV_2TD:
            return [torch.Size([kv, tokens, hidden])]
        return [torch.Size([kv, 1, tokens, hidden])]

    def _allocate(self, num_tokens: int) -> MemoryObj | None:
        dtypes = list(self.metadata.get_dtypes())
        shapes = self._shapes(num_tokens)
        return self.local_cpu_backend.allocate(shapes, dtypes[: len(shapes)], fmt=self.fmt)

    def _object_groups(self, obj: MemoryObj) -> int:
        shapes = obj.meta.shapes
        return len(shapes) if shapes is not None and obj.meta.dtypes is not None else 1

    def _tokens_of(self, obj: MemoryObj) -> int:
        try:
            return int(obj.get_num_tokens())
        except Exception:
            return self.chunk_size

    # -- lookups ---------------------------------------------------------------------
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self.batched_contains([key], pin) == 1

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """Leading keys stored (LMCache's prefix semantics). ``pin`` needs nothing here:
        a ctxmem block stays readable until evicted, and a get that finds it evicted is a
        miss LMCache already handles."""
        hits = 0
        try:
            for start, stop in self._runs(keys):
                run = keys[start:stop]
                names = [encode_chunk_key(k) for k in run]
                # A hit needs every KV group: one group Lookup (ctxmem.group).
                n = _unit(self._namespaces_of(run[0])).lookup(names).num_hits
                hits += n
                if n < len(run):
                    if start + n == len(keys) - 1 and self._partial_exists(keys[-1]):
                        hits += 1
                    break
        except CtxmemError as exc:
            self._warn.warning("lookup", "ctxmem lookup failed (treated as a miss): %s", exc)
        return hits

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey],
                                     pin: bool = False) -> int:
        hits = await asyncio.to_thread(self.batched_contains, keys, pin)
        if hits:
            # LMCache loads what it just found: have the service stage it in DRAM now.
            self._pool.submit(self._prefetch, keys[:hits])
        return hits

    def _partial_exists(self, key: CacheEngineKey) -> bool:
        if not self._allows_partial():
            return False
        name = encode_chunk_key(key)
        return _unit(self._namespaces_of(key, partial=True)).lookup([name]).num_hits == 1

    def _allows_partial(self) -> bool:
        return bool(getattr(self.config, "save_unfull_chunk", False)) and not self.layerwise

    def _prefetch(self, keys: Sequence[CacheEngineKey]) -> None:
        try:
            for start, stop in self._runs(keys):
                run = keys[start:stop]
                for ns in self._namespaces_of(run[0]):
                    ns.prefetch([encode_chunk_key(k) for k in run])
        except CtxmemError as exc:
            self._warn.warning("prefetch", "ctxmem prefetch failed: %s", exc)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._put_lock:
            return key in self._put_keys

    # -- puts ------------------------------------------------------------------------
    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> list[Future[None]] | None:
        """Queue the puts on this backend's writer thread; each object's reference is held
        until its bytes are committed (or the put failed)."""
        pending: list[tuple[CacheEngineKey, MemoryObj]] = []
        with self._put_lock:
            for key, obj in zip(keys, objs, strict=False):
                if key in self._put_keys:
                    continue
                self._put_keys.add(key)
                obj.ref_count_up()
                pending.append((key, obj))
        if not pending or self._closed:
            self._release(pending)
            return None
        return [self._pool.submit(self._put_now, pending, on_complete_callback)]

    async def async_batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> None:
        futures = self.batched_submit_put_task(keys, objs, transfer_spec, on_complete_callback)
        for fut in futures or ():
            await asyncio.wrap_future(fut)

    def _release(self, pending: Sequence[tuple[CacheEngineKey, MemoryObj]]) -> None:
        with self._put_lock:
            for key, obj in pending:
                self._put_keys.discard(key)
                obj.ref_count_down()

    def _put_now(self, pending: list[tuple[CacheEngineKey, MemoryObj]],
                 on_complete: Callable[[CacheEngineKey], None] | None) -> None:
        try:
            full = [(k, o) for k, o in pending if self._tokens_of(o) >= self.chunk_size]
            partial = [(k, o) for k, o in pending if self._tokens_of(o) < self.chunk_size]
            done: list[CacheEngineKey] = []
            for start, stop in self._runs([k for k, _ in full]):
                run = full[start:stop]
                if self._put_groups([k for k, _ in run], [o for _, o in run]):
                    done.extend(k for k, _ in run)
            for key, obj in partial:
                if self._allows_partial() and self._put_partial(key, obj):
                    done.append(key)
            if on_complete is not None:
                for key in done:
                    try:
                        on_complete(key)
                    except Exception as exc:  # the callback is LMCache's; never fatal
                        log.warning("LMCache put callback failed for %s: %s", key, exc)
        except CtxmemError as exc:
            self._warn.warning("put", "ctxmem put failed (chunks not stored): %s", exc)
        finally:
            self._release(pending)

    def _put_groups(self, keys: list[CacheEngineKey], objs: list[MemoryObj]) -> bool:
        """Each KV group's bytes of ``objs`` into that group's namespace, committed as one
        block group (ctxmem.group): a chunk is visible in every group at once or in
        none."""
        nss = self._namespaces_of(keys[0])
        if any(self._object_groups(o) != len(nss) for o in objs):
            self._warn.warning("groups", "ctxmem: LMCache chunk has %d KV groups, the "
                               "engine metadata %d; not stored",
                               self._object_groups(objs[0]), len(nss))
            return False
        per_group = [[group_bytes(o, g) for o in objs] for g in range(len(nss))]
        for ns, bufs in zip(nss, per_group, strict=True):
            if any(b.nbytes != ns.block_nbytes for b in bufs):
                self._warn.warning("shape", "ctxmem: LMCache chunk of %d bytes does not "
                                   "match the layout's %d; not stored",
                                   bufs[0].nbytes, ns.block_nbytes)
                return False
        names = [encode_chunk_key(k) for k in keys]
        if len(nss) == 1:  # one group: the namespace's own put, as before groups
            nss[0].put(names, per_group[0])
        else:
            nss[0].client.open_group(nss).put(names, per_group)
        return True

    def _put_partial(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        nss = self._namespaces_of(key, partial=True)
        if self._object_groups(obj) != len(nss):
            return False
        blocks = []
        for g, ns in enumerate(nss):
            data = group_bytes(obj, g)
            if data.nbytes > ns.block_nbytes - _TRAILER:
                return False
            block = np.zeros(ns.block_nbytes, dtype=np.uint8)
            block[: data.nbytes] = data
            block[-_TRAILER:] = np.frombuffer(
                self._tokens_of(obj).to_bytes(_TRAILER, "little"), dtype=np.uint8)
            blocks.append(block)
        if len(nss) == 1:
            nss[0].put([encode_chunk_key(key)], blocks)
        else:
            nss[0].client.open_group(nss).put([encode_chunk_key(key)], [[b] for b in blocks])
        return True

    # -- gets ------------------------------------------------------------------------
    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        got = self._get_prefix([key])
        return got[0] if got else None

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        got: list[MemoryObj | None] = list(self._get_prefix(keys))
        return got + [None] * (len(keys) - len(got))

    def get_non_blocking(self, key: CacheEngineKey,
                         location: str | None = None) -> Future[MemoryObj | None]:
        return self._pool.submit(self.get_blocking, key)

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey],
                                       transfer_spec: Any = None) -> list[MemoryObj]:
        return await asyncio.to_thread(self._get_prefix, keys)

    def _get_prefix(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj]:
        """Memory objects for the longest leading run of ``keys`` that could be read."""
        out: list[MemoryObj] = []
        try:
            for start, stop in self._runs(keys):
                run = list(keys[start:stop])
                objs: list[MemoryObj] = []
                for _ in run:
                    obj = self._allocate(self.chunk_size)
                    if obj is None:
                        break
                    objs.append(obj)
                names = [encode_chunk_key(k) for k in run[: len(objs)]]
                nss = self._namespaces_of(run[0])
                n = 0
                if objs and len(nss) == 1:
                    n = nss[0].get(names, [group_bytes(o, 0) for o in objs])
                elif objs:  # a chunk loads only when every KV group's block does
                    n = nss[0].client.open_group(nss).get(
                        names, [[group_bytes(o, g) for o in objs] for g in range(len(nss))])
                for obj in objs[n:]:
                    obj.ref_count_down()
                out.extend(objs[:n])
                if n < len(run):
                    if start + n == len(keys) - 1 and len(objs) == len(run):
                        tail = self._get_partial(keys[-1])
                        if tail is not None:
                            out.append(tail)
                    break
        except CtxmemError as exc:
            self._warn.warning("get", "ctxmem get failed (treated as a miss): %s", exc)
        return out

    def _get_partial(self, key: CacheEngineKey) -> MemoryObj | None:
        if not self._allows_partial():
            return None
        nss = self._namespaces_of(key, partial=True)
        blocks = [np.empty(ns.block_nbytes, dtype=np.uint8) for ns in nss]
        if _unit(nss).get([encode_chunk_key(key)], [[b] for b in blocks]) != 1:
            return None
        tokens = {int.from_bytes(b[-_TRAILER:].tobytes(), "little") for b in blocks}
        if len(tokens) != 1 or not 0 < min(tokens) < self.chunk_size:
            return None
        obj = self._allocate(tokens.pop())
        if obj is None:
            return None
        for g, block in enumerate(blocks):
            data = group_bytes(obj, g)
            data[:] = block[: data.nbytes]
        return obj

    # -- the rest of the interface ---------------------------------------------------
    def pin(self, key: CacheEngineKey) -> bool:
        return self.contains(key)

    def unpin(self, key: CacheEngineKey) -> bool:
        return True

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        return self.batched_remove([key], force) == 1

    def batched_remove(self, keys: list[CacheEngineKey], force: bool = True) -> int:
        removed = 0
        try:
            for start, stop in self._runs(keys):
                run = keys[start:stop]
                names = [encode_chunk_key(k) for k in run]
                counts = [ns.delete(names) for ns in self._namespaces_of(run[0])]
                removed += max(counts, default=0)
        except CtxmemError as exc:
            self._warn.warning("delete", "ctxmem delete failed: %s", exc)
        return removed

    def touch_cache(self) -> None:
        return None

    def get_allocator_backend(self) -> AllocatorBackendInterface:
        backend: AllocatorBackendInterface = self.local_cpu_backend
        return backend

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True)


def _ident(key: CacheEngineKey) -> tuple[Any, ...]:
    return (key.model_name, key.world_size, key.worker_id, str(key.dtype), key.tags)
