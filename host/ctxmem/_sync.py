"""A private event loop in a daemon thread, so the async core has a sync facade.

Engines call the shim from plain threads and from worker processes; the sync API runs
coroutines on this loop and waits with a timeout. After ``fork()`` the child does not
inherit the thread, so :func:`os.register_at_fork` drops the loop (and everything bound
to it) in the child; the next call starts a fresh one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_generation = 0  # bumps on every fork: objects bound to an older loop must rebuild
_fork_hooks: list[Callable[[], None]] = []


class SyncError(RuntimeError):
    """The sync API was called from inside the shim's own loop thread (would deadlock)."""


def loop_generation() -> int:
    return _generation


def get_loop() -> asyncio.AbstractEventLoop:
    global _loop, _thread
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            t = threading.Thread(target=loop.run_forever, name="ctxmem_io", daemon=True)
            t.start()
            _loop, _thread = loop, t
        return _loop


def run(coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
    loop = get_loop()
    if threading.current_thread() is _thread:
        coro.close()
        raise SyncError("ctxmem's sync API was called from its own event loop; use AsyncClient")
    fut = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return fut.result(timeout)
    except concurrent.futures.TimeoutError:
        fut.cancel()
        raise TimeoutError(f"ctxmem call did not finish within {timeout} s") from None


def on_fork_in_child(hook: Callable[[], None]) -> None:
    _fork_hooks.append(hook)


def _after_fork_in_child() -> None:
    global _loop, _thread, _generation
    _loop = None
    _thread = None
    _generation += 1
    for hook in _fork_hooks:
        hook()


os.register_at_fork(after_in_child=_after_fork_in_child)
