"""The shared test kit itself (tests/kit.py): the waits return what they waited for and
fail naming it, and the generators are deterministic where the suites rely on it."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests import kit


def test_until_returns_the_first_true_value() -> None:
    polls = itertools.count()
    assert kit.until(lambda: next(polls) >= 3 and "ready", 5, "three polls", 0.001) == "ready"


def test_until_fails_naming_what_it_waited_for_as_it_is_then() -> None:
    seen = []
    with pytest.raises(AssertionError, match=r"after 0.05 s waiting for state 7"):
        kit.until(lambda: seen.append(1), 0.05, lambda: f"state {len(seen) and 7}", 0.01)
    assert len(seen) >= 2  # polled more than once before giving up


def test_until_async_awaits_an_async_predicate() -> None:
    polls = itertools.count()

    async def probe() -> int:
        return next(polls) >= 2 and 42

    assert asyncio.run(kit.until_async(probe, 5, "two polls", 0.001)) == 42
    with pytest.raises(AssertionError, match="waiting for never"):
        asyncio.run(kit.until_async(lambda: False, 0.05, "never", 0.01))


def test_keys_contents_and_blocks_are_functions_of_their_arguments() -> None:
    assert kit.keys("t", 3, start=2) == kit.keys("t", 5)[2:]
    assert len(set(kit.keys("t", 100))) == 100 and kit.keys("t", 1) != kit.keys("u", 1)
    lay = kit.model_layout()
    assert kit.chain_keys(lay, 0, 4)[:2] == kit.chain_keys(lay, 0, 2)  # a prefix's keys
    k = kit.keys("c", 1)[0]
    assert kit.content(k, 4096) == kit.content(k, 4096) != kit.content(kit.keys("d", 1)[0], 4096)
    assert len(kit.tiled(k, 4096)) == 4096
    a, b = kit.blocks(2, 1024, 5), kit.blocks(2, 1024, 5)
    assert all((x == y).all() for x, y in zip(a, b, strict=True)) and a[0].nbytes == 1024
    assert kit.byte_layout(64 << 10).block_nbytes == 64 << 10
