"""Byte codecs used on the data path: CRC32C integrity and AES-256-XTS encryption at rest.

Both run in C (the ``crc32c`` package uses SSE4.2/ARMv8 CRC instructions; AES-XTS runs in
OpenSSL through ``cryptography``) and take buffers, never Python loops over bytes.
The flash write pipeline's order is: CRC32C of the plaintext (at commit) → encrypt →
write; the read pipeline is: read → decrypt → verify CRC32C. A mismatch is a miss.
"""

from ctxmem_common.codecs.crc import crc32c
from ctxmem_common.codecs.xts import XtsCipher, derive_namespace_key, xts_tweak

__all__ = ["XtsCipher", "crc32c", "derive_namespace_key", "xts_tweak"]
