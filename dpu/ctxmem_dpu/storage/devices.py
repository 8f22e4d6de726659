"""Host-side helpers shared by the backends: O_DIRECT probing and bounded waiting."""

from __future__ import annotations

import errno
import mmap
import os
import stat
import time
from collections.abc import Callable
from typing import TypeVar

from ctxmem_common.device_settings import ALIGNMENT_BYTES

from .base import StorageError

__all__ = ["Deadline", "probe_o_direct", "wait_for"]

_T = TypeVar("_T")


class Deadline:
    """A point in monotonic time that several steps of one call share."""

    def __init__(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._end = time.monotonic() + timeout_s

    def remaining(self, minimum: float = 0.0) -> float:
        return max(minimum, self._end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self._end


def wait_for(probe: Callable[[], _T | None], deadline: Deadline, *,
             interval_s: float = 0.05) -> _T | None:
    """Call `probe` until it returns something other than None, or the deadline passes.

    Returns the probe's last result (None on timeout); never sleeps past the deadline.
    """
    while True:
        result = probe()
        if result is not None or deadline.expired():
            return result
        time.sleep(min(interval_s, deadline.remaining()))


def probe_o_direct(path: str, device_name: str) -> int:
    """Open `path` with O_DIRECT, read its first 4 KiB, and return its size in bytes.

    This is exactly what the flash tier will do, so a failure here is reported at
    attach time with a remedy rather than on the first demotion.

    Raises:
        StorageError: if the path cannot be opened for O_DIRECT read/write, or the
            aligned read fails.
    """
    # O_NOFOLLOW: the local backend has refused a link already (safepaths); this keeps a
    # link swapped in since from being followed.
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags)
    except OSError as ex:
        raise _open_error(path, device_name, ex) from ex
    try:
        st = os.fstat(fd)
        size = os.lseek(fd, 0, os.SEEK_END)
        if size >= ALIGNMENT_BYTES:
            buf = mmap.mmap(-1, ALIGNMENT_BYTES)  # page aligned, as O_DIRECT requires
            try:
                os.preadv(fd, [buf], 0)
            except OSError as ex:
                kind = "block device" if stat.S_ISBLK(st.st_mode) else "file"
                raise StorageError(
                    f"device {device_name!r}: aligned 4 KiB O_DIRECT read of {kind} {path} "
                    f"failed: [errno {ex.errno}] {ex.strerror}",
                    "check the device's logical block size is at most 4096 "
                    "(cat /sys/block/DEV/queue/logical_block_size) and that the device is "
                    "readable (dmesg for I/O errors)",
                    errno=ex.errno,
                ) from ex
            finally:
                buf.close()
        return size
    finally:
        os.close(fd)


def _open_error(path: str, device_name: str, ex: OSError) -> StorageError:
    what = f"device {device_name!r}: cannot open {path} with O_DIRECT: [errno {ex.errno}] " \
           f"{ex.strerror}"
    if ex.errno == errno.EINVAL:
        return StorageError(
            what + " (the filesystem does not support O_DIRECT, e.g. tmpfs or some FUSE "
            "and network filesystems)",
            "put the file on ext4 or xfs, or use a block device",
            errno=ex.errno,
        )
    if ex.errno in (errno.EACCES, errno.EPERM):
        return StorageError(
            what, f"give the service user read/write access to {path} (e.g. add it to the "
            "'disk' group for block devices) or run the service as root",
            errno=ex.errno,
        )
    if ex.errno == errno.EROFS:
        return StorageError(what, "the filesystem or device is read-only; remount it "
                            "read-write or choose a writable path", errno=ex.errno)
    if ex.errno == errno.ENOENT:
        return StorageError(what, f"check that {path} exists", errno=ex.errno)
    if ex.errno == errno.EBUSY:
        return StorageError(what, f"{path} is held exclusively by another user (a mounted "
                            "filesystem, md/LVM, or another process); release it first",
                            errno=ex.errno)
    return StorageError(what, f"check that {path} is a usable block device or file",
                        errno=ex.errno)
