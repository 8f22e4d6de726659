"""Wiring: config → storage backends → block store → control plane and data servers.

Start order: attach flash devices (each backend idempotent), open the store (rebuilds
the index from flash), start the data servers, then the gRPC server, then report ready.
Stop order is the reverse; the store flushes write-back blocks before closing devices.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import uuid
from dataclasses import asdict
from pathlib import Path

import grpc

from ctxmem_common.config import Config
from ctxmem_common.errors import ConfigError
from ctxmem_common.proto import ctxmem_pb2_grpc as pb_grpc
from ctxmem_dpu.control.servicer import ContextMemoryServicer
from ctxmem_dpu.metrics import HttpEndpoint
from ctxmem_dpu.storage import DeviceSpec, StorageBackend, open_backend, parse_device_spec
from ctxmem_dpu.store import BlockStore
from ctxmem_dpu.transport.rdma import RdmaServer
from ctxmem_dpu.transport.shm import ShmServer
from ctxmem_dpu.transport.tcp import TcpDataServer

log = logging.getLogger(__name__)


def split_hostport(value: str, what: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"{what}: expected HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def load_master_key(cfg: Config) -> bytes | None:
    """The 32-byte master key from the key file or the environment; never logged.

    A configured key file that does not exist yet is created (0600) with a fresh key,
    so a first start works; a file with the wrong content is an error, never replaced.
    """
    enc = cfg.encryption
    if not enc.enabled:
        return None
    if enc.key_env and os.environ.get(enc.key_env):
        raw = os.environ[enc.key_env].strip()
        source = f"environment variable {enc.key_env}"
    elif enc.key_file:
        path = Path(enc.key_file)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
            log.warning("created a new encryption master key file at %s (mode 0600)", path)
        raw = path.read_text().strip()
        source = f"key file {path}"
    else:
        raise ConfigError(
            "encryption.enabled is true but no key is configured: set encryption.key_file, "
            f"or the environment variable named by encryption.key_env ({enc.key_env!r}), or "
            "set encryption.enabled: false"
        )
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise ConfigError(f"encryption master key from {source} must be 64 hex characters "
                          f"(32 bytes); it is not (content not shown)")
    return key


class Service:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.instance_id = uuid.uuid4().hex
        self.backends: list[StorageBackend] = []
        self.store: BlockStore | None = None
        self.server: grpc.aio.Server | None = None
        self.shm: ShmServer | None = None
        self.tcp: TcpDataServer | None = None
        self.rdma: RdmaServer | None = None
        self.http: HttpEndpoint | None = None
        self.ready = False
        self.grpc_port = 0

    def _device_specs(self) -> list[DeviceSpec]:
        specs = []
        for i, dev in enumerate(self.cfg.flash.devices):
            raw = {k: v for k, v in asdict(dev).items()
                   if v not in ({}, "", None) and (k, v) != ("create", False)}
            if not raw.get("size"):
                raw.pop("size", None)
            specs.append(parse_device_spec(raw, f"flash.devices[{i}]"))
        return specs

    async def start(self) -> None:
        cfg = self.cfg
        master_key = load_master_key(cfg)
        specs = self._device_specs()
        flash_paths: list[tuple[str, str]] = []
        crypto_off: list[str] = []
        loop = asyncio.get_running_loop()
        for spec in specs:
            backend = open_backend(spec)
            path = await loop.run_in_executor(None, backend.attach)
            self.backends.append(backend)
            flash_paths.append((backend.spec.name, path))
            if backend.offloads_encryption:
                crypto_off.append(backend.spec.name)
        self.store = BlockStore(cfg, flash_paths, master_key, crypto_off)
        for backend in self.backends:  # where a failed device is now (see _usable_again)
            self.store.locators[backend.spec.name] = backend.locate
        await self.store.start()

        data_endpoint = ""
        if "tcp" in cfg.service.transports:
            host, port = split_hostport(cfg.service.data_listen, "service.data_listen")
            self.tcp = TcpDataServer(self.store, host, port)
            await self.tcp.start()
            data_endpoint = f"{host}:{self.tcp.port}"
        shm_path = ""
        if "shm" in cfg.service.transports:
            self.shm = ShmServer(self.store, cfg.service.shm_socket)
            await self.shm.start()
            shm_path = cfg.service.shm_socket
        if "rdma" in cfg.service.transports:  # RDMA (issue 3): opens the verbs device
            self.rdma = RdmaServer(self.store, cfg.service.rdma_listen, cfg.service.rdma_device,
                                   cfg.service.rdma_gid_index, cfg.service.rdma_access)
            await self.rdma.start()

        self.server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.so_reuseport", 0),
        ])
        servicer = ContextMemoryServicer(self.store, self.instance_id, shm_path, data_endpoint,
                                         self.health)
        pb_grpc.add_ContextMemoryServicer_to_server(servicer, self.server)
        servicer.rdma = self.rdma  # RdmaInfo/RdmaAttach answer UNAVAILABLE without it
        listen = cfg.service.listen
        self.grpc_port = self.server.add_insecure_port(listen)
        if self.grpc_port == 0:
            raise ConfigError(f"service.listen: cannot bind {listen!r} (in use, or bad address)")
        await self.server.start()
        if cfg.metrics.listen:
            host, port = split_hostport(cfg.metrics.listen, "metrics.listen")
            self.http = HttpEndpoint(self.store, host, port, lambda: self.ready)
            await self.http.start()
        self.ready = True
        log.info("ctxmem serving (%s mode): grpc %s, transports %s, %d flash device(s)",
                 cfg.mode, listen, ",".join(cfg.service.transports), len(flash_paths))

    def health(self) -> str:
        if self.store is None:
            return "starting"
        bad = [d.name for d in self.store.flash.devices if not d.healthy]
        return f"degraded: flash device(s) {', '.join(bad)} failed" if bad else "serving"

    async def stop(self, grace_s: float = 5.0) -> None:
        self.ready = False
        if self.rdma is not None:  # first, so its long-lived RdmaAttach calls end
            await self.rdma.close()
        if self.server is not None:
            await self.server.stop(grace_s)
        for srv in (self.http, self.tcp, self.shm):
            if srv is not None:
                await srv.close()
        if self.store is not None:
            await self.store.close()
        for backend in self.backends:
            try:
                backend.detach()
            except Exception:
                log.exception("detaching flash device %s failed", backend.spec.name)


async def serve(cfg: Config, ready_file: str | None = None) -> None:
    svc = Service(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await svc.start()
        if ready_file:
            Path(ready_file).write_text(f"{svc.grpc_port}\n")
        await stop.wait()
        log.info("shutting down")
    finally:
        await svc.stop()
