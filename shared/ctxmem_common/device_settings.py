"""Typed settings of one flash device (one ``flash.devices[i]`` entry) and their rules.

The one home of the device schema: :mod:`ctxmem_common.config` builds the ``kernel:`` and
``spdk:`` sections into these dataclasses while it loads the rest of the config, so a bad
backend key is a :class:`~ctxmem_common.errors.ConfigError` naming its key path
(``flash.devices[0].kernel.bogus: unknown key; ...``) at load, not a failure at service
start. The service's storage backends take the same objects (``DeviceSpec``), with no
round trip through plain dicts.

Errors are ValueErrors whose message starts with the config path of the offending key
(``flash.devices[0].kernel.traddr: required``). Unknown keys are rejected, naming the
allowed ones: a misspelt optional key silently ignored is how a device ends up without
its crypto or timeouts. Every field has the meaning of the config key of the same name
(docs/storage.md lists them all).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast

from ctxmem_common.units import parse_size

__all__ = [
    "ALIGNMENT_BYTES",
    "BackendKind",
    "CryptoOptions",
    "DeviceSpec",
    "ExportOptions",
    "FabricTransport",
    "KernelOptions",
    "SpdkOptions",
    "device_spec",
    "parse_device_spec",
    "parse_kernel_options",
    "parse_spdk_options",
]

BackendKind = Literal["local", "kernel", "spdk"]
# NVMe-oF fabric of a remote namespace (not a ctxmem data transport).
FabricTransport = Literal["rdma", "tcp"]


@dataclass(frozen=True)
class KernelOptions:
    """Linux kernel NVMe-oF initiator (`nvme connect`) settings."""

    transport: FabricTransport
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
    trtype: FabricTransport
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
    trtype: FabricTransport
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


# Extents are 4 KiB aligned on flash (DESIGN.md), so a device's usable size is too.
ALIGNMENT_BYTES = 4096

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_NQN_RE = re.compile(r"^nqn\.\d{4}-\d{2}\.[^\s]{1,200}$")

_TOP_KEYS: dict[str, frozenset[str]] = {
    "local": frozenset({"name", "backend", "size", "path", "create"}),
    "kernel": frozenset({"name", "backend", "size", "kernel"}),
    "spdk": frozenset({"name", "backend", "size", "spdk"}),
}
_KERNEL_KEYS = frozenset({
    "transport", "traddr", "trsvcid", "subnqn", "hostnqn", "ctrl_loss_tmo",
    "reconnect_delay", "fast_io_fail_tmo", "nr_io_queues", "nsid",
})
_SPDK_KEYS = frozenset({
    "rpc_socket", "bdev_name", "trtype", "adrfam", "traddr", "trsvcid", "subnqn", "hostnqn",
    "psk_key_name", "psk_path", "ctrlr_loss_timeout_sec", "reconnect_delay_sec",
    "fast_io_fail_timeout_sec", "nsid", "crypto", "expose", "ublk_id", "nbd_device", "export",
})
_CRYPTO_KEYS = frozenset({"enabled", "cipher", "key_name", "key_file"})
_EXPORT_KEYS = frozenset({
    "nqn", "trtype", "traddr", "trsvcid", "adrfam", "allow_any_host", "hosts", "serial_number",
})

_T = TypeVar("_T")

_TRANSPORTS: tuple[FabricTransport, ...] = ("rdma", "tcp")
_EXPOSE: tuple[Literal["ublk", "nbd"], ...] = ("ublk", "nbd")
_ADRFAM: tuple[Literal["ipv4", "ipv6"], ...] = ("ipv4", "ipv6")
_CIPHERS: tuple[Literal["AES_XTS"], ...] = ("AES_XTS",)


class _Section:
    """Typed access to one mapping of the config, with path-prefixed errors."""

    def __init__(self, raw: object, where: str, allowed: frozenset[str]) -> None:
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: expected a mapping, got {type(raw).__name__}")
        self.raw: Mapping[str, Any] = raw
        self.where = where
        unknown = sorted(str(k) for k in raw if k not in allowed)
        if unknown:
            raise ValueError(
                f"{where}.{unknown[0]}: unknown key; allowed keys: {', '.join(sorted(allowed))}"
            )

    def path(self, key: str) -> str:
        return f"{self.where}.{key}"

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def _get(self, key: str, required: bool) -> Any:
        value = self.raw.get(key)
        if value is None and required:
            raise ValueError(f"{self.path(key)}: required")
        return value

    def str_(self, key: str, *, required: bool = False, default: str | None = None,
             pattern: re.Pattern[str] | None = None, hint: str = "") -> str | None:
        value = self._get(key, required)
        if value is None:
            return default
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{self.path(key)}: expected a non-empty string, got {value!r}")
        if pattern is not None and not pattern.match(value):
            raise ValueError(f"{self.path(key)}: invalid value {value!r}{hint}")
        return value

    def req_str(self, key: str, **kwargs: Any) -> str:
        value = self.str_(key, required=True, **kwargs)
        assert value is not None  # guaranteed by required=True
        return value

    def choice(self, key: str, choices: tuple[_T, ...], *, default: _T | None = None) -> _T:
        value = self.raw.get(key)
        if value is None:
            if default is None:
                raise ValueError(
                    f"{self.path(key)}: required (one of: {', '.join(map(str, choices))})"
                )
            return default
        if value not in choices:
            raise ValueError(
                f"{self.path(key)}: invalid value {value!r}; "
                f"expected one of: {', '.join(map(str, choices))}"
            )
        return cast(_T, value)

    def int_(self, key: str, *, minimum: int, maximum: int = 2**31 - 1,
             default: int | None = None) -> int | None:
        value = self.raw.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{self.path(key)}: expected an integer, got {value!r}")
        if not minimum <= value <= maximum:
            raise ValueError(
                f"{self.path(key)}: {value} is out of range [{minimum}, {maximum}]"
            )
        return value

    def bool_(self, key: str, default: bool) -> bool:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ValueError(f"{self.path(key)}: expected true or false, got {value!r}")
        return value

    def port(self, key: str, default: str) -> str:
        value = self.raw.get(key)
        if value is None:
            return default
        text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
        if not isinstance(text, str) or not text.isdigit() or not 1 <= int(text) <= 65535:
            raise ValueError(f"{self.path(key)}: expected a port number 1-65535, got {value!r}")
        return str(int(text))

    def section(self, key: str, allowed: frozenset[str], *, required: bool) -> _Section | None:
        value = self._get(key, required)
        if value is None:
            return None
        return _Section(value, self.path(key), allowed)


_NAME_HINT = " (1-64 of A-Z a-z 0-9 _ . -, starting with a letter or digit)"
_NQN_HINT = " (an NVMe qualified name looks like nqn.2014-08.org.example:subsys1)"


def parse_device_spec(raw: Mapping[str, Any], where: str) -> DeviceSpec:
    """Validate one ``flash.devices`` entry given as plain YAML data.

    The config loader builds typed entries itself (:func:`device_spec`); this is for
    callers holding a raw mapping (example configs, tests).

    Args:
        raw: the entry as loaded from YAML.
        where: its config path, e.g. "flash.devices[0]"; prefixes every error.

    Raises:
        ValueError: on an unknown key, a missing required key or a bad value.
    """
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {type(raw).__name__}")
    backend = _backend(raw.get("backend"), where)
    top = _Section(raw, where, _TOP_KEYS[backend])
    name = top.req_str("name", pattern=_NAME_RE, hint=_NAME_HINT)
    size_bytes = None
    if top.has("size"):
        size_bytes = _check_size(parse_size(top.raw["size"], top.path("size")),
                                 top.path("size"), top.raw["size"])
    kernel = top.section("kernel", _KERNEL_KEYS, required=backend == "kernel")
    spdk = top.section("spdk", _SPDK_KEYS, required=backend == "spdk")
    return device_spec(
        where, name=name, backend=backend, size_bytes=size_bytes,
        path=top.str_("path") if backend == "local" else None,
        create=top.bool_("create", False),
        kernel=_kernel(kernel) if kernel is not None else None,
        spdk=_spdk(spdk) if spdk is not None else None)


def device_spec(where: str, *, name: str, backend: str, size_bytes: int | None,
                path: str | None, create: bool, kernel: KernelOptions | None,
                spdk: SpdkOptions | None) -> DeviceSpec:
    """Check one device's top-level rules and return its :class:`DeviceSpec`.

    The backend sections are already typed (built by :func:`parse_kernel_options` /
    :func:`parse_spdk_options`); this checks what spans keys: the name, the size, and
    which keys the backend allows (``path`` and ``create`` are ``local``'s, ``kernel:``
    the kernel backend's, ``spdk:`` SPDK's).

    Raises:
        ValueError: naming the key path, e.g. ``flash.devices[0].kernel: required``.
    """
    kind = _backend(backend, where)
    present = {"path": bool(path), "create": create, "kernel": kernel is not None,
               "spdk": spdk is not None}
    for key, there in present.items():
        if there and key not in _TOP_KEYS[kind]:
            raise ValueError(f"{where}.{key}: unknown key; allowed keys: "
                             f"{', '.join(sorted(_TOP_KEYS[kind]))}")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"{where}.name: invalid value {name!r}{_NAME_HINT}")
    if size_bytes is not None:
        _check_size(size_bytes, f"{where}.size", size_bytes)
    if kind == "local":
        if not path:
            raise ValueError(f"{where}.path: required")
        if create and size_bytes is None:
            raise ValueError(f"{where}.size: required when create is true")
        return DeviceSpec(name, "local", size_bytes, path=path, create=create)
    if kind == "kernel":
        if kernel is None:
            raise ValueError(f"{where}.kernel: required")
        return DeviceSpec(name, "kernel", size_bytes, kernel=kernel)
    if spdk is None:
        raise ValueError(f"{where}.spdk: required")
    return DeviceSpec(name, "spdk", size_bytes, spdk=spdk)


def parse_kernel_options(raw: object, where: str) -> KernelOptions:
    """Validate a device's ``kernel:`` section (``where`` is its key path)."""
    return _kernel(_Section(raw, where, _KERNEL_KEYS))


