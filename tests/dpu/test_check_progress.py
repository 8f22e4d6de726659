"""``ctxmem check`` shows a bar per device (slabs, percent, ETA) when its stderr is a
terminal, and nothing of the sort on a pipe, in CI or with ``-q``. Run as the real
command (``python -m ctxmem_dpu check``) on a formatted 64 MiB device file.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def device(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("check") / "flash0.img"
    with open(path, "wb") as f:
        f.truncate(64 << 20)
    proc = _check(["--format", f"--device=flash0={path}", "--slab-size", "4MiB"], None)
    assert proc.returncode == 0, proc.stderr
    return str(path)


def _env(ci: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "CTXMEM_PROGRESS")}
    env["PYTHONPATH"] = os.pathsep.join(str(ROOT / d) for d in ("shared", "dpu", "host", "tools"))
    if ci:
        env["CI"] = "true"
    return env


def _check(args: list[str], stderr: int | None, ci: bool = False
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ctxmem_dpu", "check", *args], text=True,
                          stdout=subprocess.PIPE,
                          stderr=stderr if stderr is not None else subprocess.PIPE,
                          env=_env(ci), timeout=120)


def _on_a_terminal(args: list[str], ci: bool = False) -> tuple[int, str]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    try:
        proc = _check(args, slave, ci)
        out = b""
        while select.select([master], [], [], 0.2)[0]:
            chunk = os.read(master, 65536)
            if not chunk:
                break
            out += chunk
        return proc.returncode, out.decode("utf-8", "replace")
    finally:
        os.close(slave)
        os.close(master)


def test_bar_on_a_terminal(device: str) -> None:
    rc, err = _on_a_terminal([f"--device=flash0={device}"])
    assert rc == 0, err
    assert "ctxmem check flash0: 100%" in err, err
    assert "slabs" in err and "ETA" in err, err


@pytest.mark.parametrize("how", ["pipe", "ci", "quiet"])
def test_no_bar_elsewhere(device: str, how: str) -> None:
    if how == "pipe":
        proc = _check([f"--device=flash0={device}"], None)
        rc, err = proc.returncode, proc.stderr
    else:
        rc, err = _on_a_terminal([f"--device=flash0={device}", *(["-q"] if how == "quiet"
                                                                  else [])], ci=how == "ci")
    assert rc == 0, err
    assert "ETA" not in err and "%|" not in err, err
