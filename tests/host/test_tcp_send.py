"""The TCP channel's batched send (``ctxmem.transport.tcp._send_all``): many buffers per
``sendmsg``, resumed exactly where a partial send stopped, so the byte stream is the one
two ``sendall`` per block produced (the wire is unchanged)."""

from __future__ import annotations

import random
import socket
import threading

import pytest

from ctxmem.transport import tcp


class _Trickle:
    """A socket whose ``sendmsg`` takes a random number of bytes (sometimes across
    several buffers, sometimes stopping inside one), like a full socket buffer."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.out = bytearray()
        self.calls = 0
        self.most_buffers = 0

    def sendmsg(self, bufs: list[memoryview]) -> int:
        self.calls += 1
        self.most_buffers = max(self.most_buffers, len(bufs))
        assert all(b.nbytes for b in bufs), "an empty buffer was passed on"
        data = b"".join(bytes(b) for b in bufs)
        n = self.rng.randint(1, len(data))
        self.out += data[:n]
        return n


@pytest.mark.parametrize("seed", range(20))
def test_partial_sends_resume_where_they_stopped(seed: int) -> None:
    rng = random.Random(seed)
    bufs = [memoryview(rng.randbytes(rng.choice([0, 1, 16, 4096, 70_000])))
            for _ in range(rng.randint(1, 3000))]
    sock = _Trickle(seed)
    tcp._send_all(sock, list(bufs))  # type: ignore[arg-type]
    assert sock.out == b"".join(bytes(b) for b in bufs)
    assert sock.most_buffers <= tcp._IOV_MAX


def test_one_call_for_a_batch_that_fits_the_socket() -> None:
    """Over a real socket pair, 600 headers and payloads (1,200 buffers, over IOV_MAX)
    go in two ``sendmsg`` calls when the socket takes them at once."""
    a, b = socket.socketpair()
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        bufs = [memoryview(bytes([i % 251]) * 100) for i in range(1200)]
        want = b"".join(bytes(x) for x in bufs)
        got = bytearray()

        def drain() -> None:
            while len(got) < len(want):
                got.extend(b.recv(1 << 20))

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        calls = 0
        real = a.sendmsg

        class Counting:
            def sendmsg(self, chunk: list[memoryview]) -> int:
                nonlocal calls
                calls += 1
                return real(chunk)

        tcp._send_all(Counting(), bufs)  # type: ignore[arg-type]
        reader.join(timeout=10)
        assert not reader.is_alive() and bytes(got) == want
        assert calls <= 3
    finally:
        a.close()
        b.close()
