"""Validation of one `flash.devices[i]` config entry into a DeviceSpec.

The rules live in :mod:`ctxmem_common.device_settings`, the one home of the device
schema, which the config loader runs on every entry (a typed entry becomes a spec with
:meth:`ctxmem_common.config.FlashDeviceConfig.device_spec`). This module keeps the names
the storage layer has always exported: :func:`parse_device_spec` turns raw YAML data
into a DeviceSpec (example configs and tests use it).
"""

from __future__ import annotations

from ctxmem_common.device_settings import ALIGNMENT_BYTES, parse_device_spec

__all__ = ["ALIGNMENT_BYTES", "parse_device_spec"]
