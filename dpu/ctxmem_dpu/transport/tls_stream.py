"""TLS on an accepted non-blocking socket, driven by the event loop's own socket calls.

asyncio's ``loop.sock_*`` calls refuse ``ssl.SSLSocket``; rather than a second I/O path,
:class:`TlsStream` runs an ``ssl.SSLObject`` over two ``ssl.MemoryBIO`` buffers and moves
the ciphertext with ``loop.sock_recv`` / ``loop.sock_sendall``. So every wait stays where
the data server already bounds it (``asyncio.wait_for`` around the call: HELLO, read and
idle deadlines), the plaintext is decrypted straight into the caller's view (a DRAM slot
for a WRITE), and nothing here blocks the loop.

Reads take at most :data:`RECV_CHUNK` bytes of ciphertext at a time and writes encrypt
:data:`SEND_CHUNK` at a time, so one connection buffers at most about those amounts.
"""

from __future__ import annotations

import asyncio
import socket
import ssl

from ctxmem_common.tlsident import tenant_of_der

__all__ = ["RECV_CHUNK", "SEND_CHUNK", "TlsStream"]

RECV_CHUNK = 256 << 10
SEND_CHUNK = 256 << 10


class TlsStream:
    """The server side of one TLS connection over ``sock`` (non-blocking)."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext) -> None:
        self.sock = sock
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self.obj = context.wrap_bio(self._in, self._out, server_side=True)
        self.peer_tenant: str | None = None
        self.peer_der: bytes | None = None
        # The service's TLS files (ctxmem_dpu.tls.TrackedContext): told of this connection
        # once it is up, so a rotated client CA that no longer trusts it closes it.
        self._owner = getattr(context, "server_tls", None)

    async def _flush(self) -> None:
        if self._out.pending:
            await asyncio.get_running_loop().sock_sendall(self.sock, self._out.read())

    async def _fill(self) -> bool:
        """More ciphertext into the incoming BIO; False at the peer's EOF."""
        data = await asyncio.get_running_loop().sock_recv(self.sock, RECV_CHUNK)
        if not data:
            self._in.write_eof()
            return False
        self._in.write(data)
        return True

    async def handshake(self) -> None:
        """Complete the handshake (the caller bounds it with the HELLO deadline); then
        :attr:`peer_tenant` is the tenant the client certificate names, if any.

        Raises:
            ssl.SSLError: the handshake failed (not TLS, an unverified certificate...).
            ConnectionResetError: the peer closed during it.
        """
        while True:
            try:
                self.obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    raise ConnectionResetError("peer closed during the TLS handshake") \
                        from None
        await self._flush()  # the last flight and TLS 1.3 session tickets
        der = self.obj.getpeercert(binary_form=True)
        if der:
            self.peer_der = der
            self.peer_tenant = tenant_of_der(der)
            if self._owner is not None:
                self._owner.track(self)

    @property
    def version(self) -> str | None:
        return self.obj.version()

    async def recv_into(self, view: memoryview) -> int:
        """Up to ``len(view)`` plaintext bytes into ``view``; 0 when the peer closed."""
        while True:
            try:
                return int(self.obj.read(len(view), view))  # with a buffer: a count
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill() and not self._in.pending:
                    try:
                        return int(self.obj.read(len(view), view))  # with a buffer: a count
                    except (ssl.SSLZeroReturnError, ssl.SSLEOFError, ssl.SSLWantReadError):
                        return 0
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return 0

    async def sendall(self, data: bytes | memoryview) -> None:
        """Encrypt and send all of ``data``."""
        view = memoryview(data).cast("B")
        for off in range(0, len(view), SEND_CHUNK):
            self.obj.write(view[off:off + SEND_CHUNK])
            await self._flush()
