"""The service process's garbage collector: tuned once after start-up, and its figures.

:func:`tune_gc` collects, then freezes what start-up allocated (modules, gRPC, protobuf,
the index rebuilt from flash) out of the collector's reach, and collects the youngest
generation after :data:`GEN0_THRESHOLD` net allocations instead of Python's 700.

Why: a put of 64 KiB blocks makes a tracked ``Block`` per block (and a delete frees it),
so with the default threshold the collector ran several times per batch, and each full
collection also traversed everything start-up left (with 50,000 blocks stored, start-up's
objects were two thirds of a full collection's time). Measured (paired A/B, 64 KiB puts
with 50,000 blocks stored): collections 0.035 of the service's 0.115 CPU s/GB before,
none after, RSS unchanged (issue 17). Frozen objects are still freed by reference
counting when dropped; only a reference cycle among them is never collected.

:func:`gc_stats` is what Stats reports. The frozen count is the one taken at the freeze:
``gc.get_freeze_count()`` walks the whole frozen list (≈0.4 ms for 47,000 objects), too
slow for every Stats call.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 10_000
"""Net allocations of tracked objects between two youngest-generation collections."""

_frozen = 0


def tune_gc() -> None:
    """Collect, freeze, raise the youngest generation's threshold (once, after start-up;
    the service's entry point calls it, never a library user's process)."""
    global _frozen
    gc.collect()
    gc.freeze()
    _frozen = gc.get_freeze_count()
    _gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)


def gc_stats() -> dict[str, float]:
    """Collections so far (every generation), the objects frozen at start-up, and the
    youngest generation's threshold: whether collections are part of a phase's CPU."""
    return {"process_gc_collections": float(sum(g["collections"] for g in gc.get_stats())),
            "process_gc_frozen_objects": float(_frozen),
            "process_gc_gen0_threshold": float(gc.get_threshold()[0])}
