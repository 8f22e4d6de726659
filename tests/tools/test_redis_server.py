"""The Redis launcher for tests and benches: a real redis-server, stopped and restarted."""

from __future__ import annotations

import socket
from typing import Any


def _ping(r: Any) -> bytes:
    with socket.create_connection((r.bind, r.port), timeout=2) as s:
        s.sendall(f"AUTH {r.password}\r\nPING\r\n".encode())
        out = b""
        while out.count(b"\r\n") < 2:
            out += s.recv(64)
        return out


def test_redis_server_answers_and_restarts_on_same_port(redis_server: Any) -> None:
    assert _ping(redis_server) == b"+OK\r\n+PONG\r\n"
    port = redis_server.port
    redis_server.stop()
    try:
        _ping(redis_server)
        raise AssertionError("redis-server still answering after stop()")
    except OSError:
        pass
    redis_server.start()
    assert redis_server.port == port
    assert _ping(redis_server) == b"+OK\r\n+PONG\r\n"
    assert redis_server.url.endswith(f"@127.0.0.1:{port}/0")
