"""Fixtures shared by the whole suite.

``service_factory`` starts the REAL service (``python -m ctxmem_dpu serve``) as a
subprocess on loopback with its own config, flash file and key file under ``tmp_path``,
and stops it after the test. Nothing here is a mock.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServiceHandle:
    """A running ``ctxmem serve`` process; restartable on the same ports and files."""

    def __init__(self, workdir: Path, config: dict[str, Any]) -> None:
        self.workdir = workdir
        self.config = config
        self.config_path = workdir / "ctxmem.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.port = int(config["service"]["listen"].rsplit(":", 1)[1])
        self.endpoint = f"127.0.0.1:{self.port}"
        self.metrics_url = f"http://{config['metrics']['listen']}"
        devices = config.get("flash", {}).get("devices", [])
        self.flash_path = Path(devices[0]["path"]) if devices else None
        self.log_path = workdir / "service.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self, timeout_s: float = 60.0) -> None:
        ready = self.workdir / "ready"
        ready.unlink(missing_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process below
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ctxmem_dpu", "serve", "--config", str(self.config_path),
             "--ready-file", str(ready)],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"service exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"service not ready after {timeout_s} s:\n{self.log()}")
            time.sleep(0.02)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

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

    def stats(self) -> dict[str, float]:
        import ctxmem

        with ctxmem.Client(self.endpoint) as c:
            return c.stats()


def make_config(workdir: Path, *, encryption: bool = True, dram_size: str = "128MiB",
                dram_slab: str = "8MiB", flash_size: str | None = "256MiB",
                flash_slab: str = "16MiB", write_policy: str = "write_back",
                transports: list[str] | None = None, lease_ttl_s: float = 30.0,
                allocation_ttl_s: float = 30.0, **extra: Any) -> dict[str, Any]:
    key_file = workdir / "master.key"
    if not key_file.exists():
        key_file.write_text(secrets.token_hex(32))
        key_file.chmod(0o600)
    cfg: dict[str, Any] = {
        "mode": "fallback",
        "service": {
            "listen": f"127.0.0.1:{free_port()}",
            "data_listen": "127.0.0.1:0",
            "shm_socket": str(workdir / "data.sock"),
            "transports": transports or ["shm", "tcp"],
            "lease_ttl_s": lease_ttl_s,
            "allocation_ttl_s": allocation_ttl_s,
        },
        "metrics": {"listen": f"127.0.0.1:{free_port()}"},
        "dram": {"size": dram_size, "slab_size": dram_slab},
        "flash": {"write_policy": write_policy, "slab_size": flash_slab, "devices": []},
        "encryption": {"enabled": encryption, "key_file": str(key_file)},
        "logging": {"level": "info"},
    }
    if flash_size:
        cfg["flash"]["devices"] = [{"name": "flash0", "backend": "local",
                                    "path": str(workdir / "flash0.img"), "size": flash_size,
                                    "create": True}]
    for section, values in extra.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


@pytest.fixture
def service_factory(tmp_path: Path) -> Iterator[Callable[..., ServiceHandle]]:
    handles: list[ServiceHandle] = []

    def factory(**overrides: Any) -> ServiceHandle:
        workdir = tmp_path / f"svc{len(handles)}"
        workdir.mkdir()
        h = ServiceHandle(workdir, make_config(workdir, **overrides))
        handles.append(h)
        return h

    yield factory
    for h in handles:
        h.stop()


@pytest.fixture
def service(service_factory: Callable[..., ServiceHandle]) -> ServiceHandle:
    return service_factory()
