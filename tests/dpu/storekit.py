"""In-process BlockStore helpers for unit and state-machine tests (real files, real I/O)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ctxmem_common.config import Config, config_from_dict
from ctxmem_dpu.blocks import Namespace, Session
from ctxmem_dpu.store import BlockStore
from tests.kit import byte_layout

LAYOUT = byte_layout(64 << 10)  # 64 KiB blocks
# Keys every store_config's flash section starts from: a suite lowers the health timings
# for its tests with monkeypatch.setitem(FLASH, "probe_interval_s", 0.05).
FLASH: dict[str, Any] = {"slab_size": "1MiB"}


def store_config(**over: Any) -> Config:
    raw: dict[str, Any] = {
        "dram": {"size": over.pop("dram_size", "4MiB"), "slab_size": "1MiB"},
        "flash": {**FLASH, "write_policy": over.pop("write_policy", "write_back")},
        "encryption": {"enabled": over.pop("encryption", True)},
        "service": {"lease_ttl_s": over.pop("lease_ttl_s", 30.0),
                    "allocation_ttl_s": over.pop("allocation_ttl_s", 30.0)},
    }
    for section, values in over.items():  # a section given is merged into the above
        raw[section] = {**raw[section], **values} if section in raw else values
    return config_from_dict(raw)


def make_flash(path: Path, size: int = 8 << 20) -> list[tuple[str, str]]:
    if not path.exists():
        with open(path, "wb") as f:
            f.truncate(size)
    return [("flash0", str(path))]


MASTER = bytes(range(32))


async def open_store(cfg: Config, flash: list[tuple[str, str]] | None) -> BlockStore:
    store = BlockStore(cfg, flash or [], MASTER)  # keys the authenticators, encrypted or not
    await store.start()
    return store


def session(store: BlockStore, tenant: str = "t") -> tuple[Session, Namespace]:
    s = store.connect(tenant, "", "shm", "test")
    _, ns = store.open_namespace(s, "model", LAYOUT, {})
    return s, ns


def payload(seed: int, n: int = LAYOUT.block_nbytes) -> bytes:
    return (seed.to_bytes(4, "little") * (n // 4 + 1))[:n] if seed else os.urandom(n)


async def put(store: BlockStore, s: Session, ns: Namespace, items: dict[bytes, bytes]) -> int:
    keys = list(items)
    a, exists = await store.allocate(s, ns, keys)
    new = [k for k, e in zip(keys, exists, strict=True) if not e]
    for k, ref in zip(new, a.slots, strict=True):
        store.dram.view(ref, ns.block_nbytes)[:] = items[k]
    return await store.commit(s, a.id, [], False)


async def get(store: BlockStore, s: Session, ns: Namespace, keys: list[bytes]) -> list[bytes]:
    lease, _ = await store.acquire(s, ns, keys)
    out = []
    for b in lease.blocks:
        assert b.dram is not None
        out.append(bytes(store.dram.view(b.dram, b.length)))
    store.release(s, [lease.id])
    return out