def parse_spdk_options(raw: object, where: str) -> SpdkOptions:
    """Validate a device's ``spdk:`` section (``where`` is its key path)."""
    return _spdk(_Section(raw, where, _SPDK_KEYS))


def _backend(value: object, where: str) -> BackendKind:
    if value is None:
        raise ValueError(f"{where}.backend: required (one of: local, kernel, spdk)")
    if value not in _TOP_KEYS:
        raise ValueError(
            f"{where}.backend: invalid value {value!r}; expected one of: local, kernel, spdk")
    return cast(BackendKind, value)


def _check_size(size: int, where: str, given: object) -> int:
    if size < 1 << 20 or size % ALIGNMENT_BYTES:
        raise ValueError(
            f"{where}: {given!r} must be at least 1MiB and a multiple "
            f"of {ALIGNMENT_BYTES} bytes (extents are 4 KiB aligned)"
        )
    return size


def _kernel(s: _Section) -> KernelOptions:
    ctrl_loss = s.int_("ctrl_loss_tmo", minimum=-1)
    fast_fail = s.int_("fast_io_fail_tmo", minimum=-1)
    if (fast_fail is not None and fast_fail >= 0 and ctrl_loss is not None
            and ctrl_loss >= 0 and fast_fail >= ctrl_loss):
        raise ValueError(f"{s.path('fast_io_fail_tmo')}: {fast_fail} must be less than "
                         f"ctrl_loss_tmo ({ctrl_loss}), or the controller is removed before "
                         "I/O fails fast; lower it, or set ctrl_loss_tmo: -1")
    return KernelOptions(
        transport=s.choice("transport", _TRANSPORTS),
        traddr=s.req_str("traddr"),
        subnqn=s.req_str("subnqn", pattern=_NQN_RE, hint=_NQN_HINT),
        trsvcid=s.port("trsvcid", "4420"),
        hostnqn=s.str_("hostnqn", pattern=_NQN_RE, hint=_NQN_HINT),
        ctrl_loss_tmo=ctrl_loss,
        reconnect_delay=s.int_("reconnect_delay", minimum=1),
        fast_io_fail_tmo=fast_fail,
        nr_io_queues=s.int_("nr_io_queues", minimum=1, maximum=65535),
        nsid=s.int_("nsid", minimum=1, maximum=0xFFFFFFFE, default=1) or 1,
    )


