"""The master key as the service holds it (``keyfile.load_service_key``): with encryption
off it still keys the flash records' authenticators, so a configured key is loaded (and
created, as with encryption on); without one configured, or with one that cannot be used,
there is none (the service then logs that its authenticators prove nothing)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from ctxmem_common.config import EncryptionConfig
from ctxmem_common.keyfile import load_master_key, load_service_key


def test_encryption_off_still_loads_or_creates_the_configured_key(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    d.mkdir(mode=0o700)
    enc = EncryptionConfig(enabled=False, key_file=str(d / "master.key"), key_env="")
    assert load_master_key(enc, create=True) is None  # the XTS key: off
    key = load_service_key(enc, create=True)
    assert key is not None and len(key) == 32
    assert (d / "master.key").stat().st_mode & 0o777 == 0o600
    assert load_service_key(enc, create=False) == key  # the same key at every start


def test_encryption_off_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTXMEM_TEST_KEY", "ab" * 32)
    enc = EncryptionConfig(enabled=False, key_file="", key_env="CTXMEM_TEST_KEY")
    assert load_service_key(enc, create=False) == bytes([0xAB]) * 32


def test_none_configured_or_unusable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("CTXMEM_MASTER_KEY", raising=False)
    assert load_service_key(EncryptionConfig(enabled=False, key_file=""), create=True) is None
    bad = tmp_path / "bad.key"
    bad.write_text("not hex\n")
    os.chmod(bad, 0o600)
    caplog.set_level(logging.WARNING)
    enc = EncryptionConfig(enabled=False, key_file=str(bad), key_env="")
    assert load_service_key(enc, create=False) is None
    assert any("authenticators" in r.getMessage() for r in caplog.records)
