"""The owner record: which service has a flash device open, written on the device itself.

An ``flock`` only covers one inode: a loop device over a file, or two device nodes for
one namespace, are other inodes over the same bytes, and two services on them both
"hold the lock" and destroy each other's records. So a service also writes an owner
record into the device's owner sector (``OWNER_OFFSET``): its instance, pid and process
start time, host name, boot id and a lease expiry (wall clock). It is read and written
at open (before anything else on the device is changed), refreshed while the service
runs (the store's reaper, every :data:`LEASE_S` / 3) and cleared on a clean close.

A record found at open belongs to a live service (the open is refused) unless it is
stale. Liveness is decided by what can be checked, never by a wall clock: a record
written on this host is stale when it was written in an earlier boot, or in this boot by
a process that is gone (pid not running, a zombie, or a pid reused by another process:
its start time differs), and live while that process runs (however its lease expiry,
a wall-clock time kept for messages only, compares with this host's clock). A record
whose process cannot be checked (another host; or the pod's shared marker, refreshed by
several services) is live while its *heartbeat* advances: every refresh writes a counter
one higher (the ``CTXOWNRB`` extension). A taker watches the owner sector for a full
:data:`LEASE_S` measured on its own monotonic clock and takes the device only if the
record did not change meanwhile. So a service killed with SIGKILL and restarted at once
takes its device back, a record from another host is honoured while that host's service
refreshes it, and a clock that runs ahead (or a clock jump) never takes a live owner's
device.

A *shared* device (``flash.devices[].shared``: the pod's flash enclosure, attached by
several services) has no single owner: each service writes only the slabs it leases
(:mod:`ctxmem_dpu.tiers.flash_fence`). Its owner sector holds the *shared marker* (the
instance ``SHARED_INSTANCE``), written at attach and refreshed by every attached service
(the last refresh names its host and pid, for messages), never cleared by a close (others
may still be attached): it lapses one lease after the last service stops refreshing it
(its heartbeat stops advancing).
A non-shared open that finds a live marker is refused, and a shared open that finds a
live non-shared owner is refused, so a device is either one service's or the pod's.

The record is read and written straight on the descriptor, not through the fault layer
(like the superblock at open: owning a device is not an I/O path faults are injected
into).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable

from ctxmem_common.flash_format import DATA_START, OWNER_OFFSET, SECTOR, OwnerRecord
from ctxmem_common.flash_format.reader import aligned_buffer

log = logging.getLogger(__name__)

# How long an owner record is honoured without a refresh (seconds). Only a record from
# another host (or one whose process cannot be checked) waits for it; tests lower it with
# CTXMEM_FLASH_OWNER_LEASE_S.
LEASE_S = float(os.environ.get("CTXMEM_FLASH_OWNER_LEASE_S", "30"))

# Test hook: shift this process's wall clock (the owner record's informational expiry) by
# this many seconds. Liveness never reads the wall clock, so a shifted process takes no
# live owner's device (tests/dpu/tiers/test_flash_owner.py).
_CLOCK_SHIFT_NS = int(float(os.environ.get("CTXMEM_TEST_CLOCK_SHIFT_S", "0")) * 1e9)


def wall_ns() -> int:
    """The wall clock as this module writes it into owner records (for messages only)."""
    return time.time_ns() + _CLOCK_SHIFT_NS


# Owner records this process holds (by instance): a record naming this pid is live only
# if it is one of these (a device reopened through an alias in the same process).
_held: set[bytes] = set()
# How many shared devices this process has attached (their marker names this pid).
_shared_held = [0]

# The owner record's instance on a device attached as shared by a pod's services.
SHARED_INSTANCE = b"\xff" * 16


def boot_id() -> bytes:
    """This boot's id (``/proc/sys/kernel/random/boot_id``) as 16 bytes; zeros if none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return uuid.UUID(f.read().strip()).bytes
    except (OSError, ValueError):
        return bytes(16)


