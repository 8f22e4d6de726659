"""CRC32C and AES-256-XTS against published test vectors."""

from __future__ import annotations

import os

import pytest

from ctxmem_common.codecs import XtsCipher, crc32c, derive_namespace_key, xts_tweak

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


# IEEE Std 1619-2007 XTS-AES-256 test vector 10: data unit sequence number 0xff,
# 512-byte data unit whose plaintext is bytes 00..ff twice.
V10_KEY = bytes.fromhex(
    "2718281828459045235360287471352662497757247093699959574966967627"
    "3141592653589793238462643383279502884197169399375105820974944592"
)
V10_PT = bytes(range(256)) * 2
V10_CT = bytes.fromhex(
    "1c3b3a102f770386e4836c99e370cf9bea00803f5e482357a4ae12d414a3e63b5d31e276f8fe4a8d66b317f9"
    "ac683f44680a86ac35adfc3345befecb4bb188fd5776926c49a3095eb108fd1098baec70aaa66999a72a82f2"
    "7d848b21d4a741b0c5cd4d5fff9dac89aeba122961d03a757123e9870f8acf1000020887891429ca2a3e7a7d"
    "7df7b10355165c8b9a6d0a7de8b062c4500dc4cd120c0f7418dae3d0b5781c34803fa75421c790dfe1de1834"
    "f280d7667b327f6c8cd7557e12ac3a0f93ec05c52e0493ef31a12d3d9260f79a289d6a379bc70c50841473d1"
    "a8cc81ec583e9645e07b8d9670655ba5bbcfecc6dc3966380ad8fecb17b6ba02469a020a84e18e8f84252070"
    "c13e9f1f289be54fbc481457778f616015e1327a02b140f1505eb309326d68378f8374595c849d84f4c333ec"
    "4423885143cb47bd71c5edae9be69a2ffeceb1bec9de244fbe15992b11b77c040f12bd8f6a975a44a0f90c29"
    "a9abc3d4d893927284c58754cce294529f8614dcd2aba991925fedc4ae74ffac6e333b93eb4aff0479da9a41"
    "0e4450e0dd7ae4c6e2910900575da401fc07059f645e8b7e9bfdef33943054ff84011493c27b3429eaedb4ed"
    "5376441a77ed43851ad77f16f541dfd269d50d6a5f14fb0aab1cbb4c1550be97f7ab4066193c4caa773dad38"
    "014bd2092fa755c824bb5e54c4f36ffda9fcea70b9c6e693e148c151"
)


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
