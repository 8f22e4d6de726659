"""`local` backend: a block device or a regular file already on this machine."""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from ctxmem_common import safepaths
from ctxmem_common.device_settings import DeviceSpec
from ctxmem_common.flash_format import FlashReader
from ctxmem_common.units import format_size
from ctxmem_dpu.tiers.flash_owner import describe, stale_reason

from .base import StorageBackend, StorageError
from .devices import probe_o_direct

__all__ = ["LocalBackend"]


class LocalBackend(StorageBackend):
    """A block device (e.g. /dev/nvme0n1) or a regular file used as flash.

    With `create: true` a missing file is created sparse with the configured size, and an
    existing smaller *blank* file is grown (never shrunk). A file that holds records (a
    superblock or a slab header) is never grown: that is resizing, an operator action
    (docs/storage.md), and a file smaller than configured is what a truncated device
    looks like. The growth happens under the device's lock, after its owner record says
    no service has it. Detaching never deletes the file: it holds the blocks that must
    survive a restart.

    The path goes through :mod:`ctxmem_common.safepaths`: a symbolic link or another
    user's file is refused, a missing directory is created 0700 and an existing one
    another user owns or can write is refused, and files are opened ``O_NOFOLLOW``.
    """

    def __init__(self, spec: DeviceSpec) -> None:
        if spec.backend != "local" or spec.path is None:
            raise ValueError(f"device {spec.name!r}: LocalBackend needs a local spec with a path")
        super().__init__(spec)
        self._file_path = os.path.abspath(spec.path)

    def attach(self, timeout_s: float = 30.0) -> str:
        # docstring inherited
        path = self._file_path
        safepaths.check_flash_path(path, self.spec.name)  # no link, not another user's file
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = self._create_missing(path)
        except OSError as ex:
            raise StorageError(
                f"device {self.spec.name!r}: cannot stat {path}: [errno {ex.errno}] "
                f"{ex.strerror}", f"check that {path} and its parent directories are "
                "accessible to the service user", errno=ex.errno,
            ) from ex
        if stat.S_ISREG(st.st_mode):
            self._grow_if_asked(path, st.st_size)
            what = f"file {path}"
        elif stat.S_ISBLK(st.st_mode):
            what = f"block device {path}"
        else:
            raise StorageError(
                f"device {self.spec.name!r}: {path} is neither a block device nor a regular "
                f"file (mode {stat.filemode(st.st_mode)})",
                "point `path` at a block device (e.g. /dev/nvme0n1) or a file",
            )
        actual = probe_o_direct(path, self.spec.name)
        self._size_bytes = self._usable_size(actual, what)
        self._path = path
        return path

    def detach(self) -> None:
        # docstring inherited
        self._path = None
        self._size_bytes = None

    def is_healthy(self) -> bool:
        # docstring inherited
        if self._path is None or self._size_bytes is None:
            return False
        try:
            st = os.stat(self._path)
        except OSError:
            return False
        if stat.S_ISREG(st.st_mode):
            return st.st_size >= self._size_bytes and os.access(self._path, os.R_OK | os.W_OK)
        return stat.S_ISBLK(st.st_mode) and os.access(self._path, os.R_OK | os.W_OK)

    def _create_missing(self, path: str) -> os.stat_result:
        size = self.spec.size_bytes
        if not self.spec.create or size is None:
            raise StorageError(
                f"device {self.spec.name!r}: {path} does not exist",
                f"create it (e.g. `truncate -s 8G {path}` on ext4/xfs, or point `path` at a "
                "block device), or set `create: true` and `size` to let ctxmem create a "
                "sparse file",
                errno=errno.ENOENT,
            )
        parent = os.path.dirname(path)
        try:
            # Created 0700 if absent; refused if another user owns it or can write it
            # (they could swap the file for a link to one of root's between our calls).
            safepaths.ensure_dir(parent, what=f"flash device {self.spec.name!r}: directory")
        except OSError as ex:
            raise StorageError(
                f"device {self.spec.name!r}: cannot create directory {parent} for {path}: "
                f"[errno {ex.errno}] {ex.strerror}",
                f"create it (install -d -m 0700 {parent}) as the service's user",
                errno=ex.errno,
            ) from ex
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                         | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            safepaths.check_flash_path(path, self.spec.name)  # created concurrently: check it
            return os.lstat(path)
        except OSError as ex:
            raise StorageError(
                f"device {self.spec.name!r}: cannot create {path}: [errno {ex.errno}] "
                f"{ex.strerror}", f"check that the service user may write to {parent}",
                errno=ex.errno,
            ) from ex
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
            return os.fstat(fd)
        except OSError as ex:
            os.unlink(path)
            raise StorageError(
                f"device {self.spec.name!r}: cannot size new file {path} to "
                f"{format_size(size)}: [errno {ex.errno}] {ex.strerror}",
                "check free space and the filesystem's maximum file size",
                errno=ex.errno,
            ) from ex
        finally:
            os.close(fd)

    def _grow_if_asked(self, path: str, current: int) -> None:
        size = self.spec.size_bytes
        if size is None or current >= size or not self.spec.create:
            return  # a too-small file without create: true is reported by _usable_size
        name = self.spec.name
        try:
            fd = safepaths.open_nofollow(path, os.O_RDWR | os.O_CLOEXEC,
                                         f"flash device {name!r}:")
        except OSError as ex:
            raise StorageError(
                f"device {name!r}: cannot open {path} to grow it: [errno {ex.errno}] "
                f"{ex.strerror}", "check that the service user may write it",
                errno=ex.errno) from ex
        try:
            self._refuse_growing(fd, path, current, size)
            os.ftruncate(fd, size)
        except OSError as ex:
            raise StorageError(
                f"device {name!r}: cannot grow {path} from {format_size(current)} "
                f"to {format_size(size)}: [errno {ex.errno}] {ex.strerror}",
                "check free space and permissions, or lower `size`",
                errno=ex.errno,
            ) from ex
        finally:
            os.close(fd)  # drops the lock: the flash tier takes it again to open the file

    def _refuse_growing(self, fd: int, path: str, current: int, size: int) -> None:
        """Lock ``fd`` and raise StorageError unless the file may be grown: no service
        holds it (its lock, or a live owner record: a loop device over the file) and it
        holds no records."""
        name = self.spec.name
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as ex:
            raise StorageError(
                f"flash device {name!r} ({path}) is in use by another process (a ctxmem "
                f"service, or ctxmem check --repair); not growing it to {format_size(size)}",
                "stop the other service first, or point this one at another device",
                errno=errno.EBUSY) from ex
        reader = FlashReader(fd)
        owner = reader.owner() if current >= 1 << 20 else None
        if owner is not None and not stale_reason(owner, reader.owner):
            raise StorageError(
                f"flash device {name!r} ({path}) is in use by {describe(owner)}; not "
                f"growing it", "stop that service first", errno=errno.EBUSY)
        formatted = current >= 2 * 4096 and reader.superblocks().current is not None
        if formatted or reader.find_slab_headers(current):
            raise StorageError(
                f"flash device {name!r}: {path} holds {format_size(current)} of ctxmem "
                f"records but `size` is {format_size(size)}; a file that holds records is "
                f"never grown (it may have been truncated, and growing it would hide that)",
                "if the file was truncated, restore it from where it was cut; to resize "
                "a device on purpose, see docs/storage.md (resizing); or set `size` to "
                f"{format_size(current)}", errno=errno.EEXIST)
