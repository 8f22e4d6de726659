"""The block store: index, making room, leases, demotion and promotion.

:class:`BlockStore` (``blockstore.py``) is the facade the servicer, the data-plane servers
and the app use; every other module here holds one concept and is private to the store
(``transport`` and ``pod`` may not import them, an import-linter contract in
``pyproject.toml``; what they share with the store lives outside it:
``ctxmem_dpu.keyring`` and ``ctxmem_dpu.blocks.slab_owner``):

* ``context``   — what every part shares: config, the tiers, counters, the I/O threads;
* ``sessions``  — sessions, namespaces, allocations, leases, expiry, grant-end hooks, the
  quarantine of slots a stale shared-memory writer can still reach;
* ``index``     — the key → block map, the per-tier eviction order, the dirty set;
* ``room``      — making room in DRAM: victims dropped, or demoted first (the one
  collaborator the put, get, promotion and peer paths are given);
* ``flash_room`` — making room on flash for a demotion: slabs leased (shared flash),
  then flash victims;
* ``demotion`` / ``promotion`` — DRAM → flash (the demoter) and flash → DRAM;
* ``puts``      — the put path: allocate (reserve DRAM slots), commit (CRC, index);
* ``gets``      — the get path: acquire (the stored leading run, promoted, leased);
* ``writethrough`` — write-through commits: visible only once durable, refused otherwise;
* ``invalidation`` — zeroing record headers, parked extents, pins and freeing storage;
* ``recovery``  — rebuilding the index from flash, verifying a record, the audit;
* ``health``    — flash device health, slow I/O, probing and relocating failed devices;
* ``stats``     — the counter names and the Stats snapshot.
"""

from ctxmem_dpu.store.blockstore import BlockStore
from ctxmem_dpu.store.stats import COUNTERS

__all__ = ["COUNTERS", "BlockStore"]
