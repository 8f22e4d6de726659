"""Staged puts (issue 27 item 1) through the whole store: 2 MiB blocks, write-through
(visible once durable on flash) and write-back, then served from flash after an evict,
byte for byte; the service's counters. The hostile cases are
tests/adversary/test_staging.py."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import ctxmem
from tests.conftest import ServiceHandle
from tests.kit import byte_layout

BLOCK = 2 << 20
LAYOUT = byte_layout(BLOCK)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_staged_put_is_stored_durably_and_served_from_flash(
        service_factory: Callable[..., ServiceHandle], policy: str) -> None:
    svc = service_factory(write_policy=policy, dram_slab="16MiB")
    n = 4
    keys = ctxmem.chain_hashes(range(n), 1, salt=policy.encode())
    rng = np.random.default_rng(3)
    blocks = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(n)]
    with ctxmem.Client(svc.endpoint, transport="shm") as c:
        ns = c.open_namespace(LAYOUT, model_id="staged")
        before = svc.stats()
        with c.staging(n * BLOCK) as region:
            arr = region.array()
            for i, b in enumerate(blocks):
                arr[i * BLOCK:(i + 1) * BLOCK] = b
            res = region.put(ns, keys, [i * BLOCK for i in range(n)])
            assert (res.stored, res.existing, res.refused) == (n, 0, [])
            arr[:] = 0  # the stored blocks are the service's copies
            del arr
        if policy == "write_through":
            assert ns.tiers(keys) == ["dram"] * n
        assert ns.evict(keys) == n  # demoted (write-back) or already durable, then dropped
        assert ns.tiers(keys) == ["flash"] * n
        outs = [np.zeros(BLOCK, np.uint8) for _ in range(n)]
        assert ns.get(keys, outs) == n
        assert all(np.array_equal(a, b) for a, b in zip(blocks, outs, strict=True))
        after = svc.stats()
        assert after["staging_put_blocks"] - before["staging_put_blocks"] == n
        assert after["staging_put_bytes"] - before["staging_put_bytes"] == n * BLOCK
        assert after["shm_ops_stage_put"] - before["shm_ops_stage_put"] == 1
        assert after["put_blocks"] - before["put_blocks"] == n
