"""The test kit every suite shares: layouts, keys, block contents and bounded waits.

One home for what the suites used to copy: a byte layout of a given block size, a
model-shaped layout, keys by tag or by token chain, the content a key stands for, random
blocks, and ``until``/``until_async``, the only deadline loops a test needs (every wait
is bounded and says what it waited for). It imports only the protocol package, so the
store, pod and host suites can all use it.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import numpy as np

from ctxmem_common.keys import chain_hashes
from ctxmem_common.layout import KVLayout

T = TypeVar("T")


def byte_layout(block: int, tokens_per_block: int = 1) -> KVLayout:
    """A one-layer ``uint8`` layout of one head, ``block`` bytes a block (the K and V
    halves of ``tokens_per_block`` tokens)."""
    return KVLayout(dtype="uint8", num_layers=1, num_kv_heads=1,
                    head_dim=block // (2 * tokens_per_block), tokens_per_block=tokens_per_block)


def model_layout(tokens_per_block: int = 16, num_layers: int = 2, dtype: str = "bfloat16",
                 num_kv_heads: int = 2, head_dim: int = 64) -> KVLayout:
    """A model-shaped layout, by default a small one: two KV heads of 64 (a 16-token
    ``bfloat16`` block of two layers is 16 KiB; ``model_layout(num_layers=32,
    num_kv_heads=8, head_dim=128)`` is Llama-3-8B's 2 MiB block)."""
    return KVLayout(dtype=dtype, num_layers=num_layers, num_kv_heads=num_kv_heads,
                    head_dim=head_dim, tokens_per_block=tokens_per_block)


def keys(tag: str, n: int, start: int = 0) -> list[bytes]:
    """``n`` distinct 32-byte keys named by ``tag`` (keys ``start`` .. ``start + n - 1``);
    the same tag and index give the same key in every process."""
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(start, start + n)]


def chain_keys(layout: KVLayout, start: int, n: int) -> list[bytes]:
    """The chained keys of blocks ``start`` .. ``start + n - 1`` of the token run
    0, 1, 2, ... in ``layout`` (a prefix shares its keys with every longer run)."""
    t = layout.tokens_per_block
    return chain_hashes(range(start * t, (start + n) * t), t)


def salted_keys(tag: str, n: int) -> list[bytes]:
    """The chained keys of tokens 0 .. n-1 at one token a block, salted by ``tag``."""
    return chain_hashes(range(n), 1, salt=tag.encode())


def content(key: bytes, nbytes: int) -> bytes:
    """The ``nbytes`` a block of ``key`` holds: random-looking, derived from the key
    alone, so a reader checks a block without keeping what was written."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def tiled(key: bytes, nbytes: int) -> bytes:
    """``sha256(key)`` repeated to ``nbytes`` (a multiple of 32): cheap per-key content."""
    return hashlib.sha256(key).digest() * (nbytes // 32)


def blocks(n: int, nbytes: int, seed: int) -> list[np.ndarray]:
    """``n`` random ``uint8`` blocks of ``nbytes``, the same for the same seed."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(n)]


def _timed_out(timeout: float, what: str | Callable[[], str]) -> AssertionError:
    said = what() if callable(what) else what
    return AssertionError(f"timed out after {timeout} s waiting for {said}")


def until(pred: Callable[[], T], timeout: float, what: str | Callable[[], str],
          interval: float = 0.05) -> T:
    """Poll ``pred`` until it returns something true and return that; past ``timeout``
    seconds fail the test, naming what was awaited (``what``, or what it returns then:
    e.g. the service's log at the moment of the failure)."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise _timed_out(timeout, what)
        time.sleep(interval)


def read_until(read: Callable[[], T], done: Callable[[T], object], timeout: float,
               interval: float = 0.05) -> T:
    """What ``read()`` returns once ``done`` holds for it, or its last value when
    ``timeout`` seconds pass: for a caller that asserts on the value itself (a count, the
    service's stats), so that a timeout fails with the values seen."""
    deadline = time.monotonic() + timeout
    while True:
        got = read()
        if done(got) or time.monotonic() > deadline:
            return got
        time.sleep(interval)


async def read_until_async(read: Callable[[], T | Awaitable[T]], done: Callable[[T], object],
                           timeout: float, interval: float = 0.02) -> T:
    """:func:`read_until` inside an event loop (``read`` plain or async)."""
    deadline = time.monotonic() + timeout
    while True:
        got = read()
        if asyncio.iscoroutine(got) or isinstance(got, asyncio.Future):
            got = await got
        if done(got) or time.monotonic() > deadline:  # type: ignore[arg-type]
            return got  # type: ignore[return-value]
        await asyncio.sleep(interval)


async def until_async(pred: Callable[[], T | Awaitable[T]], timeout: float,
                      what: str | Callable[[], str], interval: float = 0.02) -> T:
    """:func:`until` inside an event loop: ``pred`` may be a plain or an async callable,
    and the loop keeps running between polls."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if asyncio.iscoroutine(got) or isinstance(got, asyncio.Future):
            got = await got
        if got:
            return got  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise _timed_out(timeout, what)
        await asyncio.sleep(interval)
