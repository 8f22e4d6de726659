"""Tiny factories for the store's modules, built without ``BlockStore``: the real
context (a DRAM tier, no flash, the I/O pool), the index, the session tables and the
quotas over them, and sessions, namespaces and DRAM blocks placed in them by hand, so a
test sets up exactly the state it asserts on (which tenant owns which slab, the LRU order).

Keys come from :func:`tests.kit.keys`, so a failure names blocks by tag and position.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ctxmem_common.codecs import crc32c
from ctxmem_common.config import Config
from ctxmem_dpu.blocks import Block, Namespace, Session, SessionTables, slab_owner
from ctxmem_dpu.keyring import Keyring
from ctxmem_dpu.store.context import IOPool, StoreContext
from ctxmem_dpu.store.demotion import Demotion
from ctxmem_dpu.store.flash_room import FlashRoom
from ctxmem_dpu.store.health import DeviceHealth
from ctxmem_dpu.store.index import BlockIndex
from ctxmem_dpu.store.invalidation import Invalidator
from ctxmem_dpu.store.promotion import Promotion
from ctxmem_dpu.store.quotas import Quotas
from ctxmem_dpu.store.room import Room
from ctxmem_dpu.store.stats import new_counters
from ctxmem_dpu.tiers.dram import DramTier
from ctxmem_dpu.tiers.flash import FlashDevice, FlashTier
from tests import kit

from ..storekit import LAYOUT, MASTER, make_flash, store_config

MiB = 1 << 20
#: Slot size of the namespaces made here: four blocks a 1 MiB slab.
SLOT = 256 << 10


@dataclass
class Parts:
    """A store's parts over one context: what the modules under test are built from."""

    cfg: Config
    ctx: StoreContext
    index: BlockIndex
    tables: SessionTables
    quotas: Quotas
    health: DeviceHealth
    invalidator: Invalidator
    #: Room on flash (a demotion's extents), and room in DRAM above the demotion, built
    #: in that order as ``BlockStore`` builds them.
    flash_room: FlashRoom
    demoter: Demotion
    room: Room

    def demotion(self) -> Demotion:
        """The demotion over these parts (to the flash file :func:`parts` was given),
        the one :attr:`room` demotes its victims through."""
        return self.demoter

    def promotion(self) -> Promotion:
        """A promotion over these parts (making room through :attr:`room`)."""
        return Promotion(self.ctx, self.index, self.room, self.invalidator, self.health,
                         Keyring(MASTER))

    def session(self, tenant: str) -> Session:
        """An open session of ``tenant`` (makes it an active tenant)."""
        sid = kit.keys(f"session/{len(self.tables.sessions)}", 1)[0][:16]
        s = Session(sid, tenant, "shm", "test")
        self.tables.sessions[sid] = s
        return s

    def namespace(self, tenant: str, model: str = "m") -> Namespace:
        """A namespace of ``tenant`` with :data:`SLOT`-byte slots, known to the tables."""
        digest = kit.keys(f"ns/{tenant}/{model}", 1)[0][:16]
        ns = Namespace(digest, tenant, model, LAYOUT, {}, SLOT, SLOT)
        self.tables.namespaces[digest] = ns
        self.index.namespace(digest)
        return ns

    def put(self, ns: Namespace, tag: str, n: int, dirty: bool = False,
            indexed: bool = True) -> list[Block]:
        """``n`` committed blocks of ``ns`` in DRAM (keys ``kit.keys(tag, n)``, content
        :func:`tests.kit.tiled` with its CRC32C), added to the DRAM LRU in key order (the
        first is the least recently used); ``dirty``: not on flash yet (in the dirty set,
        in the same order); not ``indexed``: written and checksummed only, as a Commit
        hands them to a write-through."""
        refs = self.ctx.dram.allocate(SLOT, n, slab_owner(ns))
        assert refs is not None, f"no room for {n} blocks of {ns.tenant}"
        out = []
        for key, ref in zip(kit.keys(tag, n), refs, strict=True):
            data = kit.tiled(key, SLOT)
            self.ctx.dram.view(ref, SLOT)[:] = data
            b = Block(ns.digest, key, SLOT, SLOT, crc32c(data), self.index.next_seq(),
                      dram=ref)
            if indexed:
                self.index.namespace(ns.digest)[key] = b
                self.index.dram_lru.add(b)
            if dirty:
                self.index.dirty[b] = None
            out.append(b)
        return out

    def slabs(self) -> dict[str, int]:
        """Tenant -> DRAM slabs its namespaces own now (no zero entries)."""
        return {t: n for t, n in sorted(self.quotas.dram_slabs().items()) if n}


@contextmanager
def parts(dram: str = "8MiB", flash_file: Path | None = None, **over: Any) -> Iterator[Parts]:
    """The parts of a store of ``dram`` in 1 MiB slabs (eight by default), DRAM only, or
    with one 8 MiB flash file at ``flash_file`` (1 MiB slabs); ``over`` as
    :func:`tests.dpu.storekit.store_config` takes it (``quotas=...``)."""
    cfg = store_config(dram_size=dram, **over)
    devices = []
    if flash_file is not None:
        (name, path), = make_flash(flash_file)
        devices.append(FlashDevice(0, name, path, cfg.flash.slab_size, cfg.flash.o_direct))
        devices[0].slow_io_s = cfg.flash.slow_io_s  # as the store's open_devices does
    ctx = StoreContext(cfg, DramTier(cfg.dram.size, cfg.dram.slab_size),
                       FlashTier(devices), new_counters(), IOPool(1))
    index = BlockIndex(cfg)
    tables = SessionTables()
    quotas = Quotas(ctx, index, tables)
    health = DeviceHealth(ctx)
    invalidator = Invalidator(ctx, health)
    flash_room = FlashRoom(ctx, index, invalidator, quotas)
    demotion = Demotion(ctx, index, flash_room, invalidator, health, Keyring(MASTER))
    room = Room(ctx, index, health, quotas, demotion)
    try:
        yield Parts(cfg, ctx, index, tables, quotas, health, invalidator, flash_room,
                    demotion, room)
    finally:
        ctx.io.shutdown()
        ctx.dram.close()
        for dev in devices:
            dev.close()


def keys_of(blocks: list[Block]) -> list[bytes]:
    return [b.key for b in blocks]


def where(blocks: list[Block]) -> list[str]:
    """Each block's copies: "dram", "flash" (durable), "dram+flash", or "gone"."""
    out = []
    for b in blocks:
        tiers = [t for t, on in (("dram", b.dram is not None),
                                 ("flash", b.flash is not None and b.durable)) if on]
        out.append("+".join(tiers) or "gone")
    return out