def _spdk(s: _Section) -> SpdkOptions:
    trtype = s.choice("trtype", _TRANSPORTS)
    expose = s.choice("expose", _EXPOSE, default="ublk")
    ctrlr_loss = s.int_("ctrlr_loss_timeout_sec", minimum=-1)
    reconnect = s.int_("reconnect_delay_sec", minimum=0)
    fast_fail = s.int_("fast_io_fail_timeout_sec", minimum=0)
    _check_reconnect_rules(s, ctrlr_loss, reconnect, fast_fail)
    psk_key_name = s.str_("psk_key_name", pattern=_NAME_RE, hint=" (a keyring key name)")
    psk_path = s.str_("psk_path")
    if psk_path is not None and psk_key_name is None:
        raise ValueError(f"{s.path('psk_key_name')}: required when psk_path is set "
                         "(the name the PSK is loaded under in SPDK's keyring)")
    if psk_key_name is not None and trtype != "tcp":
        raise ValueError(f"{s.path('psk_key_name')}: a TLS PSK needs trtype tcp, not {trtype}")
    if s.has("ublk_id") and expose != "ublk":
        raise ValueError(f"{s.path('ublk_id')}: only valid with expose: ublk")
    if s.has("nbd_device") and expose != "nbd":
        raise ValueError(f"{s.path('nbd_device')}: only valid with expose: nbd")
    crypto_section = s.section("crypto", _CRYPTO_KEYS, required=False)
    export_section = s.section("export", _EXPORT_KEYS, required=False)
    return SpdkOptions(
        bdev_name=s.req_str("bdev_name", pattern=_NAME_RE, hint=_NAME_HINT),
        trtype=trtype,
        traddr=s.req_str("traddr"),
        subnqn=s.req_str("subnqn", pattern=_NQN_RE, hint=_NQN_HINT),
        rpc_socket=s.str_("rpc_socket", default="/var/tmp/spdk.sock") or "/var/tmp/spdk.sock",
        adrfam=s.choice("adrfam", _ADRFAM, default="ipv4"),
        trsvcid=s.port("trsvcid", "4420"),
        hostnqn=s.str_("hostnqn", pattern=_NQN_RE, hint=_NQN_HINT),
        psk_key_name=psk_key_name,
        psk_path=psk_path,
        ctrlr_loss_timeout_sec=ctrlr_loss,
        reconnect_delay_sec=reconnect,
        fast_io_fail_timeout_sec=fast_fail,
        nsid=s.int_("nsid", minimum=1, maximum=0xFFFFFFFE, default=1) or 1,
        crypto=_crypto(crypto_section) if crypto_section else CryptoOptions(),
        expose=expose,
        ublk_id=s.int_("ublk_id", minimum=0, maximum=(1 << 20) - 1),
        nbd_device=s.str_("nbd_device", pattern=re.compile(r"^/dev/nbd\d+$"),
                          hint=" (expected /dev/nbdN)"),
        export=_export(export_section) if export_section else None,
    )