def process_start(pid: int) -> int | None:
    """``pid``'s start time (clock ticks since boot), or ``None`` when no such process
    runs (gone, or a zombie: a killed service its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()  # after "pid (comm) "
    if not fields or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])  # field 22 of the whole line


def describe(rec: OwnerRecord) -> str:
    """``service <id> (pid N on host H, lease until T)`` for messages."""
    until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec.expires_ns / 1e9))
    if rec.instance == SHARED_INSTANCE:
        return (f"the services of a pod as a shared device (last refreshed by pid {rec.pid} "
                f"on host {rec.host}, lease until {until})")
    return (f"service {rec.instance.hex()[:12]} (pid {rec.pid} on host {rec.host}, "
            f"lease until {until})")


def stale_reason(rec: OwnerRecord, read: Callable[[], OwnerRecord | None] | None = None
                 ) -> str:
    """Why ``rec`` no longer names a live owner (``""``: it does). Its process is checked
    first (same host); a record whose process cannot be checked is watched through
    ``read`` (which reads the owner sector again) for :data:`LEASE_S` on this process's
    monotonic clock: stale only if its heartbeat did not advance. Without ``read`` such a
    record counts as live. The wall-clock expiry is never consulted."""
    if rec.instance in _held:
        return ""
    if rec.instance == SHARED_INSTANCE and rec.pid == os.getpid() and _shared_held[0]:
        return ""  # this process has a shared device attached: it refreshes the marker
    if rec.host == socket.gethostname() and rec.instance != SHARED_INSTANCE:
        if rec.boot_id != boot_id():
            return "it was written before this host rebooted"
        if rec.pid == os.getpid():
            return "its instance in this process is closed"
        if process_start(rec.pid) == rec.start_ticks:
            return ""  # its process runs: live, whatever any clock says
        return "its process is gone"
    # Another host, or the pod's marker (several services refresh it; its last refresher
    # may have detached and live on): only its heartbeat tells.
    if read is None:
        return ""
    return watch_heartbeat(rec, read, LEASE_S)


def watch_heartbeat(rec: OwnerRecord, read: Callable[[], OwnerRecord | None],
                    period_s: float) -> str:
    """Watch the owner sector for ``period_s`` (monotonic): ``""`` as soon as it changes
    (its owner refreshed it: live), else why it is stale."""
    t0 = time.monotonic()
    step = max(0.01, min(0.25, period_s / 10))
    while time.monotonic() - t0 < period_s:
        time.sleep(step)
        if read() != rec:
            return ""
    return (f"its heartbeat (counter {rec.beat}) did not advance for {period_s:g} s "
            f"(watched on this host's monotonic clock)")


class DeviceOwner:
    """This process's claim on one device's owner sector (see the module docstring)."""

    def __init__(self, name: str, path: str, shared: bool = False) -> None:
        self.name = name
        self.path = path
        self.shared = shared
        self.instance = SHARED_INSTANCE if shared else uuid.uuid4().bytes
        self.held = False
        self.beat = 0
        self._buf = aligned_buffer(SECTOR)

    def _record(self, seen: OwnerRecord | None) -> OwnerRecord:
        # The heartbeat: one above what the sector held (several services refresh the
        # pod's marker) and above this process's last.
        self.beat = max(self.beat, seen.beat if seen is not None else 0) + 1
        return OwnerRecord(self.instance, os.getpid(), process_start(os.getpid()) or 0,
                           wall_ns() + int(LEASE_S * 1e9), boot_id(),
                           socket.gethostname(), self.beat)

    def _read(self, fd: int) -> OwnerRecord | None:
        view = memoryview(self._buf)
        try:
            n = os.preadv(fd, [view], OWNER_OFFSET)
        finally:
            view.release()
        return OwnerRecord.unpack(memoryview(self._buf)) if n == SECTOR else None

    def _write(self, fd: int, raw: bytes) -> None:
        self._buf[:] = raw
        os.pwritev(fd, [self._buf], OWNER_OFFSET)
        os.fdatasync(fd)

    def claim(self, fd: int, size: int) -> None:
        """Take the device: refuse it (FlashIOError EBUSY) when the owner sector names a
        live service, else write this process's record. A device too small to hold the
        owner sector is left alone (the format check refuses it)."""
        from ctxmem_dpu.tiers.flash_io import FlashIOError

        if size < DATA_START:
            return
        try:
            rec = self._read(fd)
            if rec is not None and rec.instance != self.instance:
                why = stale_reason(rec, lambda: self._read(fd))
                if not why and rec.instance == SHARED_INSTANCE:
                    raise FlashIOError(
                        errno.EBUSY, f"flash device {self.name!r} ({self.path}) is attached "
                        f"by {describe(rec)}; attach it with flash.devices[].shared: true "
                        f"(and the pod's slab leases), or stop those services first")
                if not why:
                    raise FlashIOError(
                        errno.EBUSY, f"flash device {self.name!r} ({self.path}) is in use by "
                        f"{describe(rec)}; stop it first (the same bytes may be reached by "
                        f"another path, e.g. a loop device over a file)")
                log.warning("flash device %s: taking over from %s: %s", self.name,
                            describe(rec), why)
            self._write(fd, self._record(rec).pack())
        except OSError as exc:
            if isinstance(exc, FlashIOError):
                raise
            raise FlashIOError(exc.errno, f"flash device {self.name!r} ({self.path}): "
                                          f"cannot read or write its owner record: "
                                          f"{exc.strerror}") from None
        self.held = True
        if not self.shared:
            _held.add(self.instance)
        else:
            _shared_held[0] += 1

    def refresh(self, fd: int) -> None:
        """Extend the lease. Raises FlashIOError (EBUSY) when another service has taken
        the device over meanwhile (this one's lease ran out), or the write fails."""
        from ctxmem_dpu.tiers.flash_io import FlashIOError

        if not self.held or os.lseek(fd, 0, os.SEEK_END) < DATA_START:
            return  # (a truncated device is not written beyond its end)
        try:
            rec = self._read(fd)
            if rec is not None and rec.instance != self.instance and (
                    not self.shared or not stale_reason(rec)):
                raise FlashIOError(errno.EBUSY, f"flash device {self.name!r} ({self.path}) "
                                                f"was taken over by {describe(rec)}")
            self._write(fd, self._record(rec).pack())
        except OSError as exc:
            if isinstance(exc, FlashIOError):
                raise
            raise FlashIOError(exc.errno, f"flash device {self.name!r}: refreshing its "
                                          f"owner record failed: {exc.strerror}") from None

    def release(self, fd: int) -> None:
        """Clear the owner sector (a clean close), if it still names this process."""
        if not self.held:
            return
        self.held = False
        if self.shared:
            _shared_held[0] -= 1
            return  # the pod's marker: other services may still be attached (it lapses)
        _held.discard(self.instance)
        try:
            rec = self._read(fd)
            if rec is not None and rec.instance == self.instance:
                self._write(fd, bytes(SECTOR))
        except OSError as exc:
            log.warning("flash device %s: clearing its owner record failed: %s", self.name,
                        exc)
