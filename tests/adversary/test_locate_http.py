"""Issue 29 item 3: the metrics port's JSON Locate (``POST /v1/locate``) is authenticated
and bounded like everything else, against a REAL service.

Every refusal is a JSON answer with a status that says what to fix: an unknown session
and a wrong token get one answer (401), a missing token says which header to send, a body
over the cap is refused from its Content-Length without being read (413), malformed JSON
and fields of the wrong type get 400 naming the field, too many keys the key cap, a GET
405. A body that never arrives is cut at the request deadline. The service (metrics and
Locate) still answers afterwards. The answers themselves: tests/integration/
test_router_surface.py (HTTP equals gRPC), tests/pod/test_pod_cluster.py (a pod).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import ctxmem
from ctxmem_common.identity import LOCATE_PATH, SESSION_TOKEN_HTTP_HEADER
from ctxmem_common.keys import MAX_LOOKUP_KEYS
from ctxmem_common.netaddr import split_hostport
from ctxmem_tools.launcher import local_config
from ctxmem_tools.locate_http import locate_body, locate_http, post_locate
from tests.conftest import ServiceHandle
from tests.kit import byte_layout

LAYOUT = byte_layout(64 << 10, tokens_per_block=16)
TIMEOUT_S = 2.0
MAX_BODY = 8 << 20  # ctxmem_dpu.control.locate_http.MAX_BODY_BYTES


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceHandle]:
    workdir = tmp_path_factory.mktemp("locate-http")
    cfg = local_config(workdir, flash_size=None, dram_size="8MiB", dram_slab="4MiB",
                       transports=["tcp"],
                       metrics={"request_timeout_s": TIMEOUT_S, "head_timeout_s": TIMEOUT_S})
    h = ServiceHandle(workdir, cfg)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def session(svc: ServiceHandle) -> Iterator[tuple[Any, Any, list[bytes]]]:
    """A client, its namespace with 3 blocks stored, and the keys (5; 3 held)."""
    keys = ctxmem.chain_hashes(range(16 * 5), 16)
    with ctxmem.Client(svc.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        data = [np.full(LAYOUT.block_nbytes, i, np.uint8) for i in range(3)]
        assert ns.put(keys[:3], data).stored == 3
        yield c, ns, keys


def _works(svc: ServiceHandle, ns: Any, keys: list[bytes]) -> None:
    """The service still serves: /metrics and a correct Locate over HTTP."""
    with urllib.request.urlopen(svc.metrics_url_for("/metrics"), timeout=10) as r:
        assert r.status == 200
    s = ns._open()
    status, got = locate_http(svc.metrics_listen, s.id, s.token, ns.handle, keys)
    assert (status, got["num_hits"], got["tiers"]) == (200, 3, ["dram"] * 3), got


def _raw(svc: ServiceHandle, data: bytes, wait_s: float = 10.0) -> tuple[bytes, float]:
    """Send ``data`` on a new connection; (everything answered until the service closed
    it, seconds that took)."""
    host, port = split_hostport(svc.metrics_listen, "metrics.listen")
    t0 = time.monotonic()
    with socket.create_connection((host, port), timeout=wait_s) as sock:
        sock.sendall(data)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
    return out, time.monotonic() - t0


def _answer(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_unknown_session_and_wrong_token_get_the_same_answer(svc: ServiceHandle,
                                                             session: Any) -> None:
    _c, ns, keys = session
    s = ns._open()
    wrong_token = bytes(b ^ 1 for b in s.token)
    unknown = bytes(16)
    answers = [locate_http(svc.metrics_listen, sid, tok, ns.handle, keys)
               for sid, tok in ((s.id, wrong_token), (unknown, s.token), (unknown, wrong_token),
                                (s.id, b""))]
    assert all(a == answers[0] for a in answers), answers
    status, got = answers[0]
    assert status == 401 and got["error"] == "UNKNOWN_SESSION"
    assert "unknown session or wrong session token" in got["message"]
    # A token header that is not hex is a wrong token, the same answer again.
    assert post_locate(svc.metrics_listen, locate_body(s.id, ns.handle, keys), None,
                       headers={SESSION_TOKEN_HTTP_HEADER: "not hex"}) == answers[0]
    # No token header at all: 401 saying which header to send.
    status, got = post_locate(svc.metrics_listen, locate_body(s.id, ns.handle, keys), None)
    assert status == 401 and SESSION_TOKEN_HTTP_HEADER in got["message"], got
    _works(svc, ns, keys)


def test_malformed_bodies_get_400_naming_what_is_wrong(svc: ServiceHandle,
                                                       session: Any) -> None:
    _c, ns, keys = session
    s = ns._open()
    good = {"session_id": s.id.hex(), "namespace_handle": ns.handle,
            "keys": [k.hex() for k in keys]}
    cases: list[tuple[bytes, str]] = [
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON"),
        (json.dumps({**good, "extra": 1}).encode(), "unknown field(s) ['extra']"),
        (json.dumps({k: v for k, v in good.items() if k != "keys"}).encode(),
         "missing field(s) ['keys']"),
        (json.dumps({**good, "keys": "00"}).encode(), "keys must be a list"),
        (json.dumps({**good, "keys": [keys[0].hex(), 7]}).encode(), "keys[1] must be a hex"),
        (json.dumps({**good, "keys": [keys[0].hex(), "zz"]}).encode(), "keys[1] is not hex"),
        (json.dumps({**good, "namespace_handle": "1"}).encode(), "namespace_handle must be"),
        (json.dumps({**good, "namespace_handle": True}).encode(), "namespace_handle must be"),
        (json.dumps({**good, "namespace_handle": 1 << 40}).encode(), "namespace_handle must be"),
        (json.dumps({**good, "session_id": "xyz"}).encode(), "session_id is not hex"),
        (json.dumps({**good, "prefix": False}).encode(), "prefix must be true"),
        (json.dumps({**good, "keys": ["00"] * (MAX_LOOKUP_KEYS + 1)}).encode(),
         f"at most {MAX_LOOKUP_KEYS}"),
    ]
    for body, says in cases:
        status, got = post_locate(svc.metrics_listen, body, s.token)
        assert status == 400 and got["error"] == "INVALID_ARGUMENT", (body[:60], got)
        assert says in got["message"], (says, got)
    # "prefix": true is accepted; an unknown namespace handle is 404.
    assert post_locate(svc.metrics_listen, json.dumps({**good, "prefix": True}).encode(),
                       s.token)[0] == 200
    status, got = post_locate(svc.metrics_listen,
                              json.dumps({**good, "namespace_handle": 999}).encode(), s.token)
    assert status == 404 and got["error"] == "UNKNOWN_NAMESPACE", got
    _works(svc, ns, keys)


def test_size_method_and_length_are_bounded(svc: ServiceHandle, session: Any) -> None:
    _c, ns, keys = session
    s = ns._open()
    tok = f"{SESSION_TOKEN_HTTP_HEADER}: {s.token.hex()}\r\n".encode()
    # Over the cap: refused from the header, the body never sent nor read.
    raw, _ = _raw(svc, f"POST {LOCATE_PATH} HTTP/1.1\r\nHost: x\r\n".encode() + tok +
                  f"Content-Length: {MAX_BODY + 1}\r\n\r\n".encode())
    status, got = _answer(raw)
    assert status == 413 and f"over {MAX_BODY}" in got["message"], got
    # No Content-Length: 411.
    raw, _ = _raw(svc, f"POST {LOCATE_PATH} HTTP/1.1\r\nHost: x\r\n".encode() + tok + b"\r\n")
    status, got = _answer(raw)
    assert status == 411 and "Content-Length" in got["message"], got
    # Not a POST: 405 saying so, with Allow.
    raw, _ = _raw(svc, f"GET {LOCATE_PATH} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert b"\r\nAllow: POST\r\n" in raw, raw
    status, got = _answer(raw)
    assert status == 405 and "POST" in got["message"], got
    # Other paths still take GET only.
    raw, _ = _raw(svc, b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert raw.startswith(b"HTTP/1.0 405"), raw[:60]
    # A body at the cap's edge that is complete is served (the cap is not off by one).
    body = locate_body(s.id, ns.handle, keys)
    body += b" " * (MAX_BODY - len(body))
    assert post_locate(svc.metrics_listen, body, s.token)[0] == 200
    _works(svc, ns, keys)


def test_a_body_that_never_arrives_is_cut_at_the_deadline(svc: ServiceHandle,
                                                          session: Any) -> None:
    """The head is in but the body stalls: the connection is ended within the request
    deadline (metrics.request_timeout_s from accept), holding no thread after it."""
    _c, ns, keys = session
    s = ns._open()
    body = locate_body(s.id, ns.handle, keys)
    raw, took = _raw(svc, f"POST {LOCATE_PATH} HTTP/1.1\r\nHost: x\r\n"
                     f"{SESSION_TOKEN_HTTP_HEADER}: {s.token.hex()}\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:10])
    assert took < TIMEOUT_S + 3, took
    assert b"200 OK" not in raw, raw[:80]
    # Cut short by the client instead: 400 saying how much came.
    host, port = split_hostport(svc.metrics_listen, "metrics.listen")
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(f"POST {LOCATE_PATH} HTTP/1.1\r\nHost: x\r\n"
                     f"{SESSION_TOKEN_HTTP_HEADER}: {s.token.hex()}\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:10])
        sock.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    status, got = _answer(out)
    assert status == 400 and f"after 10 of its {len(body)} bytes" in got["message"], got
    _works(svc, ns, keys)
