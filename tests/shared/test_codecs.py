"""CRC32C and AES-256-XTS against published test vectors."""

from __future__ import annotations

import os

import pytest

from ctxmem_common.codecs import XtsCipher, crc32c, derive_namespace_key, xts_tweak
from tests.shared.xts_vectors import XTS_AES_256_VECTORS

# RFC 3720 (iSCSI) appendix B.4 CRC32C examples, plus the classic check value.
CRC_VECTORS = [
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    (b"123456789", 0xE3069283),
]


@pytest.mark.parametrize(("data", "expected"), CRC_VECTORS)
def test_crc32c_published_vectors(data: bytes, expected: int) -> None:
    assert crc32c(data) == expected


def test_crc32c_is_incremental_and_takes_memoryviews() -> None:
    data = os.urandom(1 << 20)
    mv = memoryview(data)
    assert crc32c(mv[512:], crc32c(mv[:512])) == crc32c(data)


# IEEE Std 1619-2007 XTS-AES-256 test vector 10 (data unit sequence number 0xff, 512-byte
# data unit whose plaintext is bytes 00..ff twice), from the published vectors of xts_vectors.
_V10 = next(v for v in XTS_AES_256_VECTORS if v[0] == "ieee1619-v10")
V10_KEY, V10_PT, V10_CT = _V10[1], _V10[3], _V10[4]


def test_xts_ieee1619_vector_10() -> None:
    cipher = XtsCipher(V10_KEY)
    # The project's tweak puts (offset / 4096) in the low 8 bytes: offset 0xff * 4096 on
    # device 0 is the standard's data unit sequence number 0xff.
    tweak = xts_tweak(0, 0xFF * 4096)
    assert tweak == (0xFF).to_bytes(16, "little")
    out = bytearray(len(V10_PT))
    cipher.encrypt_into(V10_PT, out, tweak)
    assert bytes(out) == V10_CT
    back = bytearray(len(V10_CT))
    cipher.decrypt_into(V10_CT, back, tweak)
    assert bytes(back) == V10_PT


def test_xts_in_place_and_tweak_dependence() -> None:
    cipher = XtsCipher(V10_KEY)
    data = bytearray(os.urandom(8192))
    orig = bytes(data)
    cipher.encrypt_into(data, data, xts_tweak(3, 4096))
    assert bytes(data) != orig
    other = bytearray(len(orig))
    cipher.encrypt_into(orig, other, xts_tweak(3, 8192))
    assert bytes(other) != bytes(data), "a different extent address must encrypt differently"
    cipher.decrypt_into(data, data, xts_tweak(3, 4096))
    assert bytes(data) == orig


def test_namespace_keys_differ_and_are_valid_xts_keys() -> None:
    master = os.urandom(32)
    k1 = derive_namespace_key(master, b"a" * 16)
    k2 = derive_namespace_key(master, b"b" * 16)
    assert len(k1) == 64 and k1 != k2 and k1[:32] != k1[32:]
    assert derive_namespace_key(master, b"a" * 16) == k1


def test_codec_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="64 bytes"):
        XtsCipher(b"short")
    with pytest.raises(ValueError, match="aligned"):
        xts_tweak(0, 100)
    with pytest.raises(ValueError, match="32 bytes"):
        derive_namespace_key(b"x", b"y")
