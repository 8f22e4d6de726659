"""Issue 13, cases 2-4: an acknowledged durable write is on flash; a device whose
superblocks are both damaged is never formatted behind the operator's back; and one set of
bytes is never opened by two services, whatever path reaches it.

Each test drives a real ``ctxmem serve`` process; the full filesystem is a real tmpfs and
the alias a real loop device (both need root, as CI has).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import ctxmem
from ctxmem_common.errors import CtxmemError
from ctxmem_common.flash_format import DATA_START, SB_BACKUP_OFFSET, SB_OFFSET
from tests.kit import keys
from tests.reliability.sentinel import BLOCK, LAYOUT, content

ROOT = os.geteuid() == 0


def read_back(endpoint: str, ks: list[bytes]) -> list[bytes | None]:
    """Each key's bytes as a fresh client gets them one by one (None: a miss)."""
    out: list[bytes | None] = []
    with ctxmem.Client(endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        for k in ks:
            buf = bytearray(BLOCK)
            out.append(bytes(buf) if ns.get([k], [buf]) == 1 else None)
    return out


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); CI runs as root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.skipif(not ROOT, reason="mounting a small tmpfs needs root (CI runs as root)")
def test_write_through_acknowledges_only_durable_blocks(
        service_factory: Callable[..., Any], tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "3M") as fs:
        svc = service_factory(write_policy="write_through", flash_path=str(fs / "flash0.img"),
                              flash_size="64MiB", flash_slab="4MiB", dram_size="64MiB",
                              dram_slab="4MiB", flash={"o_direct": False})
        ks = keys("wt", 40)  # 10 MiB of blocks onto a 3 MiB filesystem
        acked, refused = [], []
        with ctxmem.Client(svc.endpoint) as c:
            ns = c.open_namespace(LAYOUT, model_id="m")
            for k in ks:
                try:
                    ns.put([k], [content(k)])
                    acked.append(k)
                except CtxmemError as exc:
                    refused.append((k, str(exc)))
        failures = svc.stats().get("write_through_failures", 0)
        svc.restart()
        got = read_back(svc.endpoint, acked)
        lost = [i for i, (k, b) in enumerate(zip(acked, got, strict=True)) if b != content(k)]
        assert not lost, f"{len(lost)} of {len(acked)} acknowledged write-through puts lost"
        assert refused, "the filesystem never filled up: the test proves nothing"
        assert all("flash0" in msg for _, msg in refused), \
            f"a refusal does not name the device: {refused[0][1]}"
        assert failures >= len(refused), "refused write-through commits were not counted"


def _flip(path: Path, off: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, off)
        os.pwrite(fd, bytes([b[0] ^ 0x10]), off)
        os.fsync(fd)
    finally:
        os.close(fd)


def _ctxmem(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ctxmem_dpu", *args], capture_output=True,
                          text=True, timeout=120)


def test_both_superblocks_damaged_is_refused_then_repaired(
        service_factory: Callable[..., Any]) -> None:
    svc = service_factory(flash_slab="4MiB")
    ks = keys("sb", 6)
    with ctxmem.Client(svc.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        ns.put(ks, [content(k) for k in ks])
        assert ns.evict(ks) == len(ks)  # durable on flash, DRAM copies dropped
    svc.stop()
    flash = svc.flash_path
    assert flash is not None
    _flip(flash, SB_OFFSET + 20)
    _flip(flash, SB_BACKUP_OFFSET + 20)
    before = flash.read_bytes()[DATA_START:]
    with pytest.raises(RuntimeError) as err:
        svc.start()
    assert "superblock" in str(err.value) and "ctxmem check --repair" in str(err.value)
    assert flash.read_bytes()[DATA_START:] == before, "records changed by a refused start"
    r = _ctxmem("check", "--config", str(svc.config_path), "--repair")
    assert r.returncode in (0, 1), r.stdout + r.stderr
    svc.start()
    assert read_back(svc.endpoint, ks) == [content(k) for k in ks]


def _stored_service(service_factory: Callable[..., Any], tag: str) -> tuple[Any, list[bytes]]:
    svc = service_factory(flash_size="64MiB", flash_slab="4MiB")
    ks = keys(tag, 4)
    with ctxmem.Client(svc.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        ns.put(ks, [content(k) for k in ks])
        assert ns.evict(ks) == len(ks)
    return svc, ks


def test_second_service_on_a_live_device_is_refused_before_it_changes_it(
        service_factory: Callable[..., Any]) -> None:
    svc, ks = _stored_service(service_factory, "live")
    flash = svc.flash_path
    assert flash is not None
    size = flash.stat().st_size
    head = flash.read_bytes()[:DATA_START]
    with pytest.raises(RuntimeError) as err:  # same file, bigger size, create: true
        service_factory(flash_path=str(flash), flash_size="128MiB", flash_slab="4MiB")
    assert "flash0" in str(err.value) and "in use" in str(err.value)
    assert flash.stat().st_size == size, "a refused second service grew the live device"
    assert flash.read_bytes()[:DATA_START] == head
    assert read_back(svc.endpoint, ks) == [content(k) for k in ks]


def test_truncated_device_with_records_is_not_grown_back(
        service_factory: Callable[..., Any]) -> None:
    svc, _ = _stored_service(service_factory, "trunc")
    flash = svc.flash_path
    assert flash is not None
    size = flash.stat().st_size
    svc.stop()
    os.truncate(flash, size // 2)  # the device shrank while the service was down
    with pytest.raises(RuntimeError) as err:
        svc.start()
    assert "flash0" in str(err.value)
    assert flash.stat().st_size == size // 2, "a truncated device with records was grown back"


@pytest.mark.skipif(not ROOT, reason="attaching a loop device needs root (CI runs as root)")
def test_loop_device_alias_of_a_live_file_is_refused(
        service_factory: Callable[..., Any]) -> None:
    svc, ks = _stored_service(service_factory, "alias")
    flash = svc.flash_path
    assert flash is not None
    r = subprocess.run(["losetup", "-f", "--show", str(flash)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"no loop device here: {r.stderr.strip()}")
    loop = r.stdout.strip()
    try:
        head = flash.read_bytes()[:DATA_START]
        with pytest.raises(RuntimeError) as err:
            service_factory(flash_path=loop, flash_size="64MiB", flash_slab="4MiB")
        assert "in use" in str(err.value)
        assert flash.read_bytes()[:DATA_START] == head
        assert read_back(svc.endpoint, ks) == [content(k) for k in ks]
    finally:
        subprocess.run(["losetup", "-d", loop], check=False)
