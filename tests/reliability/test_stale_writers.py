"""Issue 13, case 1 and 5: a client that stalls between Allocate and its copy must not be
able to change another client's blocks, and ``get()`` never writes past what it returns.

A shared-memory client maps whole slabs, so after its allocation expires it can still
write the slots it once held. The service must not hand those slots to anyone while the
stale writer can still reach them; and whatever happens to a block's bytes in DRAM, a get
serves exactly the committed bytes or a miss.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

import ctxmem
from ctxmem_common.errors import ResourceExhausted
from tests.adversary.raw import RawSession
from tests.kit import until
from tests.reliability.sentinel import BLOCK, LAYOUT, content, get_checked, keys


@pytest.fixture
def small_service(service_factory: Callable[..., Any]) -> Any:
    # One 2 MiB DRAM slab of eight 256 KiB slots: whatever the stale writer held is what
    # the next put would get. Allocations expire after 1 s.
    svc = service_factory(dram_size="2MiB", dram_slab="2MiB", transports=["shm"],
                          allocation_ttl_s=1.0, flash_size=None)
    return svc


def test_stale_shm_writer_cannot_change_another_clients_blocks(small_service: Any) -> None:
    stale = RawSession(small_service.endpoint, LAYOUT, model_id="m")
    victim_keys = keys("victim", 8)
    try:
        held = stale.allocate(keys("stale", 8))
        assert len(held.slots) == 8
        time.sleep(2.0)  # stalled past allocation_ttl_s: the service reaped the allocation
        with ctxmem.Client(small_service.endpoint, transport="shm") as c:
            ns = c.open_namespace(LAYOUT, model_id="m")
            try:
                stored = ns.put(victim_keys, [content(k) for k in victim_keys]).stored
            except ResourceExhausted:
                stored = 0  # the stale slots were held back: a refusal, not a wrong block
            # The stalled writer wakes up and copies what it meant to, into its old slots.
            stale.write(held, [b"\x00" * BLOCK] * 8)
            n = get_checked(ns, victim_keys)
            assert n <= stored
    finally:
        stale.close()


def test_stale_slots_return_once_the_writer_is_gone(small_service: Any) -> None:
    """Holding slots back from a stalled writer must not leak them: once its session is
    closed, the slots serve other clients again."""
    stale = RawSession(small_service.endpoint, LAYOUT, model_id="m")
    stale.allocate(keys("stale", 8))
    time.sleep(2.0)
    stale.close()
    victim_keys = keys("victim", 8)
    with ctxmem.Client(small_service.endpoint, transport="shm") as c:
        ns = c.open_namespace(LAYOUT, model_id="m")

        def stored() -> bool:
            try:
                assert ns.put(victim_keys, [content(k) for k in victim_keys]).stored == 8
            except ResourceExhausted:
                return False
            return True

        until(stored, 15, "the stale writer's slots to come back", 0.2)
        assert get_checked(ns, victim_keys) == 8
