"""Issue 13 cases 3 and 4, the error paths around the lead's tests in
test_durability_guards.py: a service killed with SIGKILL takes its device back at once;
its lease is refreshed while it runs; a wrong master key never destroys records; a device
is formatted only on the operator's word (``ctxmem check --format``); ``ctxmem check
--repair`` and ``--format`` refuse a device a service has.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ctxmem
from ctxmem_common.flash_format import (
    DATA_START,
    OWNER_OFFSET,
    SB_BACKUP_OFFSET,
    SB_OFFSET,
    SECTOR,
    OwnerRecord,
)

from .test_durability_guards import LAYOUT, _ctxmem, _flip, content, keys, read_back


def _stored(service_factory: Callable[..., Any], tag: str, n: int = 4) -> tuple[Any, list[bytes]]:
    svc = service_factory(flash_size="64MiB", flash_slab="4MiB")
    ks = keys(tag, n)
    with ctxmem.Client(svc.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        ns.put(ks, [content(k) for k in ks])
        assert ns.evict(ks) == len(ks)  # durable on flash
    return svc, ks


def _owner(path: Path) -> OwnerRecord | None:
    with open(path, "rb") as f:
        f.seek(OWNER_OFFSET)
        return OwnerRecord.unpack(f.read(SECTOR))


def test_sigkill_then_immediate_restart_takes_the_device_back(
        service_factory: Callable[..., Any]) -> None:
    svc, ks = _stored(service_factory, "kill9")
    assert svc.flash_path is not None
    dead = _owner(svc.flash_path)
    assert dead is not None  # the running service's record
    svc.restart(kill=True)
    assert "taking over" in svc.log() and "its process is gone" in svc.log()
    now = _owner(svc.flash_path)
    assert now is not None and now.instance != dead.instance
    assert read_back(svc.endpoint, ks) == [content(k) for k in ks]
    svc.stop()
    assert _owner(svc.flash_path) is None  # a clean stop clears it


def test_the_lease_is_refreshed_while_the_service_runs(
        service_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTXMEM_FLASH_OWNER_LEASE_S", "1.5")
    svc = service_factory(flash_size="64MiB", flash_slab="4MiB")
    assert svc.flash_path is not None
    first = _owner(svc.flash_path)
    assert first is not None
    time.sleep(2.5)  # past the first lease: it must have been extended
    later = _owner(svc.flash_path)
    assert later is not None and later.instance == first.instance
    assert later.expires_ns > time.time_ns() and later.expires_ns > first.expires_ns


def test_wrong_master_key_serves_misses_and_destroys_nothing(
        service_factory: Callable[..., Any]) -> None:
    svc, ks = _stored(service_factory, "wrongkey", 6)
    key_file = svc.workdir / "master.key"
    right = key_file.read_text()
    svc.stop()
    key_file.write_text(secrets.token_hex(32))
    svc.start()
    assert read_back(svc.endpoint, ks) == [None] * len(ks)
    assert "another encryption key" in svc.log()
    svc.stop()
    r = _ctxmem("check", "--config", str(svc.config_path), "--repair")  # still the wrong key
    assert "key_mismatch" in r.stdout, r.stdout + r.stderr
    key_file.write_text(right)
    svc.start()
    assert read_back(svc.endpoint, ks) == [content(k) for k in ks]


def test_explicit_format_of_a_device_with_damaged_superblocks(
        service_factory: Callable[..., Any]) -> None:
    svc, ks = _stored(service_factory, "fmt")
    flash = svc.flash_path
    assert flash is not None
    r = _ctxmem("check", "--format", "--device", f"flash0={flash}", "--slab-size", "4MiB")
    assert r.returncode == 8 and "in use" in r.stderr  # the service has it
    svc.stop()
    _flip(flash, SB_OFFSET + 20)
    _flip(flash, SB_BACKUP_OFFSET + 20)
    with pytest.raises(RuntimeError, match="superblock"):
        svc.start()
    r = _ctxmem("check", "--format", "--config", str(svc.config_path))
    assert r.returncode == 8 and "--device" in r.stderr  # never the whole config by default
    r = _ctxmem("check", "--format", "--device", f"flash0={flash}", "--slab-size", "4MiB")
    assert r.returncode == 0 and "discarded" in r.stdout, r.stdout + r.stderr
    svc.start()
    assert read_back(svc.endpoint, ks) == [None] * len(ks)  # formatted: empty


def test_repair_is_refused_while_a_service_has_the_device(
        service_factory: Callable[..., Any]) -> None:
    svc, ks = _stored(service_factory, "busy")
    r = _ctxmem("check", "--config", str(svc.config_path), "--repair")
    assert r.returncode == 8 and "in use" in r.stderr, r.stdout + r.stderr
    assert read_back(svc.endpoint, ks) == [content(k) for k in ks]


def test_a_blank_device_is_still_formatted_at_start(
        service_factory: Callable[..., Any], tmp_path: Path) -> None:
    blank = tmp_path / "blank.img"
    with open(blank, "wb") as f:
        f.truncate(DATA_START + (16 << 20))
    svc = service_factory(flash_path=str(blank), flash_size="17MiB",
                          flash_slab="4MiB")
    assert "formatted flash device flash0" in svc.log()
