"""Helpers of the pod tests: one client per node for the whole test (a client per call
would Connect, and end its session, on every call), and byte-checked puts and gets."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

import ctxmem
from tests import kit

LAYOUT = kit.model_layout(num_layers=4)


def blocks(n: int, seed: int) -> list[np.ndarray]:
    """``n`` random blocks of the pod tests' layout (:func:`tests.kit.blocks`)."""
    return kit.blocks(n, LAYOUT.block_nbytes, seed)


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0,
             what: str | Callable[[], str] = "") -> None:
    """:func:`tests.kit.until` with the pod tests' defaults."""
    kit.until(cond, timeout_s, what or "the condition")


class Clients:
    """A client per endpoint, opened on first use, closed by :meth:`close`."""

    def __init__(self) -> None:
        self._c: dict[str, ctxmem.Client] = {}

    def client(self, endpoint: str) -> ctxmem.Client:
        if endpoint not in self._c:
            self._c[endpoint] = ctxmem.Client(endpoint, timeout_s=15)
        return self._c[endpoint]

    def ns(self, endpoint: str, model: str = "m", tenant: str = "default") -> ctxmem.Namespace:
        return self.client(endpoint).open_namespace(LAYOUT, model_id=model, tenant=tenant)

    def put(self, endpoint: str, keys: list[bytes], data: list[np.ndarray],
            model: str = "m") -> int:
        return self.ns(endpoint, model).put(keys, data).stored

    def get(self, endpoint: str, keys: list[bytes], data: list[np.ndarray],
            model: str = "m") -> int:
        """Get ``keys``, checking every delivered block byte for byte; returns the hits."""
        out = [np.zeros(LAYOUT.block_nbytes, np.uint8) for _ in keys]
        n = self.ns(endpoint, model).get(keys, out)
        for i in range(n):
            assert np.array_equal(out[i], data[i]), f"block {i}: wrong bytes"
        for o in out[n:]:
            assert not o.any(), "a buffer past the hits was written"
        return n

    def hits(self, endpoint: str, keys: list[bytes], model: str = "m") -> int:
        return self.ns(endpoint, model).lookup(keys).num_hits

    def stats(self, endpoint: str) -> dict[str, float]:
        return self.client(endpoint).stats()

    def stats_when(self, endpoint: str, done: Callable[[dict[str, float]], bool],
                   timeout_s: float = 10.0) -> dict[str, float]:
        """The node's Stats once ``done`` holds for them, or the last Stats read when
        ``timeout_s`` passes: the caller asserts on what comes back, so a timeout fails
        with the values seen. For counts a node updates after the answer that ended the
        call went out (a holder counts RDMA-served blocks when the fetcher's done
        arrives, and the fetcher's get returns without waiting for that)."""
        return kit.read_until(lambda: self.stats(endpoint), done, timeout_s)

    def drop(self, endpoint: str) -> None:
        c = self._c.pop(endpoint, None)
        if c is not None:
            c.close()

    def close(self) -> None:
        for c in self._c.values():
            c.close()
        self._c.clear()
