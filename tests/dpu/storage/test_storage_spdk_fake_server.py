"""`spdk` backend behaviour against a FAKE SPDK JSON-RPC server (NOT SPDK).

The real `spdk.rpc.client.JSONRPCClient` talks over a real Unix socket to
storage_fake_spdk.FakeSpdk, which records requests and answers from a small state model.
These tests check the request sequence, idempotent restart, teardown order, error
reporting and secret redaction. Whether SPDK accepts the requests is checked against
SPDK's schema in test_storage_spdk_schema.py; nothing here runs SPDK.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from storage_backend_suite import BackendTests, MakeBackend
from storage_fake_spdk import FakeSpdk
from storage_spdk_scenarios import XTS_KEY_HEX, backend, merge

from ctxmem_dpu.storage import StorageError, open_backend, parse_device_spec
from ctxmem_dpu.storage.spdk import SpdkBackend, read_xts_key_file
from ctxmem_dpu.storage.spdk_requests import REDACTED

QUERIES = {"bdev_get_bdevs", "bdev_nvme_get_controllers", "keyring_get_keys",
           "accel_crypto_keys_get", "ublk_get_disks", "nbd_get_disks", "nvmf_get_transports",
           "nvmf_get_subsystems"}


def params_of(fake: FakeSpdk, method: str) -> dict[str, Any]:
    found = [r.params for r in fake.requests if r.method == method]
    assert len(found) == 1, f"{method} sent {len(found)} times"
    return found[0] or {}


def test_minimal_attach_sequence(fake_spdk: FakeSpdk, spdk_raw: dict[str, Any]) -> None:
    dev = open_backend(parse_device_spec(spdk_raw, "flash.devices[0]"))
    assert isinstance(dev, SpdkBackend)
    path = dev.attach(timeout_s=10)
    assert path == str(fake_spdk.dev_dir / "ublkb0")
    assert fake_spdk.methods() == [
        "bdev_nvme_get_controllers", "bdev_nvme_attach_controller", "bdev_get_bdevs",
        "ublk_get_disks", "ublk_create_target", "ublk_start_disk", "ublk_get_disks",
        "bdev_get_bdevs"]
    assert params_of(fake_spdk, "bdev_nvme_attach_controller") == {
        "name": "Nvme0", "trtype": "tcp", "adrfam": "ipv4", "traddr": "192.0.2.10",
        "trsvcid": "4420", "subnqn": "nqn.2016-06.io.spdk:cnode1"}
    assert params_of(fake_spdk, "ublk_start_disk") == {"bdev_name": "Nvme0n1", "ublk_id": 0}
    assert dev.size_bytes == 64 << 20 and dev.is_healthy() and not dev.offloads_encryption
    dev.close()


def test_full_attach_requests(fake_spdk: FakeSpdk, spdk_full_raw: dict[str, Any]) -> None:
    dev = backend(spdk_full_raw)
    assert dev.offloads_encryption
    path = dev.attach(timeout_s=10)
    methods = fake_spdk.methods()
    assert methods.index("keyring_file_add_key") < methods.index("bdev_nvme_attach_controller")
    assert params_of(fake_spdk, "bdev_nvme_attach_controller")["psk"] == "psk0"  # key name
    assert params_of(fake_spdk, "bdev_nvme_attach_controller")["reconnect_delay_sec"] == 2
    key = params_of(fake_spdk, "accel_crypto_key_create")
    assert (key["key"], key["key2"]) == (XTS_KEY_HEX[:64], XTS_KEY_HEX[64:])
    assert params_of(fake_spdk, "bdev_crypto_create") == {
        "base_bdev_name": "Nvme0n1", "name": "Nvme0n1_crypto", "key_name": "ctxmem_flash0"}
    assert params_of(fake_spdk, "ublk_start_disk") == {"bdev_name": "Nvme0n1_crypto",
                                                       "ublk_id": 3}
    assert params_of(fake_spdk, "nvmf_subsystem_add_ns")["namespace"] == {
        "bdev_name": "Nvme0n1_crypto"}
    assert params_of(fake_spdk, "nvmf_subsystem_add_listener")["listen_address"] == {
        "trtype": "rdma", "adrfam": "ipv4", "traddr": "192.0.2.1", "trsvcid": "4420"}
    assert path == str(fake_spdk.dev_dir / "ublkb3")


def test_restart_reuses_everything(fake_spdk: FakeSpdk, spdk_full_raw: dict[str, Any]) -> None:
    first = backend(spdk_full_raw)
    path = first.attach(timeout_s=10)
    first.close()  # service crash: nothing detached
    fake_spdk.clear()
    second = backend(spdk_full_raw)
    assert second.attach(timeout_s=10) == path
    assert set(fake_spdk.methods()) <= QUERIES, "a restart must not create anything"
    assert len(fake_spdk.state.controllers) == 1 and len(fake_spdk.state.ublk) == 1
    fake_spdk.clear()
    assert second.attach(timeout_s=10) == path  # same object again
    assert set(fake_spdk.methods()) <= QUERIES


def test_detach_tears_down_in_order_and_is_idempotent(
        fake_spdk: FakeSpdk, spdk_full_raw: dict[str, Any]) -> None:
    with backend(spdk_full_raw) as dev:  # __exit__ detaches
        dev.attach(timeout_s=10)
        fake_spdk.clear()
    teardown = [m for m in fake_spdk.methods() if m not in QUERIES]
    assert teardown == ["nvmf_delete_subsystem", "ublk_stop_disk", "bdev_crypto_delete",
                        "accel_crypto_key_destroy", "bdev_nvme_detach_controller",
                        "keyring_file_remove_key"]
    s = fake_spdk.state
    assert not (s.controllers or s.bdevs or s.accel_keys or s.ublk or s.subsystems
                or s.keyring)
    fake_spdk.clear()
    dev.detach()
    assert set(fake_spdk.methods()) <= QUERIES
    assert not dev.is_healthy()


def test_preprovisioned_key_is_used_and_kept(fake_spdk: FakeSpdk,
                                             spdk_raw: dict[str, Any]) -> None:
    raw = merge(spdk_raw, {"spdk": {"crypto": {"enabled": True, "key_name": "dpu_key"}}})
    with pytest.raises(StorageError, match="accel crypto key 'dpu_key' is not loaded") as info:
        backend(raw).attach(timeout_s=10)
    assert "key_file" in info.value.remedy
    fake_spdk.state.accel_keys["dpu_key"] = {"name": "dpu_key"}
    dev = backend(raw)
    dev.attach(timeout_s=10)  # retry after the failure: reuses the attached controller
    assert fake_spdk.methods().count("bdev_nvme_attach_controller") == 1
    dev.detach()
    assert "accel_crypto_key_destroy" not in fake_spdk.methods()
    assert "dpu_key" in fake_spdk.state.accel_keys


def test_existing_ublk_target_is_tolerated(fake_spdk: FakeSpdk, spdk_raw: dict[str, Any]) -> None:
    fake_spdk.state.ublk_target = True  # created by an earlier run, no disks left
    assert backend(spdk_raw).attach(timeout_s=10).endswith("ublkb0")


def test_ublk_id_clash_is_reported(fake_spdk: FakeSpdk, spdk_raw: dict[str, Any]) -> None:
    fake_spdk.state.ublk[1] = "Other0n1"
    fake_spdk.state.ublk_target = True
    with pytest.raises(StorageError, match="ublk id 1 is already used by bdev 'Other0n1'"):
        backend(merge(spdk_raw, {"spdk": {"ublk_id": 1}})).attach(timeout_s=10)
    path = backend(spdk_raw).attach(timeout_s=10)  # unset: the first free id
    assert path.endswith("ublkb0")


def test_nbd_expose(fake_spdk: FakeSpdk, spdk_raw: dict[str, Any]) -> None:
    dev = backend(merge(spdk_raw, {"spdk": {"expose": "nbd"}}))
    assert dev.attach(timeout_s=10) == str(fake_spdk.dev_dir / "nbd0")
    assert params_of(fake_spdk, "nbd_start_disk") == {"bdev_name": "Nvme0n1"}
    dev.detach()
    assert params_of(fake_spdk, "nbd_stop_disk") == {"nbd_device": str(fake_spdk.dev_dir / "nbd0")}


def test_rpc_error_quotes_method_params_spdk_error_and_remedy(
        fake_spdk: FakeSpdk, spdk_raw: dict[str, Any]) -> None:
    fake_spdk.fail_next("bdev_nvme_attach_controller", -110, "Connection timed out")
    with pytest.raises(StorageError) as info:
        backend(spdk_raw).attach(timeout_s=10)
    text = str(info.value)
    assert "SPDK RPC bdev_nvme_attach_controller" in text
    assert "'subnqn': 'nqn.2016-06.io.spdk:cnode1'" in text
    assert "SPDK error -110: Connection timed out" in text
    assert "192.0.2.10 port 4420 is reachable" in info.value.remedy
    assert info.value.errno == 110


def test_secrets_are_redacted_in_errors(fake_spdk: FakeSpdk,
                                        spdk_full_raw: dict[str, Any]) -> None:
    fake_spdk.fail_next("accel_crypto_key_create", -22, "Invalid argument")
    with pytest.raises(StorageError) as info:
        backend(spdk_full_raw).attach(timeout_s=10)
    text = str(info.value)
    assert f"'key': '{REDACTED}'" in text and f"'key2': '{REDACTED}'" in text
    assert XTS_KEY_HEX[:16] not in text and XTS_KEY_HEX[64:80] not in text


def test_controller_name_clash(fake_spdk: FakeSpdk, spdk_raw: dict[str, Any]) -> None:
    fake_spdk.state.controllers["Nvme0"] = {"trtype": "TCP", "traddr": "198.51.100.7",
                                            "trsvcid": "4420", "subnqn": "nqn.2016-06.io.x:y"}
    with pytest.raises(StorageError, match="'Nvme0' already exists but is attached to") as info:
        backend(spdk_raw).attach(timeout_s=10)
    assert "another spdk.bdev_name" in info.value.remedy
    assert "bdev_nvme_attach_controller" not in fake_spdk.methods()


def test_missing_namespace(tmp_path: Path) -> None:
    from storage_fake_spdk import serve_fake_spdk
    from storage_spdk_scenarios import base_raw

    with serve_fake_spdk(tmp_path / "dev", nsids=(2,)) as fake:
        with pytest.raises(StorageError, match=r"bdev Nvme0n1 \(namespace 1\) does not exist"):
            backend(base_raw(fake.socket_path)).attach(timeout_s=10)
        dev = backend(merge(base_raw(fake.socket_path), {"spdk": {"nsid": 2}}))
        assert dev.attach(timeout_s=10).endswith("ublkb0")


def test_psk_name_without_path_must_already_be_loaded(fake_spdk: FakeSpdk,
                                                      spdk_raw: dict[str, Any]) -> None:
    raw = merge(spdk_raw, {"spdk": {"psk_key_name": "psk9"}})
    with pytest.raises(StorageError, match="TLS PSK 'psk9' is not in SPDK's keyring"):
        backend(raw).attach(timeout_s=10)
    fake_spdk.state.keyring["psk9"] = "/etc/spdk/psk9"
    backend(raw).attach(timeout_s=10)
    assert "keyring_file_add_key" not in fake_spdk.methods()


def test_no_spdk_listening(tmp_path: Path) -> None:
    raw = {"name": "f", "backend": "spdk", "spdk": {
        "rpc_socket": str(tmp_path / "absent.sock"), "bdev_name": "Nvme0", "trtype": "tcp",
        "traddr": "192.0.2.10", "subnqn": "nqn.2016-06.io.spdk:cnode1"}}
    with pytest.raises(StorageError, match="cannot connect to SPDK's RPC socket") as info:
        backend(raw).attach(timeout_s=0.5)
    assert "spdk.rpc_socket" in info.value.remedy


def test_reply_timeout(fake_spdk: FakeSpdk, spdk_raw: dict[str, Any]) -> None:
    fake_spdk.delay_next("bdev_nvme_attach_controller", 3.0)
    with pytest.raises(StorageError, match=r"got no reply .* within"):
        backend(spdk_raw).attach(timeout_s=1.5)


def test_health(fake_spdk: FakeSpdk, spdk_raw: dict[str, Any]) -> None:
    dev = backend(spdk_raw)
    assert not dev.is_healthy()
    dev.attach(timeout_s=10)
    assert dev.is_healthy()
    fake_spdk.controller_state = "failed"
    assert not dev.is_healthy()
    fake_spdk.controller_state = "enabled"
    fake_spdk.stop()
    assert not dev.is_healthy()  # SPDK gone: unhealthy, no exception


@pytest.mark.parametrize(("content", "mode", "message"), [
    (XTS_KEY_HEX, 0o644, "accessible by group or others"),
    ("abc", 0o600, "does not hold an AES-XTS key"),
    ("zz" * 64, 0o600, "does not hold an AES-XTS key"),
    ("ab" * 32 + " " + "ab" * 32, 0o600, "halves are equal"),
])
def test_key_file_checks(tmp_path: Path, content: str, mode: int, message: str) -> None:
    path = tmp_path / "k"
    path.write_text(content)
    path.chmod(mode)
    with pytest.raises(StorageError, match=message):
        read_xts_key_file(str(path), "flash0")


def test_key_file_two_part_form(tmp_path: Path) -> None:
    path = tmp_path / "k"
    path.write_text("11" * 16 + "\n" + "22" * 16 + "\n")
    path.chmod(0o600)
    assert read_xts_key_file(str(path), "flash0") == ("11" * 16, "22" * 16)


def test_missing_spdk_package_is_a_storage_error(
        spdk_raw: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "spdk.rpc.client", None)  # import raises ImportError
    with pytest.raises(StorageError, match="spdk Python package is not installed") as info:
        backend(spdk_raw).attach(timeout_s=5)
    assert "ctxmem-kv[spdk]" in info.value.remedy


class TestSpdkBackend(BackendTests):
    """The shared backend suite against the fake SPDK JSON-RPC server."""

    @pytest.fixture
    def make(self, spdk_raw: dict[str, Any]) -> MakeBackend:
        return lambda: backend(spdk_raw)