def _check_reconnect_rules(s: _Section, ctrlr_loss: int | None, reconnect: int | None,
                           fast_fail: int | None) -> None:
    """SPDK's own rules for these three (schema.yaml, bdev_nvme_attach_controller)."""
    if reconnect is not None and ctrlr_loss is not None:
        if reconnect == 0 and ctrlr_loss != 0:
            raise ValueError(f"{s.path('ctrlr_loss_timeout_sec')}: must be 0 when "
                             "reconnect_delay_sec is 0 (SPDK rule)")
        if reconnect > 0 and ctrlr_loss != -1 and ctrlr_loss < reconnect:
            raise ValueError(f"{s.path('ctrlr_loss_timeout_sec')}: must be -1 or at least "
                             f"reconnect_delay_sec ({reconnect}) (SPDK rule)")
    if fast_fail:
        if reconnect is not None and fast_fail < reconnect:
            raise ValueError(f"{s.path('fast_io_fail_timeout_sec')}: must be at least "
                             f"reconnect_delay_sec ({reconnect}) (SPDK rule)")
        if ctrlr_loss is not None and ctrlr_loss != -1 and fast_fail >= ctrlr_loss:
            raise ValueError(f"{s.path('fast_io_fail_timeout_sec')}: must be less than "
                             f"ctrlr_loss_timeout_sec ({ctrlr_loss}) (SPDK rule)")


def _crypto(s: _Section) -> CryptoOptions:
    enabled = s.bool_("enabled", False)
    cipher = s.choice("cipher", _CIPHERS, default="AES_XTS")
    key_name = s.str_("key_name", pattern=_NAME_RE, hint=" (an accel crypto key name)")
    if enabled and key_name is None:
        raise ValueError(f"{s.path('key_name')}: required when crypto is enabled")
    return CryptoOptions(enabled=enabled, cipher=cipher, key_name=key_name or "",
                         key_file=s.str_("key_file"))


def _export(s: _Section) -> ExportOptions:
    hosts_raw = s.raw.get("hosts") or []
    if not isinstance(hosts_raw, list) or not all(
        isinstance(h, str) and _NQN_RE.match(h) for h in hosts_raw
    ):
        raise ValueError(f"{s.path('hosts')}: expected a list of host NQNs{_NQN_HINT}")
    allow_any_host = s.bool_("allow_any_host", False)
    if not allow_any_host and not hosts_raw:
        raise ValueError(f"{s.path('hosts')}: list the peer host NQNs allowed to connect, "
                         "or set allow_any_host: true (not recommended: any host could read "
                         "the device)")
    return ExportOptions(
        nqn=s.req_str("nqn", pattern=_NQN_RE, hint=_NQN_HINT),
        trtype=s.choice("trtype", _TRANSPORTS),
        traddr=s.req_str("traddr"),
        trsvcid=s.port("trsvcid", "4420"),
        adrfam=s.choice("adrfam", _ADRFAM, default="ipv4"),
        allow_any_host=allow_any_host,
        hosts=tuple(hosts_raw),
        serial_number=s.str_("serial_number", pattern=re.compile(r"^[\x20-\x7e]{1,20}$"),
                             hint=" (up to 20 printable ASCII characters)"),
    )
