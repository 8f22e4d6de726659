"""`spdk` backend: a remote NVMe-oF namespace through SPDK, exposed to Linux as ublk/nbd.

Attach, step by step (each step first queries SPDK and skips what already exists, so a
restarted service reuses the previous run's objects and never attaches twice):

1. TLS PSK: `keyring_get_keys`; `keyring_file_add_key` if `psk_path` is set and missing.
2. Controller: `bdev_nvme_get_controllers`; `bdev_nvme_attach_controller` if absent.
3. Crypto (optional): `accel_crypto_keys_get`; `accel_crypto_key_create` (AES_XTS) from
   `key_file` if the key is missing; `bdev_crypto_create` on the namespace bdev.
4. Expose: `ublk_get_disks` + `ublk_create_target` + `ublk_start_disk`, or
   `nbd_get_disks` + `nbd_start_disk`.
5. Export (optional): `nvmf_create_transport`, `nvmf_create_subsystem`,
   `nvmf_subsystem_add_ns`, `nvmf_subsystem_add_host`, `nvmf_subsystem_add_listener`.

Detach undoes these in reverse order. A failed attach leaves what it created; calling
attach again reuses it, and detach removes it. All requests come from spdk_requests.
"""

from __future__ import annotations

import os
import stat
import string
from typing import Any

from ctxmem_common.device_settings import DeviceSpec, SpdkOptions

from . import spdk_requests as rq
from .base import StorageBackend, StorageError
from .devices import Deadline, probe_o_direct, wait_for
from .spdk_rpc import SpdkRpcChannel, SpdkRpcError

__all__ = ["SpdkBackend", "read_xts_key_file"]

_JSONRPC_INVALID_PARAMS = -32602


