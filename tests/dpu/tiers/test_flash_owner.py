"""The owner record (issue 13 case 4): a device's exclusive use is written on the device,
so every path to the same bytes sees it; stale records (dead process, earlier boot,
expired lease) are taken over, live ones refuse the open before anything changes."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ctxmem_common.flash_format import DATA_START, OWNER_OFFSET, SECTOR, OwnerRecord
from ctxmem_dpu.tiers.flash_io import DeviceFile, FlashIOError
from ctxmem_dpu.tiers.flash_owner import DeviceOwner, boot_id, process_start


def _device(tmp_path: Path) -> Path:
    path = tmp_path / "flash0.img"
    with open(path, "wb") as f:
        f.truncate(DATA_START + (4 << 20))
    return path


def _owner_on_disk(path: Path) -> OwnerRecord | None:
    with open(path, "rb") as f:
        f.seek(OWNER_OFFSET)
        return OwnerRecord.unpack(f.read(SECTOR))


def _plant(path: Path, **fields: object) -> OwnerRecord:
    """Write an owner record as another service would have (defaults: alive, this host)."""
    rec = OwnerRecord(**{  # type: ignore[arg-type]
        "instance": uuid.uuid4().bytes, "pid": os.getpid(),
        "start_ticks": process_start(os.getpid()) or 0,
        "expires_ns": time.time_ns() + 60 * 10**9, "boot_id": boot_id(),
        "host": socket.gethostname(), **fields})
    with open(path, "r+b") as f:
        f.seek(OWNER_OFFSET)
        f.write(rec.pack())
    return rec


def _other_process() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_open_writes_the_owner_record_and_a_clean_close_clears_it(tmp_path: Path) -> None:
    path = _device(tmp_path)
    with DeviceFile("flash0", str(path), o_direct=False) as dev:
        rec = _owner_on_disk(path)
        assert rec is not None and rec.pid == os.getpid() and rec.host == socket.gethostname()
        assert rec.boot_id == boot_id() and rec.expires_ns > time.time_ns()
        assert dev.owner is not None and rec.instance == dev.owner.instance
        before = rec.expires_ns
        time.sleep(0.01)
        dev.refresh_owner()
        again = _owner_on_disk(path)
        assert again is not None and again.expires_ns > before
    assert _owner_on_disk(path) is None


def test_a_live_service_elsewhere_refuses_the_open(tmp_path: Path) -> None:
    path = _device(tmp_path)
    other = _other_process()
    try:
        start = process_start(other.pid)
        assert start is not None
        _plant(path, pid=other.pid, start_ticks=start)
        head = path.read_bytes()[:DATA_START]
        with pytest.raises(FlashIOError) as err:
            DeviceFile("flash0", str(path), o_direct=False)
        assert err.value.errno == errno.EBUSY
        msg = str(err.value)
        assert "flash0" in msg and "in use" in msg and f"pid {other.pid}" in msg
        assert "stop it first" in msg
        assert path.read_bytes()[:DATA_START] == head  # nothing written
    finally:
        other.kill()
        other.wait()


def test_a_record_of_a_killed_process_is_taken_over(tmp_path: Path) -> None:
    path = _device(tmp_path)
    other = _other_process()
    start = process_start(other.pid)
    _plant(path, pid=other.pid, start_ticks=start)
    other.kill()  # kill -9 ...
    time.sleep(0.1)
    assert process_start(other.pid) is None  # ... not reaped yet: a zombie counts as gone
    with DeviceFile("flash0", str(path), o_direct=False) as dev:
        rec = _owner_on_disk(path)
        assert dev.owner is not None and rec is not None and rec.instance == dev.owner.instance
    other.wait()
    _plant(path, pid=other.pid, start_ticks=start)  # reaped: the pid is gone
    DeviceFile("flash0", str(path), o_direct=False).close()


def test_a_reused_pid_does_not_keep_a_dead_owner_alive(tmp_path: Path) -> None:
    path = _device(tmp_path)
    start = process_start(os.getppid()) or 0
    _plant(path, pid=os.getppid(), start_ticks=start + 12345)  # same pid, other process
    DeviceFile("flash0", str(path), o_direct=False).close()


def test_another_host_is_honoured_until_its_lease_expires(tmp_path: Path) -> None:
    path = _device(tmp_path)
    _plant(path, host="other-host", pid=1, boot_id=uuid.uuid4().bytes)
    with pytest.raises(FlashIOError, match=r"in use by service .* on host other-host"):
        DeviceFile("flash0", str(path), o_direct=False)
    _plant(path, host="other-host", pid=1, boot_id=uuid.uuid4().bytes,
           expires_ns=time.time_ns() - 1)
    DeviceFile("flash0", str(path), o_direct=False).close()


def test_a_record_from_an_earlier_boot_is_taken_over(tmp_path: Path) -> None:
    path = _device(tmp_path)
    _plant(path, pid=1, start_ticks=process_start(1) or 0, boot_id=uuid.uuid4().bytes)
    DeviceFile("flash0", str(path), o_direct=False).close()


def test_an_alias_opened_in_the_same_process_is_refused(tmp_path: Path) -> None:
    path = _device(tmp_path)
    with DeviceFile("flash0", str(path), o_direct=False):
        fd = os.open(path, os.O_RDWR)  # another path to the bytes: no flock conflict
        try:
            with pytest.raises(FlashIOError, match="in use"):
                DeviceOwner("alias", str(path)).claim(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)


def test_refresh_after_a_takeover_says_so(tmp_path: Path) -> None:
    path = _device(tmp_path)
    with DeviceFile("flash0", str(path), o_direct=False) as dev:
        _plant(path, host="other-host")
        with pytest.raises(FlashIOError, match="taken over by service") as err:
            dev.refresh_owner()
        assert err.value.errno == errno.EBUSY
    assert _owner_on_disk(path) is not None  # the other's record is left alone


def test_a_device_too_small_for_the_owner_sector_is_not_written(tmp_path: Path) -> None:
    path = tmp_path / "tiny.img"
    path.write_bytes(bytes(8192))
    DeviceFile("flash0", str(path), o_direct=False).close()
    assert path.stat().st_size == 8192

