"""A ``lmcache server`` subprocess for the engine tests (its MP server with an L2
adapter): started and waited for (bounded) on its "cache server is running" line,
restartable (each start logs to a file of its own), stopped with terminate then kill.
The tests build the command line; this only runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kit import read_until


class LMCacheServerProcess:
    """Subclasses set :attr:`args` (the command line) in their ``__init__``."""

    log_name = "lmcache-server"
    what = "`lmcache server`"
    extra_env: dict[str, str] = {}

    def __init__(self, workdir: Path, port: int) -> None:
        self.workdir = workdir
        self.port = port
        self.args: list[str] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def log(self) -> str:
        return (self.workdir / f"{self.log_name}-{self.starts}.log").read_text(
            errors="replace")

    def start(self, timeout_s: float = 60.0) -> None:
        self.starts += 1
        log = open(self.workdir / f"{self.log_name}-{self.starts}.log", "wb")  # noqa: SIM115
        env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", **self.extra_env,
               "PYTHONPATH": os.pathsep.join(sys.path)}
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                     env=env)
        log.close()
        proc = self.proc
        text = read_until(self.log, lambda text: "cache server is running" in text
                          or proc.poll() is not None, timeout_s, 0.2)
        if "cache server is running" in text:
            return
        self.stop()
        pytest.fail(f"{self.what} did not come up in {timeout_s:.0f} s "
                    f"(exit status {proc.poll()}); its log:\n{text[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
