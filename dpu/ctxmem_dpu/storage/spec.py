"""Validated, immutable descriptions of one flash device (one `flash.devices[i]` entry).

The dataclasses live in :mod:`ctxmem_common.device_settings`, next to the rest of the
config schema, so a device's backend settings are validated when the config loads; this
module keeps the names the storage layer has always imported.
"""

from __future__ import annotations

from ctxmem_common.device_settings import (
    BackendKind,
    CryptoOptions,
    DeviceSpec,
    ExportOptions,
    FabricTransport,
    KernelOptions,
    SpdkOptions,
)

Transport = FabricTransport  # the NVMe-oF fabric; the name this module always exported

__all__ = [
    "BackendKind",
    "CryptoOptions",
    "DeviceSpec",
    "ExportOptions",
    "KernelOptions",
    "SpdkOptions",
    "Transport",
]
