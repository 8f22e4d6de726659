"""Hypothesis state machine: put/get/delete/evict/restart against a model of the store.

The model is a dict key -> bytes of what was committed. Invariants: a get returns exactly
the committed bytes or a miss; a deleted key is never served again (also across
restarts); without capacity pressure every committed key is served, from DRAM or flash,
before and after a clean restart.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from .storekit import get, make_flash, open_store, payload, put, session, store_config


def _machine(keys: int, dram: str, flash_bytes: int, strict: bool) -> type:
    KEYS = [bytes([i + 1]) * 16 for i in range(keys)]

    class StoreMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.dir = Path(tempfile.mkdtemp(prefix="ctxmem-sm-"))
            self.loop = asyncio.new_event_loop()
            self.cfg = store_config(dram_size=dram)
            self.flash = make_flash(self.dir / "f.img", flash_bytes)
            self.model: dict[bytes, bytes] = {}
            self.deleted: set[bytes] = set()
            self._open()

        def _open(self) -> None:
            self.store = self.loop.run_until_complete(open_store(self.cfg, self.flash))
            self.s, self.ns = session(self.store)

        def run(self, coro):  # type: ignore[no-untyped-def]
            return self.loop.run_until_complete(coro)

        @rule(k=st.sampled_from(KEYS), seed=st.integers(1, 10_000))
        def put(self, k: bytes, seed: int) -> None:
            committed = self.run(put(self.store, self.s, self.ns, {k: payload(seed)}))
            if committed:
                self.model[k] = payload(seed)
                self.deleted.discard(k)
            elif strict:
                assert k in self.model, "put of a new key committed nothing"

        @rule(ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True))
        def get(self, ks: list[bytes]) -> None:
            got = self.run(get(self.store, self.s, self.ns, ks))
            for k, data in zip(ks, got, strict=False):
                assert k in self.model and k not in self.deleted, "served a deleted key"
                assert data == self.model[k], "served bytes differ from what was committed"
            if strict:
                expected = 0
                for k in ks:
                    if k not in self.model:
                        break
                    expected += 1
                assert len(got) == expected

        @rule(k=st.sampled_from(KEYS))
        def delete(self, k: bytes) -> None:
            self.run(self.store.delete(self.ns, [k]))
            if self.model.pop(k, None) is not None:
                self.deleted.add(k)

        @rule()
        def evict_to_flash(self) -> None:
            self.run(self.store.evict(self.ns, list(self.model), "dram"))

        @rule()
        def restart(self) -> None:
            self.run(self.store.close())
            self._open()
            if not strict:
                # Under pressure a restart may legitimately forget non-durable blocks.
                present = self.store.lookup(self.ns, list(self.model), prefix=False)[1]
                for k, tier in zip(list(self.model), present, strict=True):
                    if not tier:
                        del self.model[k]

        @invariant()
        def deleted_keys_stay_gone(self) -> None:
            if self.deleted:
                _, tiers = self.store.lookup(self.ns, sorted(self.deleted), prefix=False)
                assert not any(tiers), "a deleted key is visible"

        def teardown(self) -> None:
            self.run(self.store.close())
            self.loop.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    return StoreMachine


RoomyStore = _machine(keys=10, dram="4MiB", flash_bytes=8 << 20, strict=True)
RoomyStore.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestRoomyStore = RoomyStore.TestCase

# 1 MiB of DRAM (16 slots) and 3 MiB of flash (2 slabs of 15): eviction on every tier.
TightStore = _machine(keys=40, dram="1MiB", flash_bytes=3 << 20, strict=False)
TightStore.TestCase.settings = settings(max_examples=20, stateful_step_count=40, deadline=None)
TestTightStore = TightStore.TestCase
