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

Two implementations stand behind :class:`XtsCipher`, byte for byte the same:

* ``openssl``: the system's libcrypto through ctypes (:mod:`ctxmem_common.codecs.
  xts_openssl`): the key schedule kept per (key, direction, thread), the GIL released
  while OpenSSL encrypts, so the service's I/O threads encrypt at once.
* ``cryptography``: a new ``cryptography`` cipher context per data unit (a key expansion
  and ≈ 3 µs of Python and setup per record, with the GIL held; the encryption itself
  runs without it). OpenSSL there is the one bundled in its wheel, which can be a newer
  one with much faster AES code than the system's (see :func:`_choose`).

``CTXMEM_XTS_IMPL`` forces one at import (``openssl`` or ``cryptography``); unset means
``openssl`` where the system's libcrypto loads, has AES-256-XTS and is the same OpenSSL
release as ``cryptography``'s or newer, else ``cryptography`` (see :func:`_choose`).
:data:`IMPLEMENTATION` says which is active (``openssl (OpenSSL 3.0.x ...)`` or
``cryptography (OpenSSL ...)``); the service logs it at start and the bench prints it.
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Buffer

from cryptography.hazmat.backends.openssl import backend as _cryptography_backend
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ctxmem_common.codecs import xts_openssl

XTS_KEY_BYTES = 64
MASTER_KEY_BYTES = 32
SECTOR = 4096
MAX_UNIT_BYTES = 16 << 20

ENV = "CTXMEM_XTS_IMPL"
_CHOICES = ("openssl", "cryptography")


@functools.cache
def system_libcrypto() -> xts_openssl.Libcrypto:
    """The system's libcrypto, loaded once (:class:`~ctxmem_common.codecs.xts_openssl.
    XtsUnavailable` when there is none usable; not cached, so a later call tries again)."""
    return xts_openssl.load()


def _release(version_number: int) -> tuple[int, int]:
    """(major, minor) of an ``OPENSSL_VERSION_NUMBER`` (1.1: 0x1010107f; 3.x: 0x30000140)."""
    return version_number >> 28, (version_number >> 20) & 0xFF


def _choose(choice: str) -> xts_openssl.Libcrypto | None:
    """The libcrypto of the ``openssl`` implementation when it is the one to use, else
    None (``cryptography``). Unforced, ``openssl`` is used where the system's OpenSSL is
    the same release as the one ``cryptography`` runs on or newer: the AES code is then
    the same or better, and the kept key schedule saves the per-record setup. A wheel of
    ``cryptography`` bundles its own OpenSSL, often newer, whose AES kernels can be much
    faster than the system's (OpenSSL 3.2+ has VAES/AVX-512 XTS; 3.0 does AES-NI only:
    25 against 8.4 GB/s on an AVX-512 CPU), so then ``cryptography`` stays."""
    if choice == "cryptography":
        return None
    try:
        lib = system_libcrypto()
    except xts_openssl.XtsUnavailable as exc:
        if choice:
            raise ImportError(f"{ENV}={choice}: {exc}; install the system's OpenSSL "
                              f"(libcrypto.so.3, package libssl3), or set "
                              f"{ENV}=cryptography") from None
        return None
    if choice or _release(lib.version_number) >= _release(
            _cryptography_backend.openssl_version_number()):
        return lib
    return None


_choice = os.environ.get(ENV, "").strip().lower()
if _choice and _choice not in _CHOICES:
    raise ImportError(f"{ENV}={_choice!r}: use one of {', '.join(_CHOICES)}, or unset it")
_libcrypto = _choose(_choice)

IMPLEMENTATION: str = (
    f"cryptography ({_cryptography_backend.openssl_version_text()})" if _libcrypto is None
    else f"openssl ({_libcrypto.version})")
"""The active implementation (see the module docstring)."""


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

    def __init__(self, key: bytes, implementation: str | None = None) -> None:
        """``implementation``: ``openssl`` or ``cryptography`` to pick one (tests and
        benchmarks compare them in one process); None for the active one
        (:data:`IMPLEMENTATION`)."""
        if len(key) != XTS_KEY_BYTES:
            raise ValueError(f"AES-256-XTS key must be {XTS_KEY_BYTES} bytes, got {len(key)}")
        # XTS forbids equal key halves; refused at use, as cryptography does (a cipher
        # built only for its check value or flag, as some tests do, stays legal).
        self._equal_halves = key[:32] == key[32:]
        self._algorithm = algorithms.AES(key)
        if implementation not in (None, *_CHOICES):
            raise ValueError(f"XTS implementation {implementation!r}: use one of "
                             f"{', '.join(_CHOICES)} or None")
        lib = _libcrypto
        if implementation == "cryptography":
            lib = None
        elif implementation == "openssl" and lib is None:
            lib = _choose("openssl")  # raises ImportError saying why
        self.implementation = "cryptography" if lib is None else "openssl"
        self._contexts = None if lib is None else xts_openssl.XtsContexts(lib, bytes(key))
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
        if self._equal_halves:
            raise ValueError("AES-256-XTS key halves are equal; XTS requires two "
                             "different keys")
        if self._contexts is not None:
            self._contexts.run(encrypt, src_mv, dst_mv, tweak, n)
            return
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
