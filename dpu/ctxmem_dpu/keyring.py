"""Per-namespace AES-XTS ciphers and block authenticators, and which flash devices
encrypt in hardware.

Shared by the store (demotion, promotion, recovery) and the pod (``pod/shared_flash.py``
reads other nodes' records under the same keys), so it lives outside the store's private
modules.

A record is encrypted in software with its namespace's key (derived from the master key)
unless its device's storage backend encrypts at rest itself (an SPDK crypto bdev on a
BlueField, or SPDK's software accel module): encrypting twice would only cost CPU. Such a
device gets plaintext, the record header's encrypted flag clear (what promotion, rebuild
and ``ctxmem check`` read to decide whether to decrypt) and its device-encrypted flag set:
the header says which layer encrypted.

Every record carries an authenticator (:mod:`ctxmem_common.codecs.blockauth`) under its
namespace's authenticator key, whatever the device and whether encryption is on: the
service makes and checks it, so a device that encrypts in hardware gets one too. The key
derives from the master key, which the service loads whenever one is configured
(``encryption.key_file`` or ``key_env``), encryption on or off. Without any master key
(encryption off and none configured) the authenticators are made under
:data:`PUBLIC_MASTER_KEY`: they still catch accidents, but prove nothing against someone
who writes the flash (logged at start; docs/security.md).
"""

from __future__ import annotations

from collections.abc import Iterable

from ctxmem_common.codecs import XtsCipher, derive_namespace_key
from ctxmem_common.codecs.blockauth import BlockAuthenticator

#: The master key authenticators fall back to when the service has none: known to all.
PUBLIC_MASTER_KEY = bytes(32)


class Keyring:
    """Namespace digest → cipher (``None`` when encryption is off) and authenticator, built
    on first use. ``master_key``: the service's (``None``: none configured); ``encrypt``:
    whether records are encrypted in software (``encryption.enabled``)."""

    def __init__(self, master_key: bytes | None, hardware_encrypted: Iterable[str] = (),
                 encrypt: bool = True) -> None:
        self._master_key = master_key
        self._encrypt = encrypt and master_key is not None
        self._hardware = frozenset(hardware_encrypted)
        self._ciphers: dict[bytes, XtsCipher | None] = {}
        self._auth: dict[bytes, BlockAuthenticator] = {}

    @property
    def keyed(self) -> bool:
        """Whether authenticators are made under a secret key (a master key is loaded)."""
        return self._master_key is not None

    def cipher(self, digest: bytes) -> XtsCipher | None:
        """The namespace's software cipher, whatever the device."""
        if digest not in self._ciphers:
            key = self._master_key
            self._ciphers[digest] = (
                XtsCipher(derive_namespace_key(key, digest))
                if key is not None and self._encrypt else None
            )
        return self._ciphers[digest]

    def authenticator(self, digest: bytes) -> BlockAuthenticator:
        """The namespace's block authenticator (every device, encrypted or not)."""
        auth = self._auth.get(digest)
        if auth is None:
            auth = self._auth[digest] = BlockAuthenticator.for_namespace(
                self._master_key if self._master_key is not None else PUBLIC_MASTER_KEY,
                digest)
        return auth

    def device_encrypts(self, device: str) -> bool:
        """Whether flash device ``device``'s storage layer encrypts at rest itself."""
        return device in self._hardware

    def for_device(self, digest: bytes, device: str) -> XtsCipher | None:
        """The cipher for a record of the namespace on flash device ``device`` (its name):
        ``None`` for a device that encrypts in hardware."""
        if device in self._hardware:
            return None
        return self.cipher(digest)
