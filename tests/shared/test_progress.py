"""ctxmem_common.progress: a bar with percent and ETA on a real terminal (a pty), nothing
at all on a pipe, in CI, or with CTXMEM_PROGRESS=0.
"""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import struct
import termios
from collections.abc import Iterator

import pytest

from ctxmem_common.progress import enabled, progress


@pytest.fixture(autouse=True)
def _no_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("CTXMEM_PROGRESS", raising=False)


@pytest.fixture()
def tty() -> Iterator[tuple[io.TextIOWrapper, int]]:
    """A real terminal: the slave side as a text stream, the master fd to read it."""
    master, slave = pty.openpty()
    # A terminal 120 columns wide (a fresh pty reports 0, and tqdm fits the bar in that).
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    stream = open(slave, "w", buffering=1, encoding="utf-8")  # noqa: SIM115
    yield stream, master
    stream.close()
    os.close(master)


def read_all(fd: int) -> str:
    out = b""
    while select.select([fd], [], [], 0.2)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    return out.decode("utf-8", "replace")


def drive(stream: io.TextIOBase | io.TextIOWrapper) -> None:
    with progress(total=40, desc="work", unit="step", stream=stream) as bar:  # type: ignore[arg-type]
        for i in range(40):
            bar.update()
            if i == 20:
                bar.note(wrong=0)
        assert bar.n == 40


def test_bar_with_percent_and_eta_on_a_terminal(tty: tuple[io.TextIOWrapper, int]) -> None:
    stream, master = tty
    assert enabled(stream)
    drive(stream)
    text = read_all(master)
    assert "work: 100%" in text, text
    assert "40/40 step" in text, text
    assert re.search(r"ETA \d\d:\d\d", text), text
    assert "wrong=0" in text, text


def test_silent_on_a_pipe() -> None:
    buf = io.StringIO()  # isatty() is False, as for a pipe or a file
    assert not enabled(buf)
    drive(buf)
    assert buf.getvalue() == ""


def test_silent_in_ci_even_on_a_terminal(tty: tuple[io.TextIOWrapper, int],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    stream, master = tty
    monkeypatch.setenv("CI", "true")
    assert not enabled(stream)
    drive(stream)
    assert read_all(master) == ""


def test_env_overrides(tty: tuple[io.TextIOWrapper, int],
                       monkeypatch: pytest.MonkeyPatch) -> None:
    stream, _master = tty
    monkeypatch.setenv("CTXMEM_PROGRESS", "0")
    assert not enabled(stream)
    monkeypatch.setenv("CTXMEM_PROGRESS", "1")
    monkeypatch.setenv("CI", "true")
    assert enabled(io.StringIO())


def test_set_moves_to_an_absolute_count() -> None:
    bar = progress(total=10, desc="x", stream=io.StringIO())
    bar.set(7)
    bar.set(3)  # never backwards
    assert bar.n == 7 and not bar.active
