"""One flash device's file and its I/O: opening it (O_DIRECT, an exclusive lock), reads,
writes and syncs through the fault-injection layer, slow-I/O accounting, and the errors
they raise.

No format knowledge lives here (that is :mod:`ctxmem_common.flash_format` and
:mod:`ctxmem_dpu.tiers.flash_device`). Every call is a plain blocking call meant for the
service's I/O threads (``os.preadv``/``os.pwritev`` release the GIL).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING

from ctxmem_common import safepaths
from ctxmem_common.config import FlashConfig
from ctxmem_common.flash_format import SECTOR, BufferPool
from ctxmem_dpu import faults
from ctxmem_dpu.tiers.flash_owner import DeviceOwner

if TYPE_CHECKING:
    from typing_extensions import Buffer, Self

log = logging.getLogger(__name__)

ZEROS = mmap.mmap(-1, 1 << 20)  # never written: a source of aligned zero bytes

# Header tables read by a warm restart (every device's scan), pooled across slabs; the
# store clears it when the restart is done.
scan_buffers = BufferPool()


class FlashIOError(OSError):
    """A device read or write failed; carries the device name and errno."""


class ShortRead(FlashIOError):
    """A read returned fewer bytes than asked: the device is shorter (truncated)."""


class Staging(threading.local):
    """Per-thread page-aligned buffers for O_DIRECT (headers, header-table runs,
    ciphertext), anonymous memory reused across calls so their pages are faulted once."""

    def __init__(self) -> None:
        self.header = mmap.mmap(-1, SECTOR)
        self.payload: mmap.mmap | None = None
        self.table: mmap.mmap | None = None

    def payload_buf(self, n: int) -> mmap.mmap:
        if self.payload is None or len(self.payload) < n:
            self.payload = mmap.mmap(-1, max(n, 1 << 20))
        return self.payload

    def table_buf(self, sectors: int) -> mmap.mmap:
        if self.table is None or len(self.table) < sectors * SECTOR:
            self.table = mmap.mmap(-1, sectors * SECTOR)
        return self.table


staging = Staging()


class DeviceFile:
    """A flash device's open file: the I/O primitives the format code builds on.

    ``lock``: take an exclusive ``flock`` on the device and claim its owner record (see
    :mod:`.flash_owner`; the flock covers one inode, the record every path to the same
    bytes), both before anything on the device is changed, so two services (or a service
    and ``ctxmem check --repair``) never write one device at once. A context manager:
    leaving it closes the file (and clears the owner record).
    """

    def __init__(self, name: str, path: str, o_direct: bool, lock: bool = True,
                 shared: bool = False) -> None:
        self.name = name
        self.path = path
        self._lock = lock
        # shared: a pod's shared device (several services write it, each only the slabs
        # it leases): a shared flock (an exclusive attach, or ctxmem check --repair, is
        # refused while any is held, and the other way round) and the pod's owner marker.
        self.shared = shared
        self._lock_op = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        # Descriptors replaced by reopen(): kept open until close(), since an I/O thread
        # may still be blocked on one, and a closed number could be reused under it.
        self._retired_fds: list[int] = []
        # O_NOFOLLOW, and check_flash_path first: a symbolic link or another user's file
        # at the flash path is refused (issue 12; ctxmem_common.safepaths).
        self._flags = (os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
                       | (os.O_DIRECT if o_direct else 0))
        # A device call slower than this (seconds) is counted in slow_ios, which the store
        # reads: flash.slow_io_s, set by the store once the device is open.
        self.slow_io_s = FlashConfig.slow_io_s
        self.slow_ios = 0
        safepaths.check_flash_path(path, name)
        try:
            self.fd = os.open(path, self._flags)
        except OSError as exc:
            hint = (
                "the filesystem does not support O_DIRECT (tmpfs?): put the file on ext4/xfs "
                "or a block device, or set flash.o_direct: false"
                if exc.errno == errno.EINVAL
                else "check that the device exists and the service may open it"
            )
            raise FlashIOError(
                exc.errno, f"flash device {name!r}: cannot open {path}: {exc.strerror}; {hint}"
            ) from None
        if lock:
            try:
                fcntl.flock(self.fd, self._lock_op | fcntl.LOCK_NB)
            except OSError:
                os.close(self.fd)
                self.fd = -1
                how = ("attached exclusively by another process (a non-shared service, or "
                       "ctxmem check --repair)" if shared else
                       "in use by another process (another ctxmem service, a pod's services "
                       "sharing it, or ctxmem check --repair)")
                raise FlashIOError(errno.EBUSY, f"flash device {name!r} ({path}) is {how}"
                                   ) from None
        self.size = os.lseek(self.fd, 0, os.SEEK_END)
        self.owner: DeviceOwner | None = None
        try:
            self._before_writes()
        except BaseException:
            os.close(self.fd)
            self.fd = -1
            raise
        if lock:
            owner = DeviceOwner(name, path, shared)
            try:
                owner.claim(self.fd, self.size)
            except BaseException:
                os.close(self.fd)
                self.fd = -1
                raise
            self.owner = owner

    def _before_writes(self) -> None:
        """Called once the file is open (and locked), before anything is written to it
        (the owner record): a subclass registers with the device here (a shared
        device's NVMe reservation key)."""

    def refresh_owner(self) -> None:
        """Extend this service's lease on the device (the store's reaper calls it);
        raises FlashIOError when another service took the device over, or on an I/O
        error."""
        if self.owner is not None and self.fd >= 0:
            self.owner.refresh(self.fd)

    def _slow(self, t0: float) -> None:
        dt = time.perf_counter() - t0
        if dt > self.slow_io_s:
            self.slow_ios += 1
            log.warning("flash device %s: one I/O took %.3f s (slow device)", self.name, dt)

    def _pwrite(self, buf: Buffer | Sequence[Buffer], offset: int) -> None:
        """One device write of ``buf`` (a buffer, or a list of buffers written in order by
        one ``pwritev``) at ``offset``."""
        bufs: Sequence[Buffer] = buf if isinstance(buf, list) else [buf]  # type: ignore[list-item]
        n_want = sum(memoryview(b).nbytes for b in bufs)
        t0 = time.perf_counter()
        try:
            if faults.active:
                faults.before_io(self.name, "write", self.fd, self.path, offset, n_want)
            n = os.pwritev(self.fd, bufs, offset)
        except OSError as exc:
            raise FlashIOError(
                exc.errno, f"flash device {self.name!r}: write at {offset} failed: {exc.strerror}"
            ) from None
        self._slow(t0)
        if n != n_want:
            raise FlashIOError(errno.EIO, f"flash device {self.name!r}: short write at {offset}")

    def _pread(self, buf: Buffer | Sequence[Buffer], offset: int) -> None:
        """One device read of ``buf`` (a buffer, or a list of buffers filled in order by
        one ``preadv``) at ``offset``."""
        bufs: Sequence[Buffer] = buf if isinstance(buf, list) else [buf]  # type: ignore[list-item]
        n_want = sum(memoryview(b).nbytes for b in bufs)
        t0 = time.perf_counter()
        try:
            if faults.active:
                faults.before_io(self.name, "read", self.fd, self.path, offset, n_want)
            n = os.preadv(self.fd, bufs, offset)
        except OSError as exc:
            raise FlashIOError(
                exc.errno, f"flash device {self.name!r}: read at {offset} failed: {exc.strerror}"
            ) from None
        self._slow(t0)
        if n != n_want:
            raise ShortRead(
                errno.EIO, f"flash device {self.name!r}: short read at {offset} (truncated?)"
            )

    def read_into(self, buf: memoryview, offset: int) -> int:
        """:meth:`_pread` as the format reader's ``read_into``: all of ``buf`` or a raise."""
        self._pread(buf, offset)
        return buf.nbytes

    def sync(self) -> None:
        """``fdatasync`` the device (through the fault layer, timed like any call)."""
        t0 = time.perf_counter()
        try:
            if faults.active:
                faults.before_io(self.name, "sync", self.fd, self.path, 0, 0)
            os.fdatasync(self.fd)
        except OSError as exc:
            raise FlashIOError(
                exc.errno, f"flash device {self.name!r}: fdatasync failed: {exc.strerror}"
            ) from None
        if faults.active:
            faults.after_sync(self.fd)
        self._slow(t0)

    def open_other(self, path: str) -> int:
        """Open (and lock, as this device is) ``path`` with this device's flags, for
        :meth:`replace_fd`; raises FlashIOError."""
        safepaths.check_flash_path(path, self.name)
        try:
            fd = os.open(path, self._flags)
        except OSError as exc:
            raise FlashIOError(exc.errno, f"flash device {self.name!r}: cannot reopen it at "
                                          f"{path}: {exc.strerror}") from None
        if self._lock:
            try:
                fcntl.flock(fd, self._lock_op | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise FlashIOError(errno.EBUSY, f"flash device {self.name!r}: {path} is "
                                                f"in use by another process") from None
        return fd

    def replace_fd(self, fd: int, path: str) -> None:
        """Do further I/O on ``fd`` (from :meth:`open_other`); the old descriptor is
        retired, not closed (see ``_retired_fds``)."""
        log.warning("flash device %s: reopened at %s (was %s)", self.name, path, self.path)
        self._retired_fds.append(self.fd)
        faults.forget_fd(self.fd)
        self.fd = fd
        self.path = path

    def close(self) -> None:
        """Clear the owner record, close the file and every retired descriptor
        (idempotent)."""
        if self.fd >= 0 and self.owner is not None:
            self.owner.release(self.fd)
        if self.fd >= 0:
            faults.forget_fd(self.fd)
            os.close(self.fd)
            self.fd = -1
        for fd in self._retired_fds:
            os.close(fd)
        self._retired_fds.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