class SpdkBackend(StorageBackend):
    """A device provisioned through SPDK's JSON-RPC interface.

    Args:
        spec: an `spdk` DeviceSpec.
        rpc_timeout_s: per-call bound outside attach (detach, health checks).
    """

    def __init__(self, spec: DeviceSpec, *, rpc_timeout_s: float = 30.0) -> None:
        if spec.backend != "spdk" or spec.spdk is None:
            raise ValueError(f"device {spec.name!r}: SpdkBackend needs an spdk spec")
        super().__init__(spec)
        self.opts: SpdkOptions = spec.spdk
        self.names = rq.SpdkNames.of(self.opts)
        self._rpc_timeout_s = rpc_timeout_s
        self._channel = SpdkRpcChannel(self.opts.rpc_socket, spec.name)

    @property
    def offloads_encryption(self) -> bool:
        # docstring inherited
        return self.opts.crypto.enabled

    # -- contract ---------------------------------------------------------------------

    def attach(self, timeout_s: float = 30.0) -> str:
        # docstring inherited
        deadline = Deadline(timeout_s)
        if self.opts.psk_key_name is not None:
            self._ensure_psk(deadline)
        self._ensure_controller(deadline)
        bdevs = self._bdevs(deadline)
        if self.names.namespace_bdev not in bdevs:
            raise StorageError(
                f"device {self.spec.name!r}: controller {self.names.controller} is attached "
                f"but bdev {self.names.namespace_bdev} (namespace {self.opts.nsid}) does not "
                f"exist; bdevs of this controller: "
                f"{sorted(b for b in bdevs if b.startswith(self.names.controller))}",
                f"check that subsystem {self.opts.subnqn} exports namespace "
                f"{self.opts.nsid}, or set spdk.nsid",
            )
        if self.opts.crypto.enabled and self.names.crypto_bdev not in bdevs:
            self._create_crypto_bdev(deadline)
        top = self.names.top_bdev(self.opts)
        path = self._ensure_exposed(top, deadline)
        if self.opts.export is not None:
            self._ensure_export(top, deadline)
        if wait_for(lambda: True if os.path.exists(path) else None, deadline) is None:
            raise StorageError(
                f"device {self.spec.name!r}: SPDK exposes bdev {top} as {path}, but {path} "
                f"did not appear within {timeout_s:g}s",
                "check that ctxmem sees the same /dev as SPDK (mount /dev into both "
                "containers) and that the ublk/nbd kernel driver is loaded",
            )
        probe_o_direct(path, self.spec.name)
        info = self._bdevs(deadline).get(top, {})
        bdev_bytes = int(info.get("block_size", 0)) * int(info.get("num_blocks", 0))
        self._size_bytes = self._usable_size(bdev_bytes, f"bdev {top}")
        self._path = path
        return path

    def detach(self) -> None:
        # docstring inherited
        deadline = Deadline(self._rpc_timeout_s * 4)
        opts, names = self.opts, self.names
        top = names.top_bdev(opts)
        if opts.export is not None and any(
            s.get("nqn") == opts.export.nqn for s in self._call(rq.nvmf_get_subsystems(), deadline)
        ):
            self._call(rq.nvmf_delete_subsystem(opts.export), deadline)
        if opts.expose == "ublk":
            for disk in self._call(rq.ublk_get_disks(), deadline):
                if disk.get("bdev_name") == top:
                    self._call(rq.ublk_stop_disk(int(disk["id"])), deadline)
        else:
            for disk in self._call(rq.nbd_get_disks(), deadline):
                if disk.get("bdev_name") == top:
                    self._call(rq.nbd_stop_disk(str(disk["nbd_device"])), deadline)
        if opts.crypto.enabled:
            if names.crypto_bdev in self._bdevs(deadline):
                self._call(rq.bdev_crypto_delete(names), deadline)
            # Only a key ctxmem loaded itself (from key_file) is ctxmem's to destroy.
            if opts.crypto.key_file is not None and self._crypto_key_exists(deadline):
                self._call(rq.accel_crypto_key_destroy(opts), deadline)
        if self._controller(deadline) is not None:
            self._call(rq.detach_controller(names), deadline)
        if opts.psk_path is not None and opts.psk_key_name in self._keyring_names(deadline):
            self._call(rq.keyring_file_remove_key(opts), deadline)
        self._path = None
        self._size_bytes = None

    def is_healthy(self) -> bool:
        # docstring inherited
        if self._path is None or not os.path.exists(self._path):
            return False
        try:
            controller = self._controller(Deadline(min(self._rpc_timeout_s, 2.0)))
        except StorageError:
            return False
        return controller is not None and any(
            c.get("state") == "enabled" for c in controller.get("ctrlrs", [])
        )

    def close(self) -> None:
        # docstring inherited
        self._channel.close()

    # -- steps ------------------------------------------------------------------------

    def _call(self, request: rq.RpcRequest, deadline: Deadline) -> Any:
        return self._channel.call(request, deadline.remaining(minimum=1.0))

    def _bdevs(self, deadline: Deadline) -> dict[str, dict[str, Any]]:
        return {b["name"]: b for b in self._call(rq.get_bdevs(), deadline)}

    def _controller(self, deadline: Deadline) -> dict[str, Any] | None:
        for ctrl in self._call(rq.get_controllers(), deadline):
            if ctrl.get("name") == self.names.controller:
                return dict(ctrl)
        return None

    def _keyring_names(self, deadline: Deadline) -> set[str]:
        return {k.get("name", "") for k in self._call(rq.keyring_get_keys(), deadline)}

    def _ensure_psk(self, deadline: Deadline) -> None:
        if self.opts.psk_key_name in self._keyring_names(deadline):
            return
        if self.opts.psk_path is None:
            raise StorageError(
                f"device {self.spec.name!r}: TLS PSK {self.opts.psk_key_name!r} is not in "
                "SPDK's keyring",
                "load it (keyring_file_add_key) in SPDK's startup config, or set "
                "spdk.psk_path so ctxmem loads it",
            )
        self._call(rq.keyring_file_add_key(self.opts), deadline)

    def _ensure_controller(self, deadline: Deadline) -> None:
        existing = self._controller(deadline)
        if existing is None:
            self._call(rq.attach_controller(self.opts), deadline)
            return
        o = self.opts
        for ctrlr in existing.get("ctrlrs", []):
            trid = ctrlr.get("trid", {})
            if (str(trid.get("trtype", "")).lower() == o.trtype and trid.get("traddr") == o.traddr
                    and str(trid.get("trsvcid")) == o.trsvcid and trid.get("subnqn") == o.subnqn):
                return  # attached by an earlier run: reuse
        raise StorageError(
            f"device {self.spec.name!r}: SPDK controller {self.names.controller!r} already "
            f"exists but is attached to {[c.get('trid') for c in existing.get('ctrlrs', [])]}, "
            f"not {o.trtype}://{o.traddr}:{o.trsvcid} {o.subnqn}",
            f"choose another spdk.bdev_name, or detach the other controller "
            f"(bdev_nvme_detach_controller {self.names.controller})",
        )

    def _crypto_key_exists(self, deadline: Deadline) -> bool:
        try:
            return bool(self._call(rq.accel_crypto_keys_get(self.opts.crypto.key_name), deadline))
        except SpdkRpcError as ex:
            if ex.code == _JSONRPC_INVALID_PARAMS or "not found" in ex.spdk_message.lower():
                return False
            raise

    def _create_crypto_bdev(self, deadline: Deadline) -> None:
        crypto = self.opts.crypto
        if not self._crypto_key_exists(deadline):
            if crypto.key_file is None:
                raise StorageError(
                    f"device {self.spec.name!r}: accel crypto key {crypto.key_name!r} is not "
                    "loaded in SPDK",
                    "create it in SPDK's startup config (accel_crypto_key_create), or set "
                    "spdk.crypto.key_file so ctxmem loads it",
                )
            key, key2 = read_xts_key_file(crypto.key_file, self.spec.name)
            self._call(rq.accel_crypto_key_create(self.opts, key, key2), deadline)
        self._call(rq.bdev_crypto_create(self.opts, self.names), deadline)

    def _ensure_exposed(self, bdev: str, deadline: Deadline) -> str:
        if self.opts.expose == "nbd":
            return self._ensure_nbd(bdev, deadline)
        disks = list(self._call(rq.ublk_get_disks(), deadline))
        for disk in disks:
            if disk.get("bdev_name") == bdev:
                return str(disk["ublk_device"])
        used = {int(d["id"]): d.get("bdev_name") for d in disks}
        ublk_id = self.opts.ublk_id
        if ublk_id is None:
            ublk_id = min(set(range(len(used) + 1)) - set(used))
        elif ublk_id in used:
            raise StorageError(
                f"device {self.spec.name!r}: ublk id {ublk_id} is already used by bdev "
                f"{used[ublk_id]!r}", "set spdk.ublk_id to a free id, or leave it unset",
            )
        if not disks:
            try:
                self._call(rq.ublk_create_target(), deadline)
            except SpdkRpcError as ex:  # EBUSY: the target exists (an earlier run made it)
                if "busy" not in ex.spdk_message.lower():
                    raise
        self._call(rq.ublk_start_disk(bdev, ublk_id), deadline)
        for disk in self._call(rq.ublk_get_disks(), deadline):
            if disk.get("bdev_name") == bdev:
                return str(disk["ublk_device"])
        return f"/dev/ublkb{ublk_id}"

    def _ensure_nbd(self, bdev: str, deadline: Deadline) -> str:
        for disk in self._call(rq.nbd_get_disks(), deadline):
            if disk.get("bdev_name") == bdev:
                return str(disk["nbd_device"])
        result = self._call(rq.nbd_start_disk(bdev, self.opts.nbd_device), deadline)
        if isinstance(result, str) and result:
            return result  # recent SPDK returns the device path
        for disk in self._call(rq.nbd_get_disks(), deadline):
            if disk.get("bdev_name") == bdev:
                return str(disk["nbd_device"])
        raise StorageError(
            f"device {self.spec.name!r}: nbd_start_disk for bdev {bdev} succeeded but "
            "nbd_get_disks does not list it",
            "check SPDK's log; set spdk.nbd_device explicitly",
        )

    def _ensure_export(self, bdev: str, deadline: Deadline) -> None:
        export = self.opts.export
        assert export is not None
        transports = self._call(rq.nvmf_get_transports(), deadline)
        if not any(str(t.get("trtype", "")).lower() == export.trtype for t in transports):
            self._call(rq.nvmf_create_transport(export), deadline)
        subsystem: dict[str, Any] = {}
        for sub in self._call(rq.nvmf_get_subsystems(), deadline):
            if sub.get("nqn") == export.nqn:
                subsystem = dict(sub)
        if not subsystem:
            self._call(rq.nvmf_create_subsystem(export), deadline)
        if not any(ns.get("bdev_name") == bdev for ns in subsystem.get("namespaces", [])):
            self._call(rq.nvmf_subsystem_add_ns(export, bdev), deadline)
        allowed = {h.get("nqn") for h in subsystem.get("hosts", [])}
        for host in export.hosts:
            if host not in allowed:
                self._call(rq.nvmf_subsystem_add_host(export, host), deadline)
        if not any(
            str(la.get("trtype", "")).lower() == export.trtype and la.get("traddr") == export.traddr
            and str(la.get("trsvcid")) == export.trsvcid
            for la in subsystem.get("listen_addresses", [])
        ):
            self._call(rq.nvmf_subsystem_add_listener(export), deadline)


