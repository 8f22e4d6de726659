"""Byte codecs used on the data path: CRC32C integrity and AES-256-XTS encryption at rest.

Both run in C (CRC32C in this package's native extension, SSE4.2/ARMv8 CRC instructions,
fused with the copy where a block is copied, falling back to the ``crc32c`` package; see
:mod:`ctxmem_common.codecs.crc`. AES-XTS runs in OpenSSL through ``cryptography``) and take
buffers, never Python loops over bytes.
The flash write pipeline's order is: CRC32C of the plaintext (at commit) → encrypt →
write; the read pipeline is: read → decrypt → verify CRC32C. A mismatch is a miss.
"""

from ctxmem_common.codecs.crc import FUSED as CRC32C_FUSED
from ctxmem_common.codecs.crc import IMPLEMENTATION as CRC32C_IMPLEMENTATION
from ctxmem_common.codecs.crc import (
    copy_crc32c,
    copy_crc32c_between,
    copy_crc32c_from_slots,
    copy_crc32c_to_slots,
    crc32c,
    crc32c_many,
)
from ctxmem_common.codecs.xts import IMPLEMENTATION as XTS_IMPLEMENTATION
from ctxmem_common.codecs.xts import XtsCipher, derive_namespace_key, xts_tweak

__all__ = ["CRC32C_FUSED", "CRC32C_IMPLEMENTATION", "XTS_IMPLEMENTATION", "XtsCipher",
           "copy_crc32c", "copy_crc32c_between", "copy_crc32c_from_slots",
           "copy_crc32c_to_slots", "crc32c", "crc32c_many",
           "derive_namespace_key", "xts_tweak"]
