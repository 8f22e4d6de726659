"""Every JSON-RPC request the `spdk` backend sends, built in this one module.

Method and parameter names are SPDK's (schema/schema.yaml in the SPDK repository); the
tests validate each request built here against that schema. Nothing here talks to a
socket: `spdk.SpdkBackend` sends what these functions return, so this module is the
whole vocabulary ctxmem uses with SPDK, in one place.

Names ctxmem gives SPDK objects (derived from config, so a restarted service finds them):
    controller      <bdev_name>                     (bdev_nvme_attach_controller name)
    namespace bdev  <bdev_name>n<nsid>              (created by SPDK on attach)
    crypto bdev     <bdev_name>n<nsid>_crypto       (bdev_crypto_create)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ctxmem_common.device_settings import ExportOptions, SpdkOptions

__all__ = ["REDACTED", "SENDABLE_METHODS", "RpcRequest", "SpdkNames"]

REDACTED = "<redacted>"


@dataclass(frozen=True)
class RpcRequest:
    """One JSON-RPC call: method, params, which params are secret, and the remedy to
    print if SPDK rejects it."""

    method: str
    params: Mapping[str, Any] = field(default_factory=dict)
    secret_params: frozenset[str] = frozenset()
    remedy: str = ""

    def redacted_params(self) -> dict[str, Any]:
        """The params safe to log or put in an error message."""
        return {k: (REDACTED if k in self.secret_params else v) for k, v in self.params.items()}


@dataclass(frozen=True)
class SpdkNames:
    """The SPDK object names one device uses."""

    controller: str
    namespace_bdev: str
    crypto_bdev: str

    @classmethod
    def of(cls, opts: SpdkOptions) -> SpdkNames:
        ns = f"{opts.bdev_name}n{opts.nsid}"
        return cls(controller=opts.bdev_name, namespace_bdev=ns, crypto_bdev=f"{ns}_crypto")

    def top_bdev(self, opts: SpdkOptions) -> str:
        """The bdev the data path sees: the crypto bdev if enabled, else the namespace."""
        return self.crypto_bdev if opts.crypto.enabled else self.namespace_bdev


def _drop_none(params: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if v is not None}


# -- queries (idempotent start and health) ---------------------------------------------

def get_bdevs() -> RpcRequest:
    return RpcRequest("bdev_get_bdevs")


def get_controllers() -> RpcRequest:
    return RpcRequest("bdev_nvme_get_controllers")


def keyring_get_keys() -> RpcRequest:
    return RpcRequest("keyring_get_keys")


def accel_crypto_keys_get(key_name: str) -> RpcRequest:
    # Filtered by name: an unfiltered call returns every key's material.
    return RpcRequest("accel_crypto_keys_get", {"key_name": key_name})


def ublk_get_disks() -> RpcRequest:
    return RpcRequest("ublk_get_disks")


def nbd_get_disks() -> RpcRequest:
    return RpcRequest("nbd_get_disks")


def nvmf_get_transports() -> RpcRequest:
    return RpcRequest("nvmf_get_transports")


def nvmf_get_subsystems() -> RpcRequest:
    return RpcRequest("nvmf_get_subsystems")


# -- attach -----------------------------------------------------------------------------

def keyring_file_add_key(opts: SpdkOptions) -> RpcRequest:
    assert opts.psk_key_name is not None and opts.psk_path is not None
    return RpcRequest(
        "keyring_file_add_key", {"name": opts.psk_key_name, "path": opts.psk_path},
        remedy=f"check that {opts.psk_path} exists where SPDK runs (on a BlueField: inside "
        "the SNAP container), holds an NVMe TLS PSK in interchange format "
        "(NVMeTLSkey-1:01:...:) and has mode 0600 owned by SPDK's user",
    )


def attach_controller(opts: SpdkOptions) -> RpcRequest:
    return RpcRequest(
        "bdev_nvme_attach_controller",
        _drop_none({
            "name": opts.bdev_name,
            "trtype": opts.trtype,
            "adrfam": opts.adrfam,
            "traddr": opts.traddr,
            "trsvcid": opts.trsvcid,
            "subnqn": opts.subnqn,
            "hostnqn": opts.hostnqn,
            "psk": opts.psk_key_name,  # a keyring key name, not the key itself
            "ctrlr_loss_timeout_sec": opts.ctrlr_loss_timeout_sec,
            "reconnect_delay_sec": opts.reconnect_delay_sec,
            "fast_io_fail_timeout_sec": opts.fast_io_fail_timeout_sec,
        }),
        remedy=f"check that {opts.traddr} port {opts.trsvcid} is reachable over "
        f"{opts.trtype} from SPDK's host, that subsystem {opts.subnqn} exists and allows "
        f"{opts.hostnqn or 'SPDK host NQN'}, and (rdma) that SPDK was started with an RDMA "
        "capable NIC; see SPDK's log for the transport error",
    )


def accel_crypto_key_create(opts: SpdkOptions, key_hex: str, key2_hex: str) -> RpcRequest:
    return RpcRequest(
        "accel_crypto_key_create",
        {"cipher": opts.crypto.cipher, "name": opts.crypto.key_name,
         "key": key_hex, "key2": key2_hex},
        secret_params=frozenset({"key", "key2"}),
        remedy="check that an accel module with AES_XTS is loaded (mlx5_scan_accel_module "
        "on BlueField, or the software module) and that the key sizes are supported",
    )


def bdev_crypto_create(opts: SpdkOptions, names: SpdkNames) -> RpcRequest:
    return RpcRequest(
        "bdev_crypto_create",
        {"base_bdev_name": names.namespace_bdev, "name": names.crypto_bdev,
         "key_name": opts.crypto.key_name},
        remedy=f"check that accel key {opts.crypto.key_name!r} exists "
        "(accel_crypto_keys_get) and that the crypto bdev module is built into SPDK",
    )


def ublk_create_target() -> RpcRequest:
    return RpcRequest(
        "ublk_create_target",
        remedy="load the kernel ublk driver (modprobe ublk_drv; kernel >= 6.0) where SPDK "
        "runs, and check SPDK was built with --with-ublk",
    )


def ublk_start_disk(bdev_name: str, ublk_id: int) -> RpcRequest:
    return RpcRequest(
        "ublk_start_disk", {"bdev_name": bdev_name, "ublk_id": ublk_id},
        remedy=f"check that /dev/ublkb{ublk_id} is not used by another ublk server, or set "
        "spdk.ublk_id to a free id",
    )


def nbd_start_disk(bdev_name: str, nbd_device: str | None) -> RpcRequest:
    return RpcRequest(
        "nbd_start_disk", _drop_none({"bdev_name": bdev_name, "nbd_device": nbd_device}),
        remedy="load the kernel nbd driver (modprobe nbd) and check that the nbd device is "
        "free (nbd_get_disks), or leave spdk.nbd_device unset to take the first free one",
    )


# -- export -----------------------------------------------------------------------------

def nvmf_create_transport(export: ExportOptions) -> RpcRequest:
    return RpcRequest("nvmf_create_transport", {"trtype": export.trtype},
                      remedy=f"check that SPDK was built with {export.trtype} support")


def nvmf_create_subsystem(export: ExportOptions) -> RpcRequest:
    return RpcRequest(
        "nvmf_create_subsystem",
        _drop_none({"nqn": export.nqn, "allow_any_host": export.allow_any_host,
                    "serial_number": export.serial_number}),
        remedy="check that the export NQN is unique on this SPDK target",
    )


def nvmf_subsystem_add_ns(export: ExportOptions, bdev_name: str) -> RpcRequest:
    return RpcRequest("nvmf_subsystem_add_ns",
                      {"nqn": export.nqn, "namespace": {"bdev_name": bdev_name}},
                      remedy=f"check that bdev {bdev_name} is not claimed by another module")


def nvmf_subsystem_add_host(export: ExportOptions, host: str) -> RpcRequest:
    return RpcRequest("nvmf_subsystem_add_host", {"nqn": export.nqn, "host": host})


def nvmf_subsystem_add_listener(export: ExportOptions) -> RpcRequest:
    return RpcRequest(
        "nvmf_subsystem_add_listener",
        {"nqn": export.nqn,
         "listen_address": {"trtype": export.trtype, "adrfam": export.adrfam,
                            "traddr": export.traddr, "trsvcid": export.trsvcid}},
        remedy=f"check that {export.traddr} is an address of this machine on an "
        f"{export.trtype}-capable interface and port {export.trsvcid} is free",
    )


# -- detach -----------------------------------------------------------------------------

def nvmf_delete_subsystem(export: ExportOptions) -> RpcRequest:
    return RpcRequest("nvmf_delete_subsystem", {"nqn": export.nqn})


def ublk_stop_disk(ublk_id: int) -> RpcRequest:
    return RpcRequest("ublk_stop_disk", {"ublk_id": ublk_id},
                      remedy=f"close every process holding /dev/ublkb{ublk_id} open")


def nbd_stop_disk(nbd_device: str) -> RpcRequest:
    return RpcRequest("nbd_stop_disk", {"nbd_device": nbd_device},
                      remedy=f"close every process holding {nbd_device} open")


def bdev_crypto_delete(names: SpdkNames) -> RpcRequest:
    return RpcRequest("bdev_crypto_delete", {"name": names.crypto_bdev},
                      remedy="stop whatever still claims the crypto bdev (ublk/nbd/nvmf)")


def accel_crypto_key_destroy(opts: SpdkOptions) -> RpcRequest:
    return RpcRequest("accel_crypto_key_destroy", {"key_name": opts.crypto.key_name},
                      remedy="delete every crypto bdev still using this key first")


def detach_controller(names: SpdkNames) -> RpcRequest:
    return RpcRequest("bdev_nvme_detach_controller", {"name": names.controller},
                      remedy="stop whatever still claims the namespace bdev first")


def keyring_file_remove_key(opts: SpdkOptions) -> RpcRequest:
    assert opts.psk_key_name is not None
    return RpcRequest("keyring_file_remove_key", {"name": opts.psk_key_name})


# The complete set of methods built above; the schema tests check that their captured
# traffic covers all of it, so a new request cannot be added without being validated.
SENDABLE_METHODS: frozenset[str] = frozenset({
    "bdev_get_bdevs", "bdev_nvme_get_controllers", "keyring_get_keys",
    "accel_crypto_keys_get", "ublk_get_disks", "nbd_get_disks", "nvmf_get_transports",
    "nvmf_get_subsystems", "keyring_file_add_key", "bdev_nvme_attach_controller",
    "accel_crypto_key_create", "bdev_crypto_create", "ublk_create_target",
    "ublk_start_disk", "nbd_start_disk", "nvmf_create_transport", "nvmf_create_subsystem",
    "nvmf_subsystem_add_ns", "nvmf_subsystem_add_host", "nvmf_subsystem_add_listener",
    "nvmf_delete_subsystem", "ublk_stop_disk", "nbd_stop_disk", "bdev_crypto_delete",
    "accel_crypto_key_destroy", "bdev_nvme_detach_controller", "keyring_file_remove_key",
})
