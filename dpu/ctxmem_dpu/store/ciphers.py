"""Per-namespace AES-XTS ciphers, and which flash devices encrypt in hardware.

A record is encrypted in software with its namespace's key (derived from the master key)
unless its device's storage backend encrypts at rest itself (an SPDK crypto bdev on a
BlueField, or SPDK's software accel module): encrypting twice would only cost CPU. Such a
device gets plaintext, the record header's encrypted flag clear (what promotion, rebuild
and ``ctxmem check`` read to decide whether to decrypt) and its device-encrypted flag set:
the header says which layer encrypted.
"""

from __future__ import annotations

from collections.abc import Iterable

from ctxmem_common.codecs import XtsCipher, derive_namespace_key


class Keyring:
    """Namespace digest → cipher (``None`` when encryption is off), built on first use."""

    def __init__(self, master_key: bytes | None, hardware_encrypted: Iterable[str] = ()) -> None:
        self._master_key = master_key
        self._hardware = frozenset(hardware_encrypted)
        self._ciphers: dict[bytes, XtsCipher | None] = {}

    def cipher(self, digest: bytes) -> XtsCipher | None:
        """The namespace's software cipher, whatever the device."""
        if digest not in self._ciphers:
            key = self._master_key
            self._ciphers[digest] = (
                XtsCipher(derive_namespace_key(key, digest)) if key is not None else None
            )
        return self._ciphers[digest]

    def device_encrypts(self, device: str) -> bool:
        """Whether flash device ``device``'s storage layer encrypts at rest itself."""
        return device in self._hardware

    def for_device(self, digest: bytes, device: str) -> XtsCipher | None:
        """The cipher for a record of the namespace on flash device ``device`` (its name):
        ``None`` for a device that encrypts in hardware."""
        if device in self._hardware:
            return None
        return self.cipher(digest)
