"""Bounded connection floods against a real service on loopback (issue 25 item 4).

:class:`Flood` keeps ``count`` connections open to one port from one source address,
never authenticating: silent, or trickling one byte every ``trickle_s``. A connection
the service closes is reopened after ``reopen_s``, as an attacker would. Everything runs
on one thread with non-blocking sockets, and stops (closing every socket) on
:meth:`Flood.stop` or at ``max_s``. The numbers it reports (most connections held at
once, connections the service closed) go into docs/security.md.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from types import TracebackType


class Flood:
    def __init__(self, host: str, port: int, count: int, *, source: str = "127.0.0.1",
                 trickle: bytes = b"", trickle_s: float = 0.2, reopen_s: float = 0.05,
                 max_s: float = 60.0, family: int = socket.AF_INET) -> None:
        self.addr: tuple[str, int] | str = (host, port)
        self.family = family
        self.count = count
        self.source = source
        self.trickle = trickle
        self.trickle_s = trickle_s
        self.reopen_s = reopen_s
        self.max_s = max_s
        self.opened = 0  # connections opened in all
        self.cut = 0  # connections the service closed
        self.held_max = 0  # most open at once (on the attacker's side)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="flood")

    @classmethod
    def unix(cls, path: str, count: int, *, reopen_s: float = 0.05,
             max_s: float = 60.0) -> Flood:
        f = cls("", 0, count, family=socket.AF_UNIX, reopen_s=reopen_s, max_s=max_s)
        f.addr = path
        return f

    def start(self) -> Flood:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def __enter__(self) -> Flood:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _open(self) -> socket.socket | None:
        s = socket.socket(self.family, socket.SOCK_STREAM)
        try:
            if self.family == socket.AF_INET:
                s.bind((self.source, 0))
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(self.addr)
        except OSError:
            s.close()
            return None
        self.opened += 1
        return s

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        open_: dict[socket.socket, float] = {}  # socket -> next trickle time
        reopen_at: list[float] = []
        end = time.monotonic() + self.max_s
        try:
            while not self._stop.is_set() and time.monotonic() < end:
                now = time.monotonic()
                reopen_at = [t for t in reopen_at if t > now]  # the due ones reopen now
                want = self.count - len(open_) - len(reopen_at)
                for _ in range(min(want, 64)):  # at most 64 a round
                    s = self._open()
                    if s is None:
                        reopen_at.append(now + self.reopen_s)
                        continue
                    open_[s] = now + self.trickle_s
                    sel.register(s, selectors.EVENT_READ)
                self.held_max = max(self.held_max, len(open_))
                for key, _ in sel.select(0.02):
                    s = key.fileobj  # type: ignore[assignment]
                    assert isinstance(s, socket.socket)
                    try:
                        data = s.recv(4096)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        data = b""
                    if not data:  # cut by the service: reopen later
                        self._close(sel, open_, s)
                        self.cut += 1
                        reopen_at.append(time.monotonic() + self.reopen_s)
                if self.trickle:
                    now = time.monotonic()
                    for s, at in list(open_.items()):
                        if at <= now:
                            try:
                                s.send(self.trickle)
                                open_[s] = now + self.trickle_s
                            except (BlockingIOError, InterruptedError):
                                pass
                            except OSError as exc:
                                if exc.errno in (errno.ENOTCONN,):
                                    continue
                                self._close(sel, open_, s)
                                self.cut += 1
                                reopen_at.append(now + self.reopen_s)
        finally:
            for s in list(open_):
                self._close(sel, open_, s)
            sel.close()

    @staticmethod
    def _close(sel: selectors.BaseSelector, open_: dict[socket.socket, float],
               s: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(s)
        open_.pop(s, None)
        s.close()


def established(port: int, source: str) -> int:
    """TCP connections from ``source`` to ``port`` established on the service's side (the
    kernel's view: accepted or waiting in the listen queue)."""
    out = subprocess.run(["ss", "-Htn", "state", "established",
                          f"( sport = :{port} and dst {source} )"],
                         capture_output=True, text=True, timeout=10, check=False).stdout
    return len(out.splitlines())


def trickle_until_cut(sock: socket.socket, head: bytes, limit_s: float,
                      between: Callable[[], None] | None = None) -> float | None:
    """Send ``head`` (a request line), then one header line every 0.3 s (a slow loris),
    calling ``between`` before each; the seconds until the service cut the connection, or
    None if it had not after ``limit_s``. The socket is closed either way."""
    t0 = time.monotonic()
    try:
        sock.sendall(head)
        sock.settimeout(0.3)
        while time.monotonic() - t0 < limit_s:
            if between is not None:
                between()
            try:
                sock.sendall(b"X-Slow: 1\r\n")
                if sock.recv(4096) == b"":
                    return time.monotonic() - t0
            except TimeoutError:
                continue
            except OSError:
                return time.monotonic() - t0
        return None
    finally:
        sock.close()


def closed_unanswered(sock: socket.socket, timeout_s: float = 5.0) -> bool:
    """Whether the service closes ``sock`` (EOF or reset) within ``timeout_s`` without
    sending a byte; AssertionError if it answered."""
    sock.settimeout(timeout_s)
    try:
        assert sock.recv(4096) == b"", "a silent connection over the cap was answered"
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True
