"""Config builders and the scenarios that drive every request the spdk backend can send.

Shared by the behaviour tests (test_storage_spdk_fake_server.py) and the schema tests
(test_storage_spdk_schema.py). Scenarios run against the fake SPDK (NOT SPDK).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from storage_fake_spdk import FakeSpdk

from ctxmem_dpu.storage import parse_device_spec
from ctxmem_dpu.storage.spdk import SpdkBackend

XTS_KEY_HEX = "00112233445566778899aabbccddeeff" * 2 + "ffeeddccbbaa99887766554433221100" * 2
PSK_TEXT = "NVMeTLSkey-1:01:dGhpcyBpcyBhIHRlc3QgUFNLLCBub3QgYSByZWFsIG9uZQ==:\n"


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `overrides` into a copy of `base`; a None value deletes the key."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        elif value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def write_secrets(directory: Path) -> Path:
    """A TLS PSK file and an AES-XTS key file, mode 0600."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "psk0").write_text(PSK_TEXT)
    (directory / "xts.key").write_text(XTS_KEY_HEX + "\n")
    for f in directory.iterdir():
        f.chmod(0o600)
    return directory


def base_raw(socket_path: str) -> dict[str, Any]:
    """The smallest valid `spdk` device entry."""
    return {
        "name": "flash0",
        "backend": "spdk",
        "spdk": {
            "rpc_socket": socket_path,
            "bdev_name": "Nvme0",
            "trtype": "tcp",
            "traddr": "192.0.2.10",
            "trsvcid": 4420,
            "subnqn": "nqn.2016-06.io.spdk:cnode1",
        },
    }


def full_overrides(secrets: Path) -> dict[str, Any]:
    """Every optional spdk key: PSK via keyring, timeouts, crypto from a key file, a
    fixed ublk id, and an NVMe-oF export to a peer."""
    return {"spdk": {
        "adrfam": "ipv4",
        "hostnqn": "nqn.2014-08.org.nvmexpress:uuid:0f8fad5b-d9cb-469f-a165-70867728950e",
        "psk_key_name": "psk0",
        "psk_path": str(secrets / "psk0"),
        "ctrlr_loss_timeout_sec": 30,
        "reconnect_delay_sec": 2,
        "fast_io_fail_timeout_sec": 10,
        "crypto": {"enabled": True, "cipher": "AES_XTS", "key_name": "ctxmem_flash0",
                   "key_file": str(secrets / "xts.key")},
        "expose": "ublk",
        "ublk_id": 3,
        "export": {"nqn": "nqn.2024-01.io.ctxmem:flash0", "trtype": "rdma",
                   "traddr": "192.0.2.1", "trsvcid": "4420",
                   "hosts": ["nqn.2014-08.org.nvmexpress:uuid:peer-1"],
                   "serial_number": "CTXMEM0001"},
    }}


def backend(raw: dict[str, Any]) -> SpdkBackend:
    return SpdkBackend(parse_device_spec(raw, "flash.devices[0]"), rpc_timeout_s=5)


# -- scenarios: (fake, secrets dir) -> None; together they send every request ---------

def attach_detach_minimal(fake: FakeSpdk, secrets: Path) -> None:
    dev = backend(base_raw(fake.socket_path))
    dev.attach(timeout_s=10)
    dev.detach()


def attach_detach_full(fake: FakeSpdk, secrets: Path) -> None:
    dev = backend(merge(base_raw(fake.socket_path), full_overrides(secrets)))
    dev.attach(timeout_s=10)
    dev.detach()


def restart_then_detach_twice(fake: FakeSpdk, secrets: Path) -> None:
    raw = merge(base_raw(fake.socket_path), full_overrides(secrets))
    first = backend(raw)
    first.attach(timeout_s=10)
    first.close()  # the service dies without detaching
    second = backend(raw)
    second.attach(timeout_s=10)  # finds everything, attaches nothing
    second.detach()
    second.detach()


def nbd_with_and_without_device(fake: FakeSpdk, secrets: Path) -> None:
    for nbd_device in (None, "/dev/nbd7"):
        raw = merge(base_raw(fake.socket_path),
                    {"spdk": {"expose": "nbd", "nbd_device": nbd_device}})
        dev = backend(raw)
        dev.attach(timeout_s=10)
        dev.detach()


def preprovisioned_crypto_key(fake: FakeSpdk, secrets: Path) -> None:
    fake.state.accel_keys["dpu_key"] = {"name": "dpu_key", "cipher": "AES_XTS"}
    raw = merge(base_raw(fake.socket_path),
                {"spdk": {"crypto": {"enabled": True, "key_name": "dpu_key"}}})
    dev = backend(raw)
    dev.attach(timeout_s=10)
    dev.detach()


def ipv6_rdma_export_any_host(fake: FakeSpdk, secrets: Path) -> None:
    raw = merge(base_raw(fake.socket_path), {"spdk": {
        "trtype": "rdma", "adrfam": "ipv6", "traddr": "2001:db8::10",
        "export": {"nqn": "nqn.2024-01.io.ctxmem:flash0", "trtype": "tcp", "adrfam": "ipv6",
                   "traddr": "2001:db8::1", "allow_any_host": True}}})
    dev = backend(raw)
    dev.attach(timeout_s=10)
    dev.detach()


SCENARIOS: dict[str, Callable[[FakeSpdk, Path], None]] = {
    f.__name__: f for f in (
        attach_detach_minimal, attach_detach_full, restart_then_detach_twice,
        nbd_with_and_without_device, preprovisioned_crypto_key, ipv6_rdma_export_any_host,
    )
}
