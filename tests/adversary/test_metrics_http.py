"""Issue 12 item 4: the metrics endpoint is a real, bounded HTTP server.

Against a REAL service: a malformed request gets 400 from a proven parser (not a guess
at the path), and a slow-loris client that trickles header lines is cut off at the
request deadline while /metrics keeps answering everyone else.
"""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest

from ctxmem_common.netaddr import split_hostport
from ctxmem_tools.launcher import local_config
from tests.adversary.floods import closed_unanswered, trickle_until_cut
from tests.conftest import ServiceHandle
from tests.kit import until

TIMEOUT_S = 2.0


def _service(tmp_path_factory: pytest.TempPathFactory, name: str,
             request_timeout_s: float) -> Iterator[ServiceHandle]:
    workdir = tmp_path_factory.mktemp(name)
    cfg = local_config(workdir, flash_size=None, dram_size="8MiB", dram_slab="4MiB",
                       transports=["tcp"],
                       metrics={"request_timeout_s": request_timeout_s, "max_connections": 4,
                                "head_timeout_s": request_timeout_s})
    h = ServiceHandle(workdir, cfg)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceHandle]:
    yield from _service(tmp_path_factory, "metrics", TIMEOUT_S)


def _connect(svc: ServiceHandle) -> socket.socket:
    host, port = split_hostport(svc.metrics_listen, "metrics.listen")
    return socket.create_connection((host, port), timeout=10)


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.read().decode()


@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n",
    b"GET /metrics HTTP/9.9 extra\r\n\r\n",
    b"\x00\xff\xfe junk \x01\r\n\r\n",
], ids=["one-word", "bad-version", "binary"])
def test_a_malformed_request_gets_400(svc: ServiceHandle, request_bytes: bytes) -> None:
    sock = _connect(svc)
    try:
        sock.sendall(request_bytes)
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    finally:
        sock.close()
    assert answer.split(b"\r\n", 1)[0].split()[1] == b"400", answer[:200]


def test_a_slow_loris_is_cut_off_and_metrics_keep_answering(svc: ServiceHandle) -> None:
    def served() -> None:  # another client is served while the loris holds its connection
        code, text = _get(f"http://{svc.metrics_listen}/metrics")
        assert code == 200 and "ctxmem_hits" in text

    closed_after = trickle_until_cut(_connect(svc), b"GET /metrics HTTP/1.1\r\n",
                                     TIMEOUT_S + 4, served)
    assert closed_after is not None, "a client trickling header lines was never cut off"
    assert closed_after < TIMEOUT_S + 2


@pytest.fixture(scope="module")
def capped_svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceHandle]:
    """A service whose held connections outlive any scheduling delay of a loaded CI
    machine: with the 2 s deadline of ``svc`` a held connection could be cut (and its
    slot freed) before the extra one is accepted, and the extra one then served."""
    yield from _service(tmp_path_factory, "metrics-cap", HELD_TIMEOUT_S)


HELD_TIMEOUT_S = 60.0


def test_over_the_cap_the_oldest_silent_connection_is_closed_and_health_answers(
        capped_svc: ServiceHandle) -> None:
    """metrics.max_connections connections wait for their head: the next one closes the
    oldest of them (issue 25 item 4: before, it was itself closed unanswered)."""
    svc = capped_svc
    held = [_connect(svc) for _ in range(4)]
    try:
        time.sleep(0.3)
        extra = _connect(svc)
        extra.settimeout(5)
        try:
            extra.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            answer = b""
            while chunk := extra.recv(4096):
                answer += chunk
            assert answer.startswith(b"HTTP/1.0 200") and answer.endswith(b"ok\n"), answer
        finally:
            extra.close()
        if not closed_unanswered(held[0]):
            pytest.fail("the oldest silent connection was kept over metrics.max_connections")
    finally:
        for s in held:
            s.close()

    def healthy() -> bool:
        try:
            return _get(f"http://{svc.metrics_listen}/healthz") == (200, "ok\n")
        except OSError:
            return False

    # The held connections were closed by the client: their threads see EOF and free
    # their slots at once (no deadline involved).
    until(healthy, 10, "the endpoint to recover", 0.2)
    assert _get(f"http://{svc.metrics_listen}/readyz")[0] == 200
