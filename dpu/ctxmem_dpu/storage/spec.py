"""Validated, immutable descriptions of one flash device (one `flash.devices[i]` entry).

`config.parse_device_spec` builds these from YAML; nothing else should. Every field has
the meaning of the config key of the same name (docs/storage.md lists them all).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "BackendKind",
    "CryptoOptions",
    "DeviceSpec",
    "ExportOptions",
    "KernelOptions",
    "SpdkOptions",
    "Transport",
]

BackendKind = Literal["local", "kernel", "spdk"]
Transport = Literal["rdma", "tcp"]


@dataclass(frozen=True)
class KernelOptions:
    """Linux kernel NVMe-oF initiator (`nvme connect`) settings."""

    transport: Transport
    traddr: str
    subnqn: str
    trsvcid: str = "4420"
    hostnqn: str | None = None
    ctrl_loss_tmo: int | None = None
    reconnect_delay: int | None = None
    # Seconds after a connection loss before queued and new I/O fail (EIO) instead of
    # waiting for the reconnect; -1 = off (the kernel's default: I/O waits up to
    # ctrl_loss_tmo). Applied through sysfs, so it works with any nvme-cli version.
    fast_io_fail_tmo: int | None = None
    nr_io_queues: int | None = None
    nsid: int = 1


@dataclass(frozen=True)
class CryptoOptions:
    """SPDK crypto bdev (accel framework AES-XTS; mlx5 offload on BlueField)."""

    enabled: bool = False
    cipher: Literal["AES_XTS"] = "AES_XTS"
    key_name: str = ""
    # File holding the key as hex (see docs/storage.md). None: the key must already be
    # loaded into SPDK under `key_name` (e.g. by the DPU's provisioning).
    key_file: str | None = None


@dataclass(frozen=True)
class ExportOptions:
    """Optional NVMe-oF target export of the device's bdev to a peer."""

    nqn: str
    trtype: Transport
    traddr: str
    trsvcid: str = "4420"
    adrfam: Literal["ipv4", "ipv6"] = "ipv4"
    allow_any_host: bool = False
    hosts: tuple[str, ...] = ()
    serial_number: str | None = None


@dataclass(frozen=True)
class SpdkOptions:
    """SPDK bdev_nvme initiator + optional crypto + ublk/nbd exposure + optional export."""

    bdev_name: str
    trtype: Transport
    traddr: str
    subnqn: str
    rpc_socket: str = "/var/tmp/spdk.sock"
    adrfam: Literal["ipv4", "ipv6"] = "ipv4"
    trsvcid: str = "4420"
    hostnqn: str | None = None
    psk_key_name: str | None = None
    psk_path: str | None = None
    ctrlr_loss_timeout_sec: int | None = None
    reconnect_delay_sec: int | None = None
    fast_io_fail_timeout_sec: int | None = None
    nsid: int = 1
    crypto: CryptoOptions = field(default_factory=CryptoOptions)
    expose: Literal["ublk", "nbd"] = "ublk"
    ublk_id: int | None = None
    nbd_device: str | None = None
    export: ExportOptions | None = None


@dataclass(frozen=True)
class DeviceSpec:
    """One flash device, as configured.

    Attributes:
        name: the device's name inside ctxmem (extents refer to it).
        backend: which StorageBackend provisions it.
        size_bytes: usable size cap (required for `local` with `create: true`); None
            means "the whole device".
        path: `local` only: block device or regular file.
        create: `local` only: create a sparse file of `size_bytes` if `path` is missing.
        kernel: `kernel` only.
        spdk: `spdk` only.
    """

    name: str
    backend: BackendKind
    size_bytes: int | None = None
    path: str | None = None
    create: bool = False
    kernel: KernelOptions | None = None
    spdk: SpdkOptions | None = None
