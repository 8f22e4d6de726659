"""The owner record (issue 13 case 4, issue 26 item 2): a device's exclusive use is
written on the device, so every path to the same bytes sees it; stale records (dead
process, earlier boot, a heartbeat that stopped for a whole lease) are taken over, live
ones refuse the open before anything changes, whatever any wall clock says."""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from ctxmem_common.flash_format import DATA_START, OWNER_OFFSET, SECTOR, OwnerRecord
from ctxmem_dpu.tiers import flash_owner
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


def _taken_over(path: Path, planted: OwnerRecord, caplog: pytest.LogCaptureFixture,
                why: str) -> None:
    """Open ``path`` while ``planted`` is its record: the open takes the device over
    (logging ``why``) and writes its own record."""
    with caplog.at_level("WARNING"), DeviceFile("flash0", str(path), o_direct=False) as dev:
        rec = _owner_on_disk(path)
        assert dev.owner is not None and rec is not None
        assert rec.instance == dev.owner.instance != planted.instance
        assert rec.pid == os.getpid() and rec.beat >= 1
    assert "taking over" in caplog.text and why in caplog.text, caplog.text
    assert _owner_on_disk(path) is None


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


def test_a_record_of_a_killed_process_is_taken_over(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
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
    planted = _plant(path, pid=other.pid, start_ticks=start)  # reaped: the pid is gone
    _taken_over(path, planted, caplog, "its process is gone")


def test_a_reused_pid_does_not_keep_a_dead_owner_alive(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _device(tmp_path)
    start = process_start(os.getppid()) or 0
    planted = _plant(path, pid=os.getppid(), start_ticks=start + 12345)  # other process
    _taken_over(path, planted, caplog, "its process is gone")


def _beating(path: Path, rec: OwnerRecord, stop: threading.Event) -> None:
    """Another host's live service: advance the record's heartbeat every 50 ms."""
    beat = rec.beat
    while not stop.wait(0.05):
        beat += 1
        with open(path, "r+b") as f:
            f.seek(OWNER_OFFSET)
            f.write(dataclasses.replace(rec, beat=beat).pack())


def test_another_host_is_honoured_while_its_heartbeat_advances(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Another host's record whose wall-clock lease has long expired (by this host's
    clock) is honoured while its heartbeat advances; once it stops, it is taken over only
    after a whole lease of watching on this process's monotonic clock."""
    monkeypatch.setattr(flash_owner, "LEASE_S", 0.5)
    path = _device(tmp_path)
    rec = _plant(path, host="other-host", pid=1, boot_id=uuid.uuid4().bytes,
                 expires_ns=time.time_ns() - 3600 * 10**9)
    stop = threading.Event()
    beater = threading.Thread(target=_beating, args=(path, rec, stop))
    beater.start()
    try:
        with pytest.raises(FlashIOError, match=r"in use by service .* on host other-host"):
            DeviceFile("flash0", str(path), o_direct=False)
    finally:
        stop.set()
        beater.join()
    last = _owner_on_disk(path)
    assert last is not None and last.beat > rec.beat  # it did beat meanwhile
    t0 = time.monotonic()
    _taken_over(path, last, caplog, "did not advance for 0.5 s")
    assert time.monotonic() - t0 >= 0.5


def test_a_clock_ahead_never_takes_a_live_owners_device(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26: a second service whose clock reads far ahead (a clock jump, a skewed
    host clock) over another path to the bytes (a loop device over the same file) does
    not take the device of a live owner: its pid and start time are checked first."""
    path = _device(tmp_path)
    owner = subprocess.Popen(
        [sys.executable, "-c",
         "import os, sys, time\n"
         "from ctxmem_dpu.tiers.flash_owner import DeviceOwner\n"
         "fd = os.open(sys.argv[1], os.O_RDWR)\n"
         "DeviceOwner('flash0', sys.argv[1]).claim(fd, os.fstat(fd).st_size)\n"
         "print('ready', flush=True)\n"
         "time.sleep(60)\n", str(path)],
        stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == b"ready"
        rec = _owner_on_disk(path)
        assert rec is not None and rec.pid == owner.pid
        real = time.time_ns
        monkeypatch.setattr(time, "time_ns", lambda: real() + 3600 * 10**9)  # an hour ahead
        fd = os.open(path, os.O_RDWR)  # another path: no flock conflict
        try:
            with pytest.raises(FlashIOError, match="in use") as err:
                DeviceOwner("alias", str(path)).claim(fd, os.fstat(fd).st_size)
            assert err.value.errno == errno.EBUSY
        finally:
            os.close(fd)
        assert _owner_on_disk(path) == rec  # nothing written
    finally:
        owner.kill()
        owner.wait()


def test_a_record_from_an_earlier_boot_is_taken_over(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _device(tmp_path)
    planted = _plant(path, pid=1, start_ticks=process_start(1) or 0,
                     boot_id=uuid.uuid4().bytes)
    _taken_over(path, planted, caplog, "before this host rebooted")


def test_an_alias_opened_in_the_same_process_is_refused(tmp_path: Path) -> None:
    path = _device(tmp_path)
    with DeviceFile("flash0", str(path), o_direct=False) as dev:
        assert dev.owner is not None
        ours = _owner_on_disk(path)
        assert ours is not None and ours.instance == dev.owner.instance
        fd = os.open(path, os.O_RDWR)  # another path to the bytes: no flock conflict
        try:
            with pytest.raises(FlashIOError, match="in use") as err:
                DeviceOwner("alias", str(path)).claim(fd, os.fstat(fd).st_size)
            assert err.value.errno == errno.EBUSY
            assert f"pid {os.getpid()}" in str(err.value), str(err.value)
        finally:
            os.close(fd)
        assert _owner_on_disk(path) == ours  # the refused claim wrote nothing
    assert _owner_on_disk(path) is None  # and the first owner's close still clears it


def test_refresh_after_a_takeover_says_so(tmp_path: Path) -> None:
    path = _device(tmp_path)
    with DeviceFile("flash0", str(path), o_direct=False) as dev:
        planted = _plant(path, host="other-host")
        with pytest.raises(FlashIOError, match="taken over by service") as err:
            dev.refresh_owner()
        assert err.value.errno == errno.EBUSY
    assert _owner_on_disk(path) == planted  # the other's record is left alone, even by close


def test_a_device_too_small_for_the_owner_sector_is_not_written(tmp_path: Path) -> None:
    """Opened and closed, a device smaller than the format's header area keeps every
    byte (a pattern, so a record or a clearing sector written anywhere shows)."""
    path = tmp_path / "tiny.img"
    before = bytes(range(256)) * 32
    path.write_bytes(before)
    with DeviceFile("flash0", str(path), o_direct=False) as dev:
        assert dev.size == len(before)
        assert path.read_bytes() == before, "the open wrote into a too-small device"
    assert path.read_bytes() == before, "the close wrote into a too-small device"

