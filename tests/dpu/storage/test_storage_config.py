"""Config validation of `flash.devices[i]` and size strings."""

from __future__ import annotations

from typing import Any

import pytest

from ctxmem_common.units import format_size
from ctxmem_dpu.storage import (
    CryptoOptions,
    DeviceSpec,
    KernelOptions,
    SpdkOptions,
    parse_device_spec,
    parse_size,
)

W = "flash.devices[0]"


def kernel_raw(**kernel: Any) -> dict[str, Any]:
    base = {"transport": "tcp", "traddr": "192.0.2.10",
            "subnqn": "nqn.2014-08.org.example:flash"}
    base.update(kernel)
    return {"name": "nvmeof0", "backend": "kernel", "kernel": base}


def spdk_raw(**spdk: Any) -> dict[str, Any]:
    base = {"bdev_name": "Nvme0", "trtype": "rdma", "traddr": "192.0.2.10",
            "subnqn": "nqn.2016-06.io.spdk:cnode1"}
    base.update(spdk)
    return {"name": "spdk0", "backend": "spdk", "spdk": base}


@pytest.mark.parametrize(("text", "expected"), [
    ("512MiB", 512 << 20), ("8GiB", 8 << 30), ("8 GiB", 8 << 30), ("1TiB", 1 << 40),
    ("4096", 4096), (4096, 4096), ("100GB", 100 * 10**9), ("1.5GiB", 3 << 29),
    ("64kib", 64 << 10), ("2048B", 2048),
])
def test_parse_size_accepts(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("8G", "ambiguous"), ("8gb?", "cannot parse"), ("eight GiB", "cannot parse"),
    ("8XB", "unknown unit"), (-1, "negative"), (True, "boolean"), (1.5, "got float"),
    ("0.3B", "whole number"), ("", "cannot parse"),
])
def test_parse_size_rejects(text: object, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_size(text, f"{W}.size")
    assert str(info.value).startswith(f"{W}.size: ")


def test_format_size_round_trips() -> None:
    for size in (4096, 512 << 20, 8 << 30, 12345):
        assert parse_size(format_size(size)) == size


def test_local_spec() -> None:
    spec = parse_device_spec({"name": "f0", "backend": "local", "path": "/data/ctxmem.img",
                              "size": "8GiB", "create": True}, W)
    assert spec == DeviceSpec("f0", "local", 8 << 30, path="/data/ctxmem.img", create=True)


def test_kernel_spec_defaults_and_port_normalisation() -> None:
    spec = parse_device_spec(kernel_raw(trsvcid=4421, ctrl_loss_tmo=-1), W)
    assert spec.kernel is not None
    assert (spec.kernel.trsvcid, spec.kernel.ctrl_loss_tmo, spec.kernel.nsid) == ("4421", -1, 1)


@pytest.mark.parametrize(("fast", "loss"), [(-1, None), (0, -1), (2, -1), (5, 600), (3, None)])
def test_kernel_fast_io_fail_tmo_accepted(fast: int, loss: int | None) -> None:
    spec = parse_device_spec(kernel_raw(fast_io_fail_tmo=fast, ctrl_loss_tmo=loss), W)
    assert spec.kernel is not None
    assert (spec.kernel.fast_io_fail_tmo, spec.kernel.ctrl_loss_tmo) == (fast, loss)


def test_spdk_spec_defaults() -> None:
    spec = parse_device_spec(spdk_raw(), W)
    assert spec.spdk is not None
    assert spec.spdk.rpc_socket == "/var/tmp/spdk.sock"
    assert (spec.spdk.expose, spec.spdk.adrfam, spec.spdk.trsvcid) == ("ublk", "ipv4", "4420")
    assert not spec.spdk.crypto.enabled and spec.spdk.export is None


@pytest.mark.parametrize(("raw", "message"), [
    ({"name": "x", "backend": "local", "path": "/p", "sise": "1GiB"},
     f"{W}.sise: unknown key; allowed keys: backend, create, name, path, size"),
    (kernel_raw(trsvcid=4420, port=1), f"{W}.kernel.port: unknown key; allowed keys: "),
    (spdk_raw(crypto={"enabled": True, "key_name": "k", "kye_file": "/k"}),
     f"{W}.spdk.crypto.kye_file: unknown key; allowed keys: cipher, enabled, key_file, "
     "key_name"),
    ({**kernel_raw(), "path": "/dev/x"},
     f"{W}.path: unknown key; allowed keys: backend, kernel, name, size"),
])
def test_unknown_keys_are_named_with_the_allowed_ones(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_device_spec(raw, W)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(("raw", "message"), [
    ({"backend": "local", "path": "/p"}, f"{W}.name: required"),
    ({"name": "x", "path": "/p"}, f"{W}.backend: required"),
    ({"name": "x", "backend": "local"}, f"{W}.path: required"),
    ({"name": "x", "backend": "local", "path": "/p", "create": True},
     f"{W}.size: required when create is true"),
    ({"name": "x", "backend": "kernel"}, f"{W}.kernel: required"),
    (kernel_raw(traddr=None), f"{W}.kernel.traddr: required"),
    (kernel_raw(transport=None), f"{W}.kernel.transport: required (one of: rdma, tcp)"),
    (kernel_raw(subnqn=None), f"{W}.kernel.subnqn: required"),
    (spdk_raw(bdev_name=None), f"{W}.spdk.bdev_name: required"),
    (spdk_raw(crypto={"enabled": True}), f"{W}.spdk.crypto.key_name: required"),
    (spdk_raw(trtype="tcp", psk_path="/k"), f"{W}.spdk.psk_key_name: required"),
    (spdk_raw(export={"nqn": "nqn.2024-01.io.x:y", "trtype": "tcp", "traddr": "10.0.0.1"}),
     f"{W}.spdk.export.hosts: list the peer host NQNs"),
])
def test_missing_required(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_device_spec(raw, W)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(("raw", "message"), [
    ({"name": "x", "backend": "nfs"}, f"{W}.backend: invalid value 'nfs'"),
    ({"name": "x", "backend": "local", "path": "/p", "size": "8G"}, f"{W}.size: unit 'G'"),
    ({"name": "x", "backend": "local", "path": "/p", "size": "lots"}, f"{W}.size: cannot parse"),
    ({"name": "x", "backend": "local", "path": "/p", "size": "4097KiB"},
     f"{W}.size: '4097KiB' must be at least 1MiB and a multiple of 4096"),
    ({"name": "x", "backend": "local", "path": "/p", "create": "yes"},
     f"{W}.create: expected true or false"),
    ({"name": "bad name", "backend": "local", "path": "/p"}, f"{W}.name: invalid value"),
    (kernel_raw(transport="fc"), f"{W}.kernel.transport: invalid value 'fc'"),
    (kernel_raw(trsvcid=70000), f"{W}.kernel.trsvcid: expected a port number"),
    (kernel_raw(subnqn="cnode1"), f"{W}.kernel.subnqn: invalid value 'cnode1'"),
    (kernel_raw(nr_io_queues=0), f"{W}.kernel.nr_io_queues: 0 is out of range"),
    (kernel_raw(fast_io_fail_tmo=-2), f"{W}.kernel.fast_io_fail_tmo: -2 is out of range"),
    (kernel_raw(fast_io_fail_tmo="5s"), f"{W}.kernel.fast_io_fail_tmo: expected an integer"),
    (kernel_raw(fast_io_fail_tmo=30, ctrl_loss_tmo=30),
     f"{W}.kernel.fast_io_fail_tmo: 30 must be less than ctrl_loss_tmo (30)"),
    (spdk_raw(expose="vhost"), f"{W}.spdk.expose: invalid value 'vhost'"),
    (spdk_raw(psk_key_name="k0"), f"{W}.spdk.psk_key_name: a TLS PSK needs trtype tcp"),
    (spdk_raw(nbd_device="/dev/nbd0"), f"{W}.spdk.nbd_device: only valid with expose: nbd"),
    (spdk_raw(expose="nbd", ublk_id=1), f"{W}.spdk.ublk_id: only valid with expose: ublk"),
    (spdk_raw(crypto={"enabled": True, "key_name": "k", "cipher": "AES_CBC"}),
     f"{W}.spdk.crypto.cipher: invalid value 'AES_CBC'"),
    (spdk_raw(reconnect_delay_sec=10, ctrlr_loss_timeout_sec=5),
     f"{W}.spdk.ctrlr_loss_timeout_sec: must be -1 or at least reconnect_delay_sec"),
    (spdk_raw(reconnect_delay_sec=0, ctrlr_loss_timeout_sec=5),
     f"{W}.spdk.ctrlr_loss_timeout_sec: must be 0 when reconnect_delay_sec is 0"),
    (spdk_raw(reconnect_delay_sec=5, ctrlr_loss_timeout_sec=30, fast_io_fail_timeout_sec=30),
     f"{W}.spdk.fast_io_fail_timeout_sec: must be less than ctrlr_loss_timeout_sec"),
    (spdk_raw(ublk_id=True), f"{W}.spdk.ublk_id: expected an integer"),
    ({"name": "x", "backend": "spdk", "spdk": ["bdev_name"]}, f"{W}.spdk: expected a mapping"),
])
def test_bad_values(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_device_spec(raw, W)
    assert str(info.value).startswith(message)


def test_service_config_entries_reach_the_backends() -> None:
    """The service turns its typed config back into raw entries for parse_device_spec:
    defaults of other backends' keys (`create: false`) must not make it reject a
    `kernel` or `spdk` device (it did, so the service could not start with one)."""
    from ctxmem_common.config import config_from_dict
    from ctxmem_dpu.app import Service

    cfg = config_from_dict({"flash": {"devices": [
        kernel_raw(ctrl_loss_tmo=-1, fast_io_fail_tmo=2), spdk_raw(),
        {"name": "f0", "backend": "local", "path": "/data/f0.img", "size": "64MiB",
         "create": True}]}})
    specs = Service(cfg)._device_specs()
    assert [(s.name, s.backend) for s in specs] == [
        ("nvmeof0", "kernel"), ("spdk0", "spdk"), ("f0", "local")]
    assert specs[0].kernel is not None and specs[0].kernel.fast_io_fail_tmo == 2
    assert specs[2].create and specs[2].size_bytes == 64 << 20


# -- typed device settings: validated with the rest of the config, at load ----------------


def test_a_bad_backend_key_fails_at_config_load_not_at_start(tmp_path: Any) -> None:
    from ctxmem_common.config import config_from_dict, load_config
    from ctxmem_common.errors import ConfigError

    dev = kernel_raw(bogus=1)
    with pytest.raises(ConfigError, match=r"^flash\.devices\[0\]\.kernel\.bogus: unknown key; "
                                          r"allowed keys: "):
        config_from_dict({"flash": {"devices": [dev]}})
    spdk = spdk_raw(crypto={"enabled": True})
    with pytest.raises(ConfigError, match=r"flash\.devices\[0\]\.spdk\.crypto\.key_name: "
                                          r"required when crypto is enabled"):
        config_from_dict({"flash": {"devices": [spdk]}})
    path = tmp_path / "c.yaml"
    path.write_text("flash:\n  devices:\n    - {name: n0, backend: kernel, kernel: "
                    "{transport: tcp, traddr: 192.0.2.10, subnqn: 'nqn.2014-08.org.example:f', "
                    "trsvcid: 99999}}\n")
    with pytest.raises(ConfigError, match=r"flash\.devices\[0\]\.kernel\.trsvcid: expected a "
                                          r"port number"):
        load_config(path)
    for raw, message in [
        ({"name": "n0", "backend": "kernel"}, r"flash\.devices\[0\]\.kernel: required"),
        ({**kernel_raw(), "path": "/x"}, r"flash\.devices\[0\]\.path: unknown key"),
        ({"name": "bad name", "backend": "local", "path": "/x"}, r"\.name: invalid value"),
        ({"name": "n0", "backend": "local", "path": "/x", "size": 4096},
         r"\.size: 4096 must be at least 1MiB"),
    ]:
        with pytest.raises(ConfigError, match=message):
            config_from_dict({"flash": {"devices": [raw]}})


def test_loaded_devices_are_typed_and_are_what_the_backends_take() -> None:
    from ctxmem_common.config import config_from_dict

    cfg = config_from_dict({"flash": {"devices": [kernel_raw(trsvcid=4421), spdk_raw()]}})
    kernel, spdk = cfg.flash.devices
    assert isinstance(kernel.kernel, KernelOptions) and kernel.spdk is None
    assert kernel.kernel.trsvcid == "4421"
    assert isinstance(spdk.spdk, SpdkOptions) and spdk.spdk.crypto == CryptoOptions()
    assert kernel.device_spec(W) == parse_device_spec(kernel_raw(trsvcid=4421), W)
    assert spdk.device_spec("flash.devices[1]") == parse_device_spec(spdk_raw(),
                                                                     "flash.devices[1]")