def read_xts_key_file(path: str, device_name: str) -> tuple[str, str]:
    """Read an AES-XTS key for `accel_crypto_key_create` from a 0600 file.

    The file holds hex, either one string (the 256- or 512-bit XTS key, split in two
    halves) or two whitespace-separated strings (key and key2, 128 or 256 bits each).

    Raises:
        StorageError: unreadable, readable by group/others, or not a valid XTS key.
    """
    try:
        st = os.stat(path)
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise StorageError(
                f"device {device_name!r}: crypto key file {path} is accessible by group or "
                f"others (mode {stat.filemode(st.st_mode)})",
                f"chmod 600 {path}",
            )
        with open(path, encoding="ascii") as handle:
            parts = handle.read().split()
    except (OSError, UnicodeDecodeError) as ex:
        raise StorageError(
            f"device {device_name!r}: cannot read crypto key file {path}: {ex}",
            f"check that {path} exists and is readable by the service user",
            errno=getattr(ex, "errno", None),
        ) from ex
    if len(parts) == 1 and len(parts[0]) in (64, 128):
        half = len(parts[0]) // 2
        parts = [parts[0][:half], parts[0][half:]]
    hexdigits = set(string.hexdigits)
    if (len(parts) != 2 or len(parts[0]) != len(parts[1]) or len(parts[0]) not in (32, 64)
            or not all(set(p) <= hexdigits for p in parts)):
        raise StorageError(
            f"device {device_name!r}: crypto key file {path} does not hold an AES-XTS key",
            "write 64 or 128 hex digits (AES-128-XTS or AES-256-XTS), e.g. "
            "`openssl rand -hex 64 > FILE`",
        )
    if parts[0].lower() == parts[1].lower():
        raise StorageError(
            f"device {device_name!r}: crypto key file {path}: the two XTS key halves are "
            "equal, which XTS forbids",
            "generate a new random key (openssl rand -hex 64)",
        )
    return parts[0], parts[1]
