"""Blocking socket helpers the adversary tests share (they speak the data-plane framings by
hand)."""

from __future__ import annotations

import socket


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``sock`` (its own timeout applies); ConnectionResetError
    naming how far it got if the peer closes first."""
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise ConnectionResetError(f"closed after {len(buf)} of {n} bytes")
        buf += got
    return buf
