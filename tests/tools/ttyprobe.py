"""A real terminal for in-process progress tests: ``with terminal_stderr(mp) as read:``
puts a pty (120 columns) in ``sys.stderr``; ``read()`` returns what was drawn on it."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import sys
import termios
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest


@contextmanager
def terminal_stderr(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], str]]:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("CTXMEM_PROGRESS", raising=False)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    stream = open(slave, "w", buffering=1, encoding="utf-8")  # noqa: SIM115
    got = bytearray()

    def read() -> str:
        stream.flush()
        while select.select([master], [], [], 0.1)[0]:
            chunk = os.read(master, 65536)
            if not chunk:
                break
            got.extend(chunk)
        return got.decode("utf-8", "replace")

    monkeypatch.setattr(sys, "stderr", stream)
    try:
        yield read
    finally:
        monkeypatch.setattr(sys, "stderr", sys.__stderr__)
        stream.close()
        os.close(master)
