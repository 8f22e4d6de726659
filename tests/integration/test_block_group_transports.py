"""Block groups over every transport the service offers here (shared memory, TCP), with
the gets verified and not: a group's members round-trip byte-exact, and a key one member
lacks is a whole miss (tests/reliability/test_block_groups.py has the fault cases)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ctxmem
from tests.kit import byte_layout

KV = byte_layout(8 << 10)
STATE = byte_layout(2 << 10)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("verify", [True, False])
def test_group_round_trip(service: Any, transport: str, verify: bool) -> None:
    rng = np.random.default_rng(7)
    keys = [bytes([transport == "tcp", verify, i]) * 8 for i in range(5)]
    data = [[rng.integers(0, 256, KV.block_nbytes, dtype=np.uint8) for _ in keys],
            [rng.integers(0, 256, STATE.block_nbytes, dtype=np.uint8) for _ in keys]]
    with ctxmem.Client(service.endpoint, transport=transport, verify_gets=verify) as c:
        kv = c.open_namespace(KV, model_id="g", tags={"pool": "kv"})
        state = c.open_namespace(STATE, model_id="g", tags={"pool": "state"})
        group = c.open_group([kv, state])
        assert group.put(keys, data).stored == 10
        out = [[np.zeros(KV.block_nbytes, np.uint8) for _ in keys],
               [np.zeros(STATE.block_nbytes, np.uint8) for _ in keys]]
        assert group.get(keys, out) == 5
        for member, want in zip(out, data, strict=True):
            assert all(np.array_equal(a, b) for a, b in zip(member, want, strict=True))
        assert state.delete(keys[2:3]) == 1
        assert group.lookup(keys).num_hits == 2
        assert group.get(keys, out) == 2
        assert c.transport_in_use == transport
