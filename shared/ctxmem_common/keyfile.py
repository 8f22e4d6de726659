"""The encryption master key: where it comes from, read one way by the service and by
``ctxmem check``. The key itself is never logged or put in an error message."""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import replace
from pathlib import Path

from ctxmem_common import safepaths
from ctxmem_common.config import EncryptionConfig
from ctxmem_common.errors import ConfigError

__all__ = ["load_master_key", "load_service_key"]

log = logging.getLogger(__name__)


def load_master_key(enc: EncryptionConfig, *, create: bool) -> bytes | None:
    """The 32-byte master key from ``enc.key_env``'s variable or ``enc.key_file``.

    None when encryption is off. With ``create`` (the service's first start), a configured
    key file that does not exist yet is created with mode 0600 and a fresh key; a file
    with the wrong content is an error, never replaced. Raises ConfigError when no key is
    configured or available, or the key is not 64 hex characters.
    """
    if not enc.enabled:
        return None
    if enc.key_env and os.environ.get(enc.key_env):
        raw = os.environ[enc.key_env].strip()
        source = f"environment variable {enc.key_env}"
    elif enc.key_file:
        path = Path(enc.key_file)
        # Created and read through safepaths: no symbolic link, not another user's file,
        # not readable or writable by group/other, in a directory only we can write.
        fresh = secrets.token_hex(32) + "\n" if create else None
        existed = os.path.lexists(path)
        try:
            raw = safepaths.open_key_file(path, create_with=fresh).strip()
        except FileNotFoundError:
            raise ConfigError(f"encryption key file {path} does not exist") from None
        if create and not existed:
            log.warning("created a new encryption master key file at %s (mode 0600)", path)
        source = f"key file {path}"
    else:
        raise ConfigError(
            "encryption.enabled is true but no key is configured: set encryption.key_file, "
            f"or the environment variable named by encryption.key_env ({enc.key_env!r}), or "
            "set encryption.enabled: false"
        )
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise ConfigError(f"encryption master key from {source} must be 64 hex characters "
                          f"(32 bytes); it is not (content not shown)")
    return key


def load_service_key(enc: EncryptionConfig, *, create: bool) -> bytes | None:
    """The master key as the service holds it: :func:`load_master_key` with encryption
    on; with encryption off, still the configured key (``key_file``, created as with
    encryption on; or ``key_env``'s variable when set), since it also keys the flash
    records' authenticators. ``None`` only when encryption is off and no key is configured
    or the configured one cannot be read (logged: the authenticators then prove nothing)."""
    if enc.enabled:
        return load_master_key(enc, create=create)
    if not enc.key_file and not (enc.key_env and os.environ.get(enc.key_env)):
        return None
    try:
        return load_master_key(replace(enc, enabled=True), create=create)
    except (ConfigError, OSError) as exc:
        log.warning("encryption is off and the configured master key cannot be used for "
                    "the flash records' authenticators (%s); they prove nothing against "
                    "anyone who writes the flash", exc)
        return None
