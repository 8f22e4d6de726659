"""Forging flash records as an attacker who writes the device would: a payload whose
CRC32C is chosen, a header whose CRC32C is made valid again, a header of the previous
record format (version 1, CRC32C only). Used by the authenticated-record tests."""

from __future__ import annotations

from ctxmem_common.codecs import crc32c

# The record header of format version 1 (before authenticators) ends with its CRC32C at
# byte 125; version 2 keeps its authenticator there, its CRC32C after.
V1_BODY = 125
REC2_BODY = 153


def forge_crc(data: bytes, target: int, at: int = 0) -> bytes:
    """``data`` with the 4 bytes at ``at`` chosen so that its CRC32C is ``target``: CRC32C
    is affine over GF(2), so 32 probes give the linear map and Gaussian elimination the
    bytes (what anyone can do: a CRC32C is no authenticator)."""
    def crc_with(x: int) -> int:
        return crc32c(data[:at] + x.to_bytes(4, "little") + data[at + 4:])

    base = crc_with(0)
    cols = [crc_with(1 << i) ^ base for i in range(32)]
    # Solve sum(x_i * cols[i]) == target ^ base: rows are (column, the bit it sets in x).
    rows = [(c, 1 << i) for i, c in enumerate(cols)]
    want, x = target ^ base, 0
    basis: list[tuple[int, int]] = []
    for c, m in rows:
        for bc, bm in basis:
            if c ^ bc < c:
                c, m = c ^ bc, m ^ bm
        if c:
            basis.append((c, m))
            basis.sort(reverse=True)
    for bc, bm in basis:
        if want ^ bc < want:
            want, x = want ^ bc, x ^ bm
    assert want == 0, "the CRC32C map was not invertible on these 4 bytes"
    out = data[:at] + x.to_bytes(4, "little") + data[at + 4:]
    assert crc32c(out) == target
    return out


def rehash(header: bytes) -> bytes:
    """``header`` (a whole 4 KiB entry) with its header CRC32C made valid again."""
    body = header[:REC2_BODY]
    return body + crc32c(body).to_bytes(4, "little") + header[REC2_BODY + 4:]


def v1_header(header: bytes) -> bytes:
    """``header`` (a 4 KiB entry of format 2) as the previous release wrote it: version 1,
    no authenticator, its CRC32C at offset 125."""
    body = bytearray(header[:V1_BODY])
    body[8:10] = (1).to_bytes(2, "little")
    return (bytes(body) + crc32c(bytes(body)).to_bytes(4, "little")).ljust(len(header), b"\0")
