"""A real ``redis-server`` (Debian's package) on loopback, for tests, ``ctxmem bench pod``
and a pod of three on one machine.

It is started with no persistence (the cluster index is a cache of what the nodes hold;
every node republishes after a restart, see docs/pod.md), a password, and its files in a
private work directory. ``stop``/``start`` keep the port, so a test can take the index
away and give it back at the same URL.
"""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

from ctxmem_tools.launcher import free_port


class RedisServer:
    """One ``redis-server`` process; restartable on the same port and password."""

    def __init__(self, workdir: Path, port: int | None = None, bind: str = "127.0.0.1",
                 password: str | None = None, start: bool = True) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError(
                "redis-server not found: install Debian's redis-server package "
                "(deploy/setup.sh does this)")
        self.exe = exe
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        workdir.chmod(0o700)
        self.bind = bind
        self.port = port or free_port()
        self.password = password if password is not None else secrets.token_hex(16)
        self.log_path = workdir / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None
        if start:
            self.start()

    @property
    def url(self) -> str:
        """``redis://:PASSWORD@HOST:PORT/0`` (the form ``pod.index_url`` takes)."""
        return f"redis://:{self.password}@{self.bind}:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        args = [self.exe, "--bind", self.bind, "--port", str(self.port),
                "--requirepass", self.password, "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--logfile", str(self.log_path),
                "--protected-mode", "yes"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with status {self.proc.returncode} on "
                    f"{self.bind}:{self.port}; its log ({self.log_path}):\n{self.log()}")
            if self._ping():
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"redis-server not answering on {self.bind}:{self.port} after "
                    f"{timeout_s} s:\n{self.log()}")
            time.sleep(0.02)

    def _ping(self) -> bool:
        try:
            with socket.create_connection((self.bind, self.port), timeout=0.5) as s:
                s.sendall(f"AUTH {self.password}\r\nPING\r\n".encode())
                return b"+PONG" in s.recv(64) or b"+PONG" in s.recv(64)
        except OSError:
            return False

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
