"""Issue 14: three real service processes and a real redis-server on loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import ctxmem
from ctxmem_tools.pod_launcher import LocalPod

LAYOUT = ctxmem.KVLayout(dtype="bfloat16", num_layers=4, num_kv_heads=2, head_dim=64,
                         tokens_per_block=16)


def blocks(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, LAYOUT.block_nbytes, dtype=np.uint8) for _ in range(n)]


def stats(endpoint: str) -> dict[str, float]:
    with ctxmem.Client(endpoint) as c:
        return c.stats()


def wait_for(cond: object, timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[LocalPod]:
    with LocalPod(tmp_path / "pod", 3) as p:
        yield p


def test_put_on_one_node_is_byte_exact_hit_on_the_others(pod: LocalPod) -> None:
    n1, n2, n3 = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 12), 16)
    data = blocks(len(keys), 1)
    with ctxmem.Client(n1.endpoint) as c1:
        ns1 = c1.open_namespace(LAYOUT, model_id="m")
        assert ns1.put(keys, data).stored == 12
    for node in (n2, n3):
        with ctxmem.Client(node.endpoint) as c:
            ns = c.open_namespace(LAYOUT, model_id="m")
            wait_for(lambda ns=ns: ns.lookup(keys).num_hits == 12, what="publish")
            assert ns.lookup(keys).tiers == ["remote"] * 12
            out = [np.zeros_like(d) for d in data]
            assert ns.get(keys, out) == 12
            assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
            assert ns.lookup(keys).tiers == ["dram"] * 12  # stored locally now
        st = stats(node.endpoint)
        assert st["pod_fetch_blocks_peer"] == 12 and st["pod_fetch_bad"] == 0
    assert stats(n1.endpoint)["pod_served_blocks"] == 24


def test_other_tenant_and_model_never_see_the_blocks(pod: LocalPod) -> None:
    n1, n2, _ = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 4), 16)
    with ctxmem.Client(n1.endpoint) as c1:
        c1.open_namespace(LAYOUT, model_id="m", tenant="alice").put(keys, blocks(4, 2))
    with ctxmem.Client(n2.endpoint) as c:
        alice = c.open_namespace(LAYOUT, model_id="m", tenant="alice")
        wait_for(lambda: alice.lookup(keys).num_hits == 4, what="publish")
        bob = c.open_namespace(LAYOUT, model_id="m", tenant="bob")
        assert bob.lookup(keys).num_hits == 0
        assert bob.get(keys, [np.zeros(LAYOUT.block_nbytes, np.uint8) for _ in keys]) == 0
        other = c.open_namespace(LAYOUT, model_id="other", tenant="alice")
        assert other.lookup(keys).num_hits == 0
