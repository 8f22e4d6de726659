"""The session registry built alone, with its limits given at construction.

``SessionRegistry`` takes the quotas object (and the tables both share) when it is built,
so a registry built outside ``BlockStore`` enforces the per-tenant caps too: nothing is
wired in late, and there is no registry without limits.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ctxmem_common.errors import ResourceExhausted
from ctxmem_dpu.blocks import SessionTables
from ctxmem_dpu.store.context import IOPool, StoreContext
from ctxmem_dpu.store.index import BlockIndex
from ctxmem_dpu.store.quotas import Quotas
from ctxmem_dpu.store.sessions import SessionRegistry
from ctxmem_dpu.store.stats import new_counters
from ctxmem_dpu.tiers.dram import DramTier
from ctxmem_dpu.tiers.flash import FlashTier

from .storekit import LAYOUT, store_config


@pytest.fixture
def registry() -> Iterator[SessionRegistry]:
    cfg = store_config(quotas={"default": {"max_sessions": 2, "max_namespaces": 1}})
    ctx = StoreContext(cfg, DramTier(cfg.dram.size, cfg.dram.slab_size), FlashTier([]),
                       new_counters(), IOPool(1))
    index = BlockIndex(cfg)
    tables = SessionTables()
    try:
        yield SessionRegistry(cfg, ctx.dram, index, lambda _b: None, tables,
                              Quotas(ctx, index, tables))
    finally:
        ctx.io.shutdown()
        ctx.dram.close()


def test_a_registry_built_alone_caps_sessions(registry: SessionRegistry) -> None:
    registry.connect("t", "", "shm", "test")
    registry.connect("t", "", "shm", "test")
    with pytest.raises(ResourceExhausted, match=r"max_sessions.*2 open sessions, limit 2"):
        registry.connect("t", "", "shm", "test")
    registry.connect("u", "", "shm", "test")  # another tenant has its own cap
    assert sorted(s.tenant for s in registry.sessions.values()) == ["t", "t", "u"]


def test_a_registry_built_alone_caps_namespaces(registry: SessionRegistry) -> None:
    s = registry.connect("t", "", "shm", "test")
    handle, ns = registry.open_namespace(s, "model", LAYOUT, {})
    assert registry.open_namespace(s, "model", LAYOUT, {}) == (handle, ns)  # the same one
    with pytest.raises(ResourceExhausted, match=r"max_namespaces.*1 open namespaces"):
        registry.open_namespace(s, "other-model", LAYOUT, {})
    assert list(registry.namespaces) == [ns.digest]
