"""Fixtures for the storage-backend tests: a fake SPDK (NOT SPDK) and config builders."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from storage_fake_spdk import FakeSpdk, serve_fake_spdk
from storage_spdk_scenarios import base_raw, full_overrides, merge, write_secrets


@pytest.fixture
def fake_spdk(tmp_path: Path) -> Iterator[FakeSpdk]:
    """A fake SPDK JSON-RPC server (NOT SPDK) on a Unix socket, recording requests."""
    with serve_fake_spdk(tmp_path / "dev") as server:
        yield server


@pytest.fixture
def secrets_dir(tmp_path: Path) -> Path:
    """A PSK file and an AES-XTS key file with mode 0600."""
    return write_secrets(tmp_path / "secrets")


@pytest.fixture
def spdk_raw(fake_spdk: FakeSpdk) -> dict[str, Any]:
    """The smallest valid `spdk` device entry, pointed at the fake server."""
    return base_raw(fake_spdk.socket_path)


@pytest.fixture
def spdk_full_raw(spdk_raw: dict[str, Any], secrets_dir: Path) -> dict[str, Any]:
    """Every optional spdk key set (PSK, timeouts, crypto key file, ublk id, export)."""
    return merge(spdk_raw, full_overrides(secrets_dir))
