"""systemd readiness (issue 18, item 6): a real service process sends READY=1 to the
datagram socket in $NOTIFY_SOCKET once it serves, and STOPPING=1 when told to stop."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ctxmem_dpu import sdnotify
from tests.conftest import ServiceHandle


def _messages(sock: socket.socket) -> Iterator[dict[str, str]]:
    while True:
        data = sock.recv(4096)  # the socket's timeout bounds each wait
        yield dict(line.split("=", 1) for line in data.decode().splitlines())


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_ready_and_stopping(service_factory: Callable[..., ServiceHandle], tmp_path: Path,
                            monkeypatch: pytest.MonkeyPatch, abstract: bool) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        if abstract:
            name = f"ctxmem-test-{uuid.uuid4().hex}"
            sock.bind("\0" + name)
            monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        else:
            path = tmp_path / "notify.sock"
            sock.bind(str(path))
            monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        sock.settimeout(30.0)
        svc = service_factory()  # started; the launcher waits for its ready file
        msgs = _messages(sock)
        ready = next(msgs)
        assert ready["READY"] == "1"
        assert ready["STATUS"] == "serving"
        assert svc.proc is not None and ready["MAINPID"] == str(svc.proc.pid)
        svc.stop()
        stopping = next(msgs)
        assert stopping["STOPPING"] == "1"


def test_no_socket_sends_nothing(tmp_path: Path) -> None:
    assert sdnotify.notify("READY=1", env={}) is False
    assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": "relative/path"}) is False
    # A socket nobody listens on: logged, not raised (the service keeps running).
    assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": str(tmp_path / "gone")}) is False


def test_notify_one_datagram(tmp_path: Path) -> None:
    path = tmp_path / "n.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5.0)
        assert sdnotify.notify("READY=1", "STATUS=a\nb", env={"NOTIFY_SOCKET": str(path)})
        assert sock.recv(4096) == b"READY=1\nSTATUS=a b"
