"""The Redis launcher for tests and benches: a real redis-server, stopped and restarted."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest


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


def _taken(port: int) -> socket.socket:
    """A listening socket on ``port``: another process that took it first."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(1)
    return s


def test_ports_taken_after_the_choice_are_chosen_again(tmp_path: Path) -> None:
    """The CI failure of round 3: a cluster node's chosen port was bound by something else
    before redis-server started. The first start chooses new ports; the node serves."""
    from ctxmem_tools.launcher import free_ports
    from ctxmem_tools.redis_server import RedisServer

    ports = free_ports(8)
    assert len(set(ports)) == 8
    r = RedisServer(tmp_path / "r", cluster=True, start=False)
    assert r.port != r.bus_port
    first = (r.port, r.bus_port)
    with _taken(r.bus_port):
        try:
            r.start()
            assert (r.port, r.bus_port) != first
            assert _ping(r) == b"+OK\r\n+PONG\r\n"
            port = r.port
            r.stop()
            r.start()  # a restart keeps its port
            assert r.port == port
        finally:
            r.stop()


def test_a_given_port_that_is_taken_is_a_clear_error(tmp_path: Path) -> None:
    from ctxmem_tools.launcher import free_ports
    from ctxmem_tools.redis_server import PortTaken, RedisServer

    port = free_ports(1)[0]
    with _taken(port):
        r = RedisServer(tmp_path / "r", port=port, start=False)
        with pytest.raises(PortTaken, match=f"127.0.0.1:{port}.*Address already in use"):
            r.start()
        assert r.proc is None
