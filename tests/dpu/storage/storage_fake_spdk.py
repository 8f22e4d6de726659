"""A fake SPDK JSON-RPC server for tests. It is NOT SPDK.

It listens on a Unix socket, speaks the same JSON-RPC framing as SPDK (so the real
`spdk.rpc.client.JSONRPCClient` talks to it unchanged), records every request it
receives, and answers the ~27 methods ctxmem uses from a small in-memory model of SPDK
state (controllers, bdevs, keys, ublk/nbd disks, NVMe-oF subsystems). Result shapes
follow SPDK's RPC handlers; unknown methods get SPDK's "Method not found" error.

It is deliberately stricter than SPDK in one way: deleting anything that another object
still uses (a bdev under a crypto bdev, ublk/nbd disk or subsystem namespace) is an
error, so tests prove that teardown runs in the right order.

What it proves: which requests ctxmem sends, in what order, and how ctxmem reacts to
results and errors. What it cannot prove: that SPDK accepts the requests (the schema
tests check names and types against SPDK's own schema; only a real target proves more).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
EEXIST, ENOENT, ENODEV, EBUSY = 17, 2, 19, 16


class RpcFault(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Recorded:
    method: str
    params: dict[str, Any] | None
    id: Any


@dataclass
class FakeState:
    keyring: dict[str, str] = field(default_factory=dict)
    controllers: dict[str, dict[str, Any]] = field(default_factory=dict)
    bdevs: dict[str, dict[str, Any]] = field(default_factory=dict)
    accel_keys: dict[str, dict[str, Any]] = field(default_factory=dict)
    crypto: dict[str, str] = field(default_factory=dict)  # crypto bdev -> base bdev
    ublk_target: bool = False
    ublk: dict[int, str] = field(default_factory=dict)  # id -> bdev
    nbd: dict[str, str] = field(default_factory=dict)  # device path -> bdev
    transports: list[str] = field(default_factory=list)
    subsystems: dict[str, dict[str, Any]] = field(default_factory=dict)


class FakeSpdk:
    """Start with `start()`, stop with `stop()`; `requests` lists what was received.

    Args:
        socket_path: where to listen.
        dev_dir: where fake ublk/nbd device files are created (sparse, bdev-sized).
        namespace_bytes: size of each namespace bdev an attach creates.
        nsids: namespaces the fake remote subsystem has.
    """

    def __init__(self, socket_path: str, dev_dir: Path, *, namespace_bytes: int = 64 << 20,
                 nsids: tuple[int, ...] = (1,)) -> None:
        self.socket_path = socket_path
        self.dev_dir = dev_dir
        self.namespace_bytes = namespace_bytes
        self.nsids = nsids
        self.state = FakeState()
        self.requests: list[Recorded] = []
        self.faults: dict[str, RpcFault] = {}
        self.delays: dict[str, float] = {}
        self.controller_state = "enabled"
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()

    # -- test API ---------------------------------------------------------------------

    def fail_next(self, method: str, code: int, message: str) -> None:
        """Answer the next call of `method` with this JSON-RPC error."""
        self.faults[method] = RpcFault(code, message)

    def delay_next(self, method: str, seconds: float) -> None:
        """Answer the next call of `method` only after `seconds`."""
        self.delays[method] = seconds

    def methods(self) -> list[str]:
        return [r.method for r in self.requests]

    def clear(self) -> None:
        self.requests.clear()

    def start(self) -> FakeSpdk:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.socket_path)
        self._sock.listen(8)
        self._sock.settimeout(0.2)
        thread = threading.Thread(target=self._accept_loop, name="fake-spdk", daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

    # -- server -----------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(0.2)
        buf = ""
        decoder = json.JSONDecoder()
        with conn:
            while not self._stopping.is_set():
                try:
                    data = conn.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not data:
                    return
                buf += data.decode()
                while buf.strip():
                    try:
                        request, end = decoder.raw_decode(buf.lstrip())
                    except ValueError:
                        break  # partial request
                    buf = buf.lstrip()[end:]
                    delay = self.delays.pop(request.get("method", ""), 0.0)
                    if delay:
                        time.sleep(delay)
                    try:
                        conn.sendall(json.dumps(self._handle(request)).encode())
                    except OSError:
                        return  # the client gave up (e.g. its timeout expired)

    def _handle(self, request: dict[str, Any]) -> dict[str, Any]:
        method = request.get("method", "")
        params = request.get("params")
        with self._lock:
            self.requests.append(Recorded(method, params, request.get("id")))
            try:
                fault = self.faults.pop(method, None)
                if fault is not None:
                    raise fault
                handler = getattr(self, "_m_" + method, None)
                if handler is None:
                    raise RpcFault(METHOD_NOT_FOUND, "Method not found")
                result = handler(dict(params or {}))
            except RpcFault as f:
                return {"jsonrpc": "2.0", "id": request.get("id"),
                        "error": {"code": f.code, "message": f.message}}
        return {"jsonrpc": "2.0", "id": request.get("id"), "result": result}

    # -- helpers ----------------------------------------------------------------------

    def _claimed(self, bdev: str) -> str | None:
        s = self.state
        if bdev in s.crypto.values():
            return "crypto bdev"
        if bdev in s.ublk.values() or bdev in s.nbd.values():
            return "ublk/nbd disk"
        for sub in s.subsystems.values():
            if any(ns["bdev_name"] == bdev for ns in sub["namespaces"]):
                return "nvmf subsystem " + sub["nqn"]
        return None

    def _add_bdev(self, name: str, num_bytes: int, product: str) -> None:
        self.state.bdevs[name] = {"name": name, "aliases": [], "product_name": product,
                                  "block_size": 4096, "num_blocks": num_bytes // 4096,
                                  "claimed": False}

    def _device_file(self, name: str, bdev: str) -> str:
        path = self.dev_dir / name
        with open(path, "wb") as handle:
            bdev_info = self.state.bdevs[bdev]
            handle.truncate(bdev_info["block_size"] * bdev_info["num_blocks"])
        return str(path)

    # -- methods (names as in SPDK; results shaped like SPDK's) ------------------------

    def _m_bdev_get_bdevs(self, p: dict[str, Any]) -> list[dict[str, Any]]:
        return [dict(b, claimed=self._claimed(n) is not None) for n, b in self.state.bdevs.items()]

    def _m_bdev_nvme_get_controllers(self, p: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"name": n, "ctrlrs": [{"state": self.controller_state, "trid": c}]}
                for n, c in self.state.controllers.items()]

    def _m_bdev_nvme_attach_controller(self, p: dict[str, Any]) -> list[str]:
        name = p["name"]
        if name in self.state.controllers:
            raise RpcFault(-114, "Operation already in progress")
        if p.get("psk") is not None and p["psk"] not in self.state.keyring:
            raise RpcFault(INVALID_PARAMS, f"Could not load PSK: {p['psk']}")
        self.state.controllers[name] = {
            "trtype": p["trtype"].upper(), "adrfam": "IPv4", "traddr": p["traddr"],
            "trsvcid": p.get("trsvcid", ""), "subnqn": p.get("subnqn", "")}
        for nsid in self.nsids:
            self._add_bdev(f"{name}n{nsid}", self.namespace_bytes, "NVMe disk")
        return [f"{name}n{nsid}" for nsid in self.nsids]

    def _m_bdev_nvme_detach_controller(self, p: dict[str, Any]) -> bool:
        if self.state.controllers.pop(p["name"], None) is None:
            raise RpcFault(-ENODEV, "No such device")
        for nsid in self.nsids:
            bdev = f"{p['name']}n{nsid}"
            if self._claimed(bdev):
                raise RpcFault(-EBUSY, f"bdev {bdev} still used by {self._claimed(bdev)}")
            self.state.bdevs.pop(bdev, None)
        return True

    def _m_keyring_get_keys(self, p: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"name": n, "removed": False, "probed": True, "refcnt": 1,
                 "module": "keyring_file", "path": path} for n, path in self.state.keyring.items()]

    def _m_keyring_file_add_key(self, p: dict[str, Any]) -> bool:
        if p["name"] in self.state.keyring:
            raise RpcFault(-EEXIST, "File exists")
        if not os.path.exists(p["path"]):
            raise RpcFault(-ENOENT, "No such file or directory")
        self.state.keyring[p["name"]] = p["path"]
        return True

    def _m_keyring_file_remove_key(self, p: dict[str, Any]) -> bool:
        if self.state.keyring.pop(p["name"], None) is None:
            raise RpcFault(-ENODEV, "No such device")
        return True

    def _m_accel_crypto_keys_get(self, p: dict[str, Any]) -> list[dict[str, Any]]:
        name = p.get("key_name")
        if name is not None and name not in self.state.accel_keys:
            raise RpcFault(INVALID_PARAMS, "key was not found\n")
        return [k for n, k in self.state.accel_keys.items() if name in (None, n)]

    def _m_accel_crypto_key_create(self, p: dict[str, Any]) -> bool:
        if p["name"] in self.state.accel_keys:
            raise RpcFault(INVALID_PARAMS, "failed to create DEK, rc -17")
        self.state.accel_keys[p["name"]] = dict(p)
        return True

    def _m_accel_crypto_key_destroy(self, p: dict[str, Any]) -> bool:
        if p["key_name"] not in self.state.accel_keys:
            raise RpcFault(INVALID_PARAMS, "No key object found")
        self.state.accel_keys.pop(p["key_name"])
        return True

    def _m_bdev_crypto_create(self, p: dict[str, Any]) -> str:
        base, name = p["base_bdev_name"], p["name"]
        if base not in self.state.bdevs or p.get("key_name") not in self.state.accel_keys:
            raise RpcFault(-ENODEV, "No such device")
        if self._claimed(base):
            raise RpcFault(-EBUSY, "Device or resource busy")
        self.state.crypto[name] = base
        b = self.state.bdevs[base]
        self._add_bdev(name, b["block_size"] * b["num_blocks"], "crypto")
        return name

    def _m_bdev_crypto_delete(self, p: dict[str, Any]) -> bool:
        name = p["name"]
        if name not in self.state.crypto:
            raise RpcFault(-ENODEV, "No such device")
        if self._claimed(name):
            raise RpcFault(-EBUSY, f"bdev {name} still used by {self._claimed(name)}")
        del self.state.crypto[name]
        del self.state.bdevs[name]
        return True

    def _m_ublk_create_target(self, p: dict[str, Any]) -> bool:
        if self.state.ublk_target:
            raise RpcFault(INTERNAL_ERROR, "Device or resource busy")
        self.state.ublk_target = True
        return True

    def _m_ublk_get_disks(self, p: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"ublk_device": str(self.dev_dir / f"ublkb{i}"), "id": i, "queue_depth": 128,
                 "num_queues": 1, "bdev_name": b} for i, b in sorted(self.state.ublk.items())]

    def _m_ublk_start_disk(self, p: dict[str, Any]) -> int:
        if not self.state.ublk_target:
            raise RpcFault(-ENODEV, "No such device")
        ublk_id, bdev = p["ublk_id"], p["bdev_name"]
        if ublk_id in self.state.ublk or bdev not in self.state.bdevs or self._claimed(bdev):
            raise RpcFault(-EEXIST, "File exists")
        self.state.ublk[ublk_id] = bdev
        self._device_file(f"ublkb{ublk_id}", bdev)
        return int(ublk_id)

    def _m_ublk_stop_disk(self, p: dict[str, Any]) -> bool:
        if self.state.ublk.pop(p["ublk_id"], None) is None:
            raise RpcFault(-ENODEV, "No such device")
        (self.dev_dir / f"ublkb{p['ublk_id']}").unlink()
        return True

    def _m_nbd_get_disks(self, p: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"nbd_device": d, "bdev_name": b} for d, b in self.state.nbd.items()]

    def _m_nbd_start_disk(self, p: dict[str, Any]) -> str:
        bdev = p["bdev_name"]
        if bdev not in self.state.bdevs or self._claimed(bdev):
            raise RpcFault(INVALID_PARAMS, "Invalid parameters")
        device = p.get("nbd_device")
        index = 0
        while device is None:
            candidate = str(self.dev_dir / f"nbd{index}")
            device = None if candidate in self.state.nbd else candidate
            index += 1
        name = os.path.basename(device)
        path = self._device_file(name, bdev)
        self.state.nbd[path] = bdev
        return path

    def _m_nbd_stop_disk(self, p: dict[str, Any]) -> bool:
        if self.state.nbd.pop(p["nbd_device"], None) is None:
            raise RpcFault(INVALID_PARAMS, "Invalid parameters")
        os.unlink(p["nbd_device"])
        return True

    def _m_nvmf_get_transports(self, p: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"trtype": t.upper(), "max_queue_depth": 128} for t in self.state.transports]

    def _m_nvmf_create_transport(self, p: dict[str, Any]) -> bool:
        if p["trtype"].lower() in self.state.transports:
            raise RpcFault(INVALID_PARAMS, "Transport type already exists")
        self.state.transports.append(p["trtype"].lower())
        return True

    def _m_nvmf_get_subsystems(self, p: dict[str, Any]) -> list[dict[str, Any]]:
        discovery = {"nqn": "nqn.2014-08.org.nvmexpress.discovery", "subtype": "Discovery",
                     "listen_addresses": [], "allow_any_host": True, "hosts": []}
        return [discovery, *self.state.subsystems.values()]

    def _sub(self, nqn: str) -> dict[str, Any]:
        if nqn not in self.state.subsystems:
            raise RpcFault(INVALID_PARAMS, f"Unable to find subsystem with NQN {nqn}")
        return self.state.subsystems[nqn]

    def _m_nvmf_create_subsystem(self, p: dict[str, Any]) -> bool:
        if p["nqn"] in self.state.subsystems:
            raise RpcFault(INVALID_PARAMS, "Unable to create subsystem")
        self.state.subsystems[p["nqn"]] = {
            "nqn": p["nqn"], "subtype": "NVMe", "listen_addresses": [], "hosts": [],
            "allow_any_host": bool(p.get("allow_any_host")), "namespaces": []}
        return True

    def _m_nvmf_delete_subsystem(self, p: dict[str, Any]) -> bool:
        if self.state.subsystems.pop(p["nqn"], None) is None:
            raise RpcFault(INVALID_PARAMS, "Invalid parameters")
        return True

    def _m_nvmf_subsystem_add_ns(self, p: dict[str, Any]) -> int:
        sub, ns = self._sub(p["nqn"]), p["namespace"]
        if ns["bdev_name"] not in self.state.bdevs:
            raise RpcFault(INVALID_PARAMS, "Invalid parameters")
        nsid = len(sub["namespaces"]) + 1
        sub["namespaces"].append({"nsid": nsid, "bdev_name": ns["bdev_name"]})
        return nsid

    def _m_nvmf_subsystem_add_host(self, p: dict[str, Any]) -> bool:
        self._sub(p["nqn"])["hosts"].append({"nqn": p["host"]})
        return True

    def _m_nvmf_subsystem_add_listener(self, p: dict[str, Any]) -> bool:
        la = dict(p["listen_address"])
        la["trtype"] = la["trtype"].upper()
        self._sub(p["nqn"])["listen_addresses"].append(la)
        return True


@contextlib.contextmanager
def serve_fake_spdk(dev_dir: Path, **kwargs: Any) -> Iterator[FakeSpdk]:
    """Run a FakeSpdk (NOT SPDK) on a fresh short socket path; stop it afterwards."""
    sock_dir = tempfile.mkdtemp(prefix="ctxmem-spdk-")  # AF_UNIX paths max 108 bytes
    dev_dir.mkdir(parents=True, exist_ok=True)
    server = FakeSpdk(f"{sock_dir}/spdk.sock", dev_dir, **kwargs).start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
