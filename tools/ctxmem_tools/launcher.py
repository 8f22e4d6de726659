"""Start a ctxmem service as a child process (for ``ctxmem demo``, ``ctxmem bench`` and
tests). The service is launched by command (``python -m ctxmem_dpu serve``), never
imported: the shim and the service stay separate programs."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct free ports: all bound at once, then released (two
    :func:`free_port` calls in a row may return the same port)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def local_config(workdir: Path, *, encryption: bool = True, dram_size: str = "128MiB",
                 dram_slab: str = "8MiB", flash_size: str | None = "256MiB",
                 flash_slab: str = "16MiB", flash_path: str | None = None,
                 write_policy: str = "write_back", transports: list[str] | None = None,
                 lease_ttl_s: float = 30.0, allocation_ttl_s: float = 30.0,
                 **sections: Any) -> dict[str, Any]:
    """A fallback-mode config on loopback with files under ``workdir`` (free ports).

    ``workdir`` should be private (pytest's ``tmp_path``, ``tempfile.mkdtemp``: mode
    0700): the service refuses a directory others can write (ctxmem_common.safepaths)."""
    workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    key_file = workdir / "master.key"
    if not key_file.exists():  # created 0600 from the start: never readable by others
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    cfg: dict[str, Any] = {
        "mode": "fallback",
        "service": {
            "listen": f"127.0.0.1:{free_port()}",
            "data_listen": "127.0.0.1:0",
            "shm_socket": str(workdir / "data.sock"),
            "transports": transports or ["shm", "tcp"],
            "lease_ttl_s": lease_ttl_s,
            "allocation_ttl_s": allocation_ttl_s,
            "insecure": True,  # loopback only; pass service={"tenant_tokens": ...} for tokens
        },
        "metrics": {"listen": f"127.0.0.1:{free_port()}"},
        "dram": {"size": dram_size, "slab_size": dram_slab},
        "flash": {"write_policy": write_policy, "slab_size": flash_slab, "devices": []},
        "encryption": {"enabled": encryption, "key_file": str(key_file)},
        "logging": {"level": "info"},
    }
    if flash_size:
        cfg["flash"]["devices"] = [{
            "name": "flash0", "backend": "local",
            "path": flash_path or str(workdir / "flash0.img"), "size": flash_size,
            "create": True}]
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    if cfg["service"].get("tenant_tokens"):
        cfg["service"]["insecure"] = False  # tokens mode: the two modes are exclusive
    return cfg


class ServiceProcess:
    """A running ``ctxmem serve``; restartable on the same ports and files."""

    def __init__(self, workdir: Path, config: dict[str, Any] | None = None,
                 config_path: Path | None = None, start: bool = True,
                 prefix: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        # Run the service under this command (``["ip", "netns", "exec", NAME]``: a node
        # in its own network namespace).
        self.prefix = list(prefix or [])
        # Variables set for the service over this process's environment (a benchmark
        # harness's: ctxmem_tools.bench.auth_ab).
        self.env = dict(env or {})
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = config_path or workdir / "ctxmem.yaml"
        if config is not None:
            self.config_path.write_text(yaml.safe_dump(config))
        self.config = yaml.safe_load(self.config_path.read_text()) if self.config_path.exists() \
            else {}
        listen = (self.config.get("service") or {}).get("listen", "127.0.0.1:50051")
        self.endpoint = listen.replace("0.0.0.0", "127.0.0.1")
        self.metrics_listen = (self.config.get("metrics") or {}).get("listen", "")
        devices = (self.config.get("flash") or {}).get("devices") or []
        self.flash_path = Path(devices[0]["path"]) if devices and "path" in devices[0] else None
        self.log_path = workdir / "service.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._started_once = False
        if start:
            self.start()

    def _repick_ports(self) -> None:
        """New free loopback ports for the gRPC and metrics listeners (first start only)."""
        for section in ("service", "metrics"):
            listen = (self.config.get(section) or {}).get("listen", "")
            if listen.startswith("127.0.0.1:"):
                self.config[section]["listen"] = f"127.0.0.1:{free_port()}"
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.endpoint = self.config["service"]["listen"]
        self.metrics_listen = (self.config.get("metrics") or {}).get("listen", "")

    def start(self, timeout_s: float = 60.0) -> None:
        # A port picked by free_port() can be taken by someone else's ephemeral bind before
        # the service binds it; on the first start, pick new ports and try again.
        for attempt in range(3):
            try:
                self._start_once(timeout_s)
                self._started_once = True
                return
            except RuntimeError as exc:
                text = str(exc).lower()
                retry = (not self._started_once and attempt < 2
                         and ("address already in use" in text or "cannot bind" in text))
                if not retry:
                    raise
                self._repick_ports()

    def _start_once(self, timeout_s: float) -> None:
        ready = self.workdir / "ready"
        ready.unlink(missing_ok=True)
        args = [*self.prefix, sys.executable, "-m", "ctxmem_dpu", "serve", "--ready-file",
                str(ready)]
        if self.config_path.exists():
            args += ["--config", str(self.config_path)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **self.env,
                                              "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"ctxmem service exited with status {self.proc.returncode}; its log "
                    f"({self.log_path}):\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"ctxmem service not ready after {timeout_s} s:\n{self.log()}")
            time.sleep(0.02)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except FileNotFoundError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        rc = self.proc.returncode
        self.proc = None
        return rc

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self, kill: bool = False) -> None:
        if kill:
            self.kill()
        else:
            self.stop()
        self.start()

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
