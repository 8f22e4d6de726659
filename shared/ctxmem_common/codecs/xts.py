"""AES-256-XTS encryption at rest with per-namespace keys.

* **Key**: 64 bytes (two AES-256 keys), derived per namespace from the service's master
  key with HKDF-SHA256 (``info`` = namespace digest), so a tenant's blocks are unreadable
  with another tenant's key and the master key never touches the data path.
* **Tweak**: the extent's address: ``device index`` (high 8 bytes) and ``byte offset /
  4096`` (low 8 bytes), little-endian — the same block written to two places encrypts
  differently, and moving ciphertext to another extent makes it decrypt to garbage (then
  the CRC check turns it into a miss).
* One XTS data unit per extent payload (OpenSSL allows up to 16 MiB per unit), so a 2 MiB
  block is one OpenSSL call.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Buffer

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

XTS_KEY_BYTES = 64
MASTER_KEY_BYTES = 32
SECTOR = 4096
MAX_UNIT_BYTES = 16 << 20


def derive_namespace_key(master_key: bytes, namespace_digest: bytes) -> bytes:
    """64-byte XTS key of one namespace; its two halves always differ."""
    if len(master_key) != MASTER_KEY_BYTES:
        raise ValueError(f"master key must be {MASTER_KEY_BYTES} bytes, got {len(master_key)}")
    okm = HKDF(
        algorithm=hashes.SHA256(),
        length=XTS_KEY_BYTES,
        salt=b"ctxmem-xts-v1",
        info=namespace_digest,
    ).derive(master_key)
    if okm[:32] == okm[32:]:  # astronomically unlikely; XTS forbids equal halves
        raise ValueError("derived XTS key halves are equal; rotate the master key")
    return okm


def xts_tweak(device_index: int, byte_offset: int) -> bytes:
    if byte_offset % SECTOR:
        raise ValueError(f"XTS extent offset {byte_offset} is not {SECTOR}-byte aligned")
    return (byte_offset // SECTOR).to_bytes(8, "little") + device_index.to_bytes(8, "little")


class XtsCipher:
    """Encrypts and decrypts extent payloads of one namespace."""

    def __init__(self, key: bytes) -> None:
        if len(key) != XTS_KEY_BYTES:
            raise ValueError(f"AES-256-XTS key must be {XTS_KEY_BYTES} bytes, got {len(key)}")
        self._algorithm = algorithms.AES(key)
        # Stored in each encrypted record's header (never 0: 0 means "not recorded"), so
        # a reader with another key (a wrong master key) knows the record is not bad, only
        # unreadable to it, and never invalidates it. 32 bits of a hash of the key.
        digest = hashlib.sha256(b"ctxmem key check\0" + key).digest()
        self.check_value = int.from_bytes(digest[:4], "little") | 1

    def _run(self, encrypt: bool, src: Buffer, dst: Buffer, tweak: bytes) -> None:
        src_mv = memoryview(src).cast("B")
        dst_mv = memoryview(dst).cast("B")
        n = len(src_mv)
        if len(dst_mv) < n:
            raise ValueError(f"XTS output buffer holds {len(dst_mv)} bytes, needs {n}")
        if n < 16 or n > MAX_UNIT_BYTES:
            raise ValueError(f"XTS data unit must be 16 B..16 MiB, got {n} bytes")
        cipher = Cipher(self._algorithm, modes.XTS(tweak))
        ctx = cipher.encryptor() if encrypt else cipher.decryptor()
        ctx.update_into(src_mv, dst_mv[:n])
        ctx.finalize()

    def encrypt_into(self, plaintext: Buffer, out: Buffer, tweak: bytes) -> None:
        """Encrypt ``plaintext`` into ``out`` (may be the same buffer)."""
        self._run(True, plaintext, out, tweak)

    def decrypt_into(self, ciphertext: Buffer, out: Buffer, tweak: bytes) -> None:
        """Decrypt ``ciphertext`` into ``out`` (may be the same buffer)."""
        self._run(False, ciphertext, out, tweak)
