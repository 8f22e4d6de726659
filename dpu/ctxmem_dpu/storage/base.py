"""The storage-backend contract: provision a flash device and hand the data path a path.

A backend turns a DeviceSpec into something the flash tier opens with O_DIRECT (a block
device node or a regular file). It does control-plane work only; bytes never pass
through it. Three backends exist:

- `local`: a block device or a (sparse) file that is already on this machine;
- `kernel`: a remote namespace through the Linux NVMe-oF initiator (`nvme connect`);
- `spdk`: a remote namespace through SPDK's bdev_nvme (on a BlueField: the SNAP/SPDK
  process on the Arm cores), optionally encrypted by SPDK's accel framework, exposed
  to Linux as a ublk or nbd block device.

`attach` is idempotent across service restarts: it looks for what an earlier run left
attached (a kernel controller, an SPDK bdev, a ublk disk) and reuses it, so a device is
never attached twice.

This module is the contract only: it never imports an implementation. Which class
serves which ``backend:`` name, and the factory, are in :mod:`.registry`; the shared
conformance suite every backend runs is tests/dpu/storage/storage_backend_suite.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType
from typing import TypeVar

from ctxmem_common.device_settings import ALIGNMENT_BYTES, DeviceSpec
from ctxmem_common.units import format_size

__all__ = ["StorageBackend", "StorageError"]


_Backend = TypeVar("_Backend", bound="StorageBackend")


class StorageError(Exception):
    """Provisioning a flash device failed.

    The message says what failed, with the device, ids and errno or exit status
    involved, and ends with what to do about it; `remedy` holds that last part alone.

    Attributes:
        what: what failed (without the remedy).
        remedy: what the operator should do.
        errno: the OS errno, when one is involved.
    """

    def __init__(self, what: str, remedy: str, *, errno: int | None = None) -> None:
        super().__init__(f"{what}. Remedy: {remedy}")
        self.what = what
        self.remedy = remedy
        self.errno = errno


class StorageBackend(ABC):
    """One provisioned flash device.

    Use as a context manager to guarantee `detach()`:

        with open_backend(spec) as dev:
            path = dev.attach()
            ...

    Leaving the `with` block detaches the device; a service that wants the device to
    stay attached across its own restart calls `close()` instead (idempotent `attach`
    picks it up again).
    """

    spec: DeviceSpec

    def __init__(self, spec: DeviceSpec) -> None:
        self.spec = spec
        self._path: str | None = None
        self._size_bytes: int | None = None

    @abstractmethod
    def attach(self, timeout_s: float = 30.0) -> str:
        """Make the device usable and return the path the data path opens with O_DIRECT.

        Idempotent: if the device is already attached (by this object, or by an earlier
        run of the service) it is found and reused, never attached twice.

        Args:
            timeout_s: upper bound for the whole call, including waiting for the device
                node to appear.

        Raises:
            StorageError: saying what failed and the remedy.
        """

    @abstractmethod
    def detach(self) -> None:
        """Undo `attach` cleanly. Idempotent: detaching a detached device does nothing.

        Raises:
            StorageError: when the device is attached but could not be detached.
        """

    def locate(self) -> str | None:
        """Where the attached device is now, without attaching anything: the path to
        reopen when its node changed under a running service (e.g. an NVMe namespace
        removed and re-added comes back as another /dev/nvmeXnY), or None when it is not
        there yet. Never connects, never raises. Default: the path ``attach`` returned."""
        return self._path

    @abstractmethod
    def is_healthy(self) -> bool:
        """Whether the attached device's path is still present and usable. Never raises."""

    @property
    def size_bytes(self) -> int:
        """Usable size in bytes (4 KiB aligned), known once attached."""
        if self._size_bytes is None:
            raise StorageError(
                f"device {self.spec.name!r}: size is unknown because it is not attached",
                "call attach() first",
            )
        return self._size_bytes

    @property
    def path(self) -> str | None:
        """The path `attach` returned, or None while detached."""
        return self._path

    @property
    def offloads_encryption(self) -> bool:
        """True when the device encrypts data itself (the service then does not)."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release host-side resources (sockets) without detaching the device."""

    def __enter__(self: _Backend) -> _Backend:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.detach()
        finally:
            self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.spec.name!r}, path={self._path!r})"

    def _usable_size(self, actual_bytes: int, what: str) -> int:
        """Cap the device's actual size by the configured one, aligned down to 4 KiB."""
        wanted = self.spec.size_bytes
        if wanted is not None and wanted > actual_bytes:
            raise StorageError(
                f"device {self.spec.name!r}: {what} holds {format_size(actual_bytes)} "
                f"({actual_bytes} bytes) but size is configured as {format_size(wanted)}",
                "lower `size` in the config, or give the device more capacity",
            )
        usable = wanted if wanted is not None else actual_bytes
        usable -= usable % ALIGNMENT_BYTES
        if usable < ALIGNMENT_BYTES:
            raise StorageError(
                f"device {self.spec.name!r}: {what} has no usable space ({actual_bytes} bytes)",
                "point the device at a non-empty block device or file",
            )
        return usable
