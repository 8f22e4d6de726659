"""Issue 14: a Hypothesis model of the pod (put, get, delete, evict, kill and restart
across three real nodes and a real redis-server): no node ever serves a wrong block.

The model keeps, per key, every block any node committed under it and has not deleted
since (two nodes may write different bytes under one key); a get must return, for each
block it delivers, one of those, and nothing past its hits. A Delete on a node removes
what that node wrote under the keys: from when it returns, no node serves those bytes
(copies fetched elsewhere included; docs/pod.md, "Deletes and re-puts across nodes")."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from ctxmem_tools.pod_launcher import LocalPod
from tests.kit import blocks, chain_keys, read_until
from tests.pod.podtest import LAYOUT, Clients

KEYS = chain_keys(LAYOUT, 0, 6)
_model_ids = itertools.count()
DELIVERED = {"remote": 0, "blocks": 0}  # across examples: the run must exercise hits


def block(key_index: int, version: int) -> np.ndarray:
    return blocks(1, LAYOUT.block_nbytes, key_index * 1000 + version)[0]


@pytest.fixture(scope="module")
def shared_pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPod]:
    root: Path = tmp_path_factory.mktemp("pod-model")
    with LocalPod(root / "pod", 3) as p:
        yield p


class PodModel(RuleBasedStateMachine):
    pod: LocalPod

    def __init__(self) -> None:
        super().__init__()
        self.clients = Clients()
        self.model = f"model-{next(_model_ids)}"  # a fresh namespace per example
        # Per key, (writer node, bytes) of every put not deleted on its writer since.
        self.written: dict[int, list[tuple[int, np.ndarray]]] = {}
        self.version = itertools.count()

    def _ep(self, node: int) -> str:
        return self.pod.nodes[node].endpoint

    @initialize()
    def start(self) -> None:
        for node in self.pod.nodes:
            if node.proc is None:
                node.start()

    @rule(node=st.integers(0, 2), first=st.integers(0, 5), n=st.integers(1, 3))
    def put(self, node: int, first: int, n: int) -> None:
        idx = list(range(first, min(6, first + n)))
        v = next(self.version)
        data = [block(i, v) for i in idx]
        for i, d in zip(idx, data, strict=True):
            self.written.setdefault(i, []).append((node, d))
        ns = self.clients.ns(self._ep(node), self.model)
        ns.put([KEYS[i] for i in idx], data)

    @rule(node=st.integers(0, 2), first=st.integers(0, 5))
    def get(self, node: int, first: int) -> None:
        keys = KEYS[first:]
        out = [np.zeros(LAYOUT.block_nbytes, np.uint8) for _ in keys]
        ns = self.clients.ns(self._ep(node), self.model)
        remote = ns.lookup(keys).tiers.count("remote")
        n = ns.get(keys, out)
        DELIVERED["blocks"] += n
        DELIVERED["remote"] += min(n, remote)
        for j in range(n):
            assert any(np.array_equal(out[j], d) for _w, d in self.written.get(first + j, [])), \
                f"node {node + 1} served wrong or deleted bytes for key {first + j}"
        for o in out[n:]:
            assert not o.any()

    @rule(src=st.integers(0, 2), dst=st.integers(0, 2), first=st.integers(0, 5))
    def put_then_get_elsewhere(self, src: int, dst: int, first: int) -> None:
        """A put on one node, then (once the index shows it, bounded) a get on another."""
        self.put(src, first, 1)
        ns = self.clients.ns(self._ep(dst), self.model)
        read_until(lambda: ns.exists([KEYS[first]])[0], bool, 2.0, 0.02)
        self.get(dst, first)

    @rule(src=st.integers(0, 2), dst=st.integers(0, 2), first=st.integers(0, 5))
    def fetch_then_delete_on_the_writer(self, src: int, dst: int, first: int) -> None:
        """A put, a get elsewhere (a fetched copy there), the writer's Delete, and a get
        there again at once: the deleted bytes must not come back."""
        self.put_then_get_elsewhere(src, dst, first)
        self.delete(src, first)
        self.get(dst, first)

    @rule()
    def settle(self) -> None:
        time.sleep(0.1)  # let the publishers run (batched every 20 ms)

    @rule(node=st.integers(0, 2), first=st.integers(0, 5))
    def delete(self, node: int, first: int) -> None:
        self.clients.ns(self._ep(node), self.model).delete(KEYS[first:first + 2])
        for i in range(first, min(6, first + 2)):  # what this node wrote is gone
            self.written[i] = [(w, d) for w, d in self.written.get(i, []) if w != node]

    @rule(node=st.integers(0, 2))
    def evict(self, node: int) -> None:
        self.clients.ns(self._ep(node), self.model).evict(KEYS)

    @rule(node=st.integers(0, 2))
    def kill_and_restart(self, node: int) -> None:
        self.clients.drop(self._ep(node))
        self.pod.nodes[node].restart(kill=True)

    def teardown(self) -> None:
        self.clients.close()


def test_no_node_ever_serves_a_wrong_block(shared_pod: LocalPod) -> None:
    from hypothesis.stateful import run_state_machine_as_test

    PodModel.pod = shared_pod
    run_state_machine_as_test(PodModel, settings=settings(
        max_examples=12, stateful_step_count=12, deadline=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))
    assert DELIVERED["blocks"] > 0 and DELIVERED["remote"] > 0, DELIVERED
