"""Flash-device provisioning ("storage backends"): local files/devices, the kernel
NVMe-oF initiator, and SPDK. See docs/storage.md and `base.StorageBackend`."""

from .base import (
    DeviceSpec,
    StorageBackend,
    StorageError,
    format_size,
    open_backend,
    parse_device_spec,
    parse_size,
)

__all__ = [
    "DeviceSpec",
    "StorageBackend",
    "StorageError",
    "format_size",
    "open_backend",
    "parse_device_spec",
    "parse_size",
]
