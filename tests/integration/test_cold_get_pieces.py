"""A cold get of many flash blocks is served in pieces, the next one read ahead
(``flash.cold_piece_bytes``, off by default, on here): through the shim every block still
comes back exact and checked, the run still ends at the first miss with nothing past it
written, and the service counts the blocks it promoted ahead."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import ctxmem
from tests.conftest import ServiceHandle
from tests.kit import blocks, byte_layout

LAYOUT = byte_layout(16 << 10)  # 16 KiB blocks
N = 22  # pieces of 4 blocks: 5 full pieces and a short one


def _data(n: int) -> list[np.ndarray]:
    return blocks(n, LAYOUT.block_nbytes, 3)


@pytest.fixture
def svc(service_factory: Callable[..., ServiceHandle]) -> ServiceHandle:
    return service_factory(transports=["shm", "tcp"],
                           flash={"cold_piece_bytes": 4 * LAYOUT.block_nbytes})


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_cold_get_in_pieces_returns_every_block_exact(svc: ServiceHandle, transport: str
                                                      ) -> None:
    with ctxmem.Client(svc.endpoint, transport=transport) as client:  # type: ignore[arg-type]
        ns = client.open_namespace(LAYOUT, model_id="m")
        keys = ctxmem.chain_hashes(range(N), 1)
        data = _data(N)
        assert ns.put(keys, data).stored == N
        assert ns.evict(keys) == N
        out = [np.zeros_like(d) for d in data]
        assert ns.get(keys, out) == N
        assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
        st = client.stats()
        assert st["hits_flash"] == N and st["misses"] == 0, st
        assert st["integrity_failures"] == 0, st
        # Every piece after the first was promoted ahead, at least in part.
        assert st["read_ahead_blocks"] >= 4, st
        assert ns.tiers(keys) == ["dram"] * N


def test_cold_get_in_pieces_stops_at_the_first_miss(svc: ServiceHandle) -> None:
    with ctxmem.Client(svc.endpoint, transport="shm") as client:
        ns = client.open_namespace(LAYOUT, model_id="m")
        keys = ctxmem.chain_hashes(range(N), 1)
        data = _data(N)
        assert ns.put(keys, data).stored == N
        assert ns.evict(keys) == N
        assert ns.delete(keys[10:11]) == 1  # a miss in the third piece
        sentinel = 0x5A
        out = [np.full_like(d, sentinel) for d in data]
        assert ns.get(keys, out) == 10
        assert all(np.array_equal(a, b) for a, b in zip(data[:10], out[:10], strict=True))
        assert all((o == sentinel).all() for o in out[10:])  # nothing past the miss written
