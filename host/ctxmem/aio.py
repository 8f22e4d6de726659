"""The asyncio facade of the shim: :class:`AsyncClient` and :class:`AsyncNamespace` run
the blocking client on the event loop's default executor, so an engine's loop never waits
on the service (why the core is blocking: see :mod:`ctxmem.client`)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from ctxmem.client import Client
from ctxmem.group import NamespaceGroup
from ctxmem.namespace import LookupResult, Namespace, PutResult
from ctxmem_common.layout import KVLayout
from ctxmem_common.proto import ctxmem_pb2 as pb

__all__ = ["AsyncClient", "AsyncNamespace", "AsyncNamespaceGroup"]

T = TypeVar("T")


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))


class AsyncClient:
    """Asyncio facade: every call runs the blocking client on the loop's default executor,
    so an engine's event loop never waits on the service."""

    def __init__(self, endpoint: str = "127.0.0.1:50051", **kwargs: Any) -> None:
        self.sync = Client(endpoint, **kwargs)

    async def health(self) -> pb.HealthResponse:
        return await _in_thread(self.sync.health)

    async def stats(self) -> dict[str, float]:
        return await _in_thread(self.sync.stats)

    async def open_namespace(self, layout: KVLayout, *, model_id: str, tenant: str = "default",
                             tags: Mapping[str, str] | None = None,
                             weights_revision: str = "") -> AsyncNamespace:
        ns = await _in_thread(functools.partial(self.sync.open_namespace, layout,
                                                model_id=model_id, tenant=tenant, tags=tags,
                                                weights_revision=weights_revision))
        return AsyncNamespace(ns)

    def open_group(self, members: Sequence[AsyncNamespace]) -> AsyncNamespaceGroup:
        """A block group over ``members`` (:meth:`Client.open_group`; opens nothing)."""
        return AsyncNamespaceGroup(self.sync.open_group([m.sync for m in members]))

    async def close(self) -> None:
        await _in_thread(self.sync.close)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncNamespace:
    """Awaitable twin of :class:`Namespace`."""

    def __init__(self, ns: Namespace) -> None:
        self.sync = ns
        self.layout = ns.layout
        self.block_nbytes = ns.block_nbytes

    async def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        return await _in_thread(self.sync.lookup, keys)

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return await _in_thread(self.sync.exists, keys)

    async def tiers(self, keys: Sequence[bytes]) -> list[str]:
        """Per-key tier: see :meth:`Namespace.tiers`."""
        return await _in_thread(self.sync.tiers, keys)

    async def put(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> PutResult:
        return await _in_thread(self.sync.put, keys, buffers)

    async def get(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> int:
        return await _in_thread(self.sync.get, keys, buffers)

    async def prefetch(self, keys: Sequence[bytes]) -> int:
        return await _in_thread(self.sync.prefetch, keys)

    async def delete(self, keys: Sequence[bytes]) -> int:
        return await _in_thread(self.sync.delete, keys)

    async def evict(self, keys: Sequence[bytes], tier: str = "dram") -> int:
        return await _in_thread(self.sync.evict, keys, tier)


class AsyncNamespaceGroup:
    """Awaitable twin of :class:`~ctxmem.group.NamespaceGroup`."""

    def __init__(self, group: NamespaceGroup) -> None:
        self.sync = group

    async def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        return await _in_thread(self.sync.lookup, keys)

    async def put(self, keys: Sequence[bytes], buffers: Sequence[Sequence[Any]]) -> PutResult:
        return await _in_thread(self.sync.put, keys, buffers)

    async def get(self, keys: Sequence[bytes], buffers: Sequence[Sequence[Any]]) -> int:
        return await _in_thread(self.sync.get, keys, buffers)
