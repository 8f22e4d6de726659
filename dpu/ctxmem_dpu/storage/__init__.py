"""Flash-device provisioning ("storage backends"): local files/devices, the kernel
NVMe-oF initiator, and SPDK. See docs/storage.md.

- :mod:`.base`: the contract (:class:`StorageBackend`, :class:`StorageError`);
- :mod:`.registry`: backend name -> class, and the :func:`open_backend` factory;
- :mod:`.spec` / :mod:`.config`: the typed device settings (their schema lives in
  :mod:`ctxmem_common.device_settings`, validated when the config loads);
- :mod:`.local`, :mod:`.kernel`, :mod:`.spdk`: the backends.
"""

from .base import StorageBackend, StorageError
from .config import ALIGNMENT_BYTES, parse_device_spec
from .registry import backend_class, open_backend
from .spec import BackendKind, CryptoOptions, DeviceSpec, ExportOptions, KernelOptions, SpdkOptions
from .units import format_size, parse_size

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
