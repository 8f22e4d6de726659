"""``peer_wire.recv_block_into``, the fetcher's receive of a block's bytes (issue 28 item
2), on real loopback sockets:

* one ``recv_into`` call per block (``MSG_WAITALL``), however the sender splits the block
  (16 sends of 128 KiB with pauses between), byte-exact in the buffer given (without the
  flag: 18 calls);
* a sender that stalls half way: ``TimeoutError`` at the deadline (not before), and the
  socket's ``SO_RCVTIMEO`` is back to none after;
* a sender that closes half way: ``ConnectionError`` naming how many bytes came.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from ctxmem_common import peer_wire as w

BLOCK = 2 << 20


class CountingSocket(socket.socket):
    """A socket that counts its ``recv_into`` calls."""

    calls = 0

    def recv_into(self, *args: object, **kw: object) -> int:  # type: ignore[override]
        self.calls += 1
        return super().recv_into(*args, **kw)  # type: ignore[arg-type]


@pytest.fixture
def pair() -> Iterator[tuple[CountingSocket, socket.socket]]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    rx = CountingSocket()
    rx.connect(srv.getsockname())
    tx, _ = srv.accept()
    srv.close()
    try:
        yield rx, tx
    finally:
        rx.close()
        tx.close()


def test_one_receive_call_per_block_however_it_is_sent(
        pair: tuple[CountingSocket, socket.socket]) -> None:
    rx, tx = pair
    data = bytes(range(256)) * (BLOCK // 256)
    buf = bytearray(BLOCK)
    started = threading.Event()

    def send() -> None:
        started.wait(10)
        for i in range(0, BLOCK, 128 << 10):
            tx.sendall(data[i:i + (128 << 10)])
            time.sleep(0.002)

    t = threading.Thread(target=send)
    t.start()
    started.set()
    w.recv_block_into(rx, memoryview(buf), w.Deadline(20), "block a")
    t.join(10)
    assert buf == data
    assert rx.calls == 1


def test_a_sender_that_stalls_half_way_ends_at_the_deadline(
        pair: tuple[CountingSocket, socket.socket]) -> None:
    rx, tx = pair
    tx.sendall(bytes(BLOCK // 2))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="deadline"):
        w.recv_block_into(rx, memoryview(bytearray(BLOCK)), w.Deadline(0.5), "block b")
    assert time.monotonic() - t0 >= 0.45
    assert struct.unpack("ll", rx.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)) \
        == (0, 0)


def test_a_sender_that_closes_half_way_is_a_connection_error(
        pair: tuple[CountingSocket, socket.socket]) -> None:
    rx, tx = pair
    tx.sendall(bytes(1000))
    tx.close()
    with pytest.raises(ConnectionError, match="after 1000 of 2097152 bytes of block c"):
        w.recv_block_into(rx, memoryview(bytearray(BLOCK)), w.Deadline(10), "block c")
