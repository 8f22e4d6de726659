"""A PutObject/UploadPart body, read once into DRAM slots and checked on the way.

Plain bodies (``Content-Length`` bytes) and the SDKs' ``aws-chunked`` encoding with
unsigned chunks and a trailing checksum (``STREAMING-UNSIGNED-PAYLOAD-TRAILER``, what
boto3 sends over HTTPS by default) are accepted; chunks signed one by one
(``STREAMING-AWS4-HMAC-SHA256-PAYLOAD``) are refused as not implemented. Every byte is
hashed as it is copied (MD5 for the ETag; SHA-256 when the request signed the payload's
hash; CRC32, CRC32C, SHA-1 or SHA-256 when the client sent an ``x-amz-checksum-*``), by
the C hash functions over memoryviews.
"""

from __future__ import annotations

import base64
import hashlib
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import crc32c
from aiohttp import StreamReader

from ctxmem_dpu.s3.objects import S3Error

__all__ = ["Body", "body_size"]

UNSIGNED = "UNSIGNED-PAYLOAD"
STREAMING_UNSIGNED = "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
_READ = 1 << 20
_MAX_LINE = 4096


class _Crc:
    """zlib.crc32 / crc32c.crc32c as a hash object (big-endian 4-byte digest)."""

    def __init__(self, fn: Any) -> None:
        self._fn = fn
        self._v = 0

    def update(self, data: memoryview) -> None:
        self._v = self._fn(data, self._v)

    def digest(self) -> bytes:
        return self._v.to_bytes(4, "big")


_CHECKSUMS: dict[str, Callable[[], Any]] = {
    "crc32": lambda: _Crc(zlib.crc32), "crc32c": lambda: _Crc(crc32c.crc32c),
    "sha1": hashlib.sha1, "sha256": hashlib.sha256}


def body_size(headers: Mapping[str, str], content_length: int | None, sha: str) -> int:
    """The object bytes the request carries (decoded length for aws-chunked)."""
    if sha.startswith("STREAMING-") and sha != STREAMING_UNSIGNED:
        raise S3Error(501, "NotImplemented", f"x-amz-content-sha256 {sha}: chunks signed one "
                      f"by one are not supported; send UNSIGNED-PAYLOAD, the payload's "
                      f"SHA-256 or {STREAMING_UNSIGNED} (the SDKs' defaults)")
    raw = headers.get("x-amz-decoded-content-length") if sha == STREAMING_UNSIGNED \
        else content_length
    if raw is None:
        raise S3Error(411, "MissingContentLength", "the request gives no Content-Length "
                      "(x-amz-decoded-content-length for aws-chunked); send one")
    try:
        n = int(raw)
    except ValueError:
        raise S3Error(400, "InvalidArgument", f"bad body length {raw!r}") from None
    if n < 0:
        raise S3Error(400, "InvalidArgument", f"bad body length {n}")
    return n


class Body:
    """Fills views from the request body in order (:meth:`fill`), then :meth:`finish`
    checks what the client declared about it."""

    def __init__(self, content: StreamReader, headers: Mapping[str, str], sha: str,
                 size: int) -> None:
        self._content = content
        self._headers = headers
        self._sha = sha
        self.size = size
        self._chunked = sha == STREAMING_UNSIGNED
        self._buf = b""
        self._off = 0
        self._left = 0  # bytes left in the current aws-chunked chunk
        self._eof = False
        self._trailers: dict[str, str] = {}
        self.md5 = hashlib.md5()
        self._hashes: list[Any] = [self.md5]
        self._sha256 = hashlib.sha256() if len(sha) == 64 else None
        if self._sha256 is not None:
            self._hashes.append(self._sha256)
        self._checks: dict[str, Any] = {}
        names = [k[len("x-amz-checksum-"):] for k in headers
                 if k.lower().startswith("x-amz-checksum-")]
        names += [t.strip().lower()[len("x-amz-checksum-"):]
                  for t in headers.get("x-amz-trailer", "").split(",") if t.strip()]
        for name in names:
            name = name.lower()
            if name in _CHECKSUMS and name not in self._checks:
                self._checks[name] = _CHECKSUMS[name]()
                self._hashes.append(self._checks[name])

    async def _line(self) -> bytes:
        try:
            line = await self._content.readuntil(b"\n")
        except ValueError:  # longer than the reader's buffer
            line = b"x" * (_MAX_LINE + 1)
        if len(line) > _MAX_LINE:
            raise S3Error(400, "InvalidRequest", "an aws-chunked line is too long")
        return line

    async def _more(self) -> bytes:
        if not self._chunked:
            return await self._content.readany()
        if self._eof:
            return b""
        if self._left == 0:
            line = await self._line()
            try:
                self._left = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise S3Error(400, "InvalidRequest", f"bad aws-chunked chunk header "
                              f"{line[:64]!r}") from None
            if self._left == 0:
                while True:  # trailers, up to the empty line
                    t = (await self._line()).strip()
                    if not t:
                        break
                    k, _, v = t.decode("latin-1").partition(":")
                    self._trailers[k.strip().lower()] = v.strip()
                    if len(self._trailers) > 16:
                        raise S3Error(400, "InvalidRequest", "too many aws-chunked trailers")
                self._eof = True
                return b""
        data = await self._content.read(min(self._left, _READ))
        if not data:
            return b""
        self._left -= len(data)
        if self._left == 0 and (await self._content.readexactly(2)) != b"\r\n":
            raise S3Error(400, "InvalidRequest", "an aws-chunked chunk does not end in CRLF")
        return data

    async def fill(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            if self._off >= len(self._buf):
                self._buf, self._off = await self._more(), 0
                if not self._buf:
                    raise S3Error(400, "IncompleteBody", f"the body ended before the "
                                  f"{self.size} bytes it declared")
            k = min(len(view) - got, len(self._buf) - self._off)
            view[got:got + k] = memoryview(self._buf)[self._off:self._off + k]
            got += k
            self._off += k
        for h in self._hashes:
            h.update(view)

    async def finish(self) -> None:
        """After :attr:`size` bytes: nothing more may follow; the payload hash and the
        checksums the client sent must match."""
        if self._off < len(self._buf) or await self._more():
            raise S3Error(400, "InvalidRequest", f"the body is longer than the {self.size} "
                          f"bytes it declared")
        if self._sha256 is not None and self._sha256.hexdigest() != self._sha:
            raise S3Error(400, "XAmzContentSHA256Mismatch", "the body's SHA-256 does not "
                          "match x-amz-content-sha256")
        md5 = self._headers.get("Content-MD5")
        if md5 is not None and base64.b64encode(self.md5.digest()).decode() != md5:
            raise S3Error(400, "BadDigest", "the body does not match its Content-MD5")
        for name, h in self._checks.items():
            header = f"x-amz-checksum-{name}"
            want = self._trailers.get(header) or self._headers.get(header)
            if want and base64.b64encode(h.digest()).decode() != want:
                raise S3Error(400, "BadDigest", f"the body does not match its {header}")
