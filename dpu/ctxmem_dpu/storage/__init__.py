"""Flash-device provisioning ("storage backends"): local files/devices, the kernel
NVMe-oF initiator, and SPDK. See docs/storage.md.

- :mod:`.base`: the contract (:class:`StorageBackend`, :class:`StorageError`);
- :mod:`.registry`: backend name -> class, and the :func:`open_backend` factory;
- the typed device settings (:class:`DeviceSpec` and its options, :func:`parse_device_spec`)
  live in :mod:`ctxmem_common.device_settings`, validated when the config loads; they are
  re-exported here for the backends' callers;
- :mod:`.local`, :mod:`.kernel`, :mod:`.spdk`: the backends.
"""

from ctxmem_common.device_settings import (
    ALIGNMENT_BYTES,
    BackendKind,
    CryptoOptions,
    DeviceSpec,
    ExportOptions,
    KernelOptions,
    SpdkOptions,
    parse_device_spec,
)
from ctxmem_common.units import format_size, parse_size

from .base import StorageBackend, StorageError
from .registry import backend_class, open_backend

__all__ = [
    "ALIGNMENT_BYTES",
    "BackendKind",
    "CryptoOptions",
    "DeviceSpec",
    "ExportOptions",
    "KernelOptions",
    "SpdkOptions",
    "StorageBackend",
    "StorageError",
    "backend_class",
    "format_size",
    "open_backend",
    "parse_device_spec",
    "parse_size",
]
