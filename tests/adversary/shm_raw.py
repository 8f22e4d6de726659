"""Raw shared-memory protocol steps, and a forked child to run them in.

The shim maps what it is given and never misbehaves; these helpers speak the Unix-socket
protocol by hand (hello, MAP, the fd that comes back) so a test can do what a hostile
client would: resize the slab fd, never read the replies, connect as another uid. They
use only ``socket``/``os``/``struct`` so a forked child (no gRPC) can run them safely.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from ctxmem_common.wire import SHM_HELLO, SHM_MAP, SHM_MAP_REPLY, SHM_STATUS


def shm_connect(path: str, session_id: int, token: bytes, timeout_s: float = 10.0
                ) -> tuple[socket.socket, int]:
    """A Unix-socket connection that has sent its hello, and the status it got back."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    sock.connect(path)
    sock.sendall(SHM_HELLO.pack(b"CXS1", session_id, token))
    buf = b""
    while len(buf) < SHM_STATUS.size:
        chunk = sock.recv(SHM_STATUS.size - len(buf))
        if not chunk:
            raise ConnectionResetError("service closed the connection before its status")
        buf += chunk
    _magic, status = SHM_STATUS.unpack(buf)
    return sock, status


def shm_map(sock: socket.socket, region: int, generation: int) -> tuple[int, int | None, int]:
    """MAP ``region``: (status, fd or None, size)."""
    sock.sendall(SHM_MAP.pack(b"CXSM", region, generation))
    msg, fds, _flags, _addr = socket.recv_fds(sock, SHM_MAP_REPLY.size, 1)
    if len(msg) != SHM_MAP_REPLY.size:
        raise ConnectionResetError(f"short MAP reply ({len(msg)} bytes)")
    _m, status, _gen, size = SHM_MAP_REPLY.unpack(msg)
    return status, (fds[0] if fds else None), size


def run_in_child(fn: Callable[[], dict[str, Any]], timeout_s: float = 30.0) -> dict[str, Any]:
    """Run ``fn`` in a forked child (so a SIGBUS or a setuid stays there) and return its
    JSON-able result; {"signal": n} if the child died of a signal. The child must not use
    gRPC (threads do not survive fork); it ends with ``os._exit``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            os.close(r)
            try:
                out = fn()
            except BaseException as exc:  # report, never unwind into pytest
                out = {"error": f"{type(exc).__name__}: {exc}"}
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                raise TimeoutError(f"child {pid} did not finish within {timeout_s} s")
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
        _pid, st = os.waitpid(pid, 0)
    if os.WIFSIGNALED(st):
        return {"signal": os.WTERMSIG(st)}
    return dict(json.loads(data)) if data else {"error": "child wrote nothing"}
