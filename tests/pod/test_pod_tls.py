"""Issue 14: peer fetch inside the trust boundary: mutual TLS with the pod CA, and no
peer-fetch listener beyond loopback without it."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import pytest

import ctxmem
from ctxmem_common import peer_wire as w
from ctxmem_tools.bench.security_pki import make_pki, member_cert
from ctxmem_tools.launcher import ServiceProcess, local_config
from ctxmem_tools.pod_launcher import LocalPod, pod_section
from ctxmem_tools.redis_server import RedisServer
from tests.pod.podtest import Clients, blocks, wait_for


def test_cross_node_get_over_mutual_tls(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki", tenants=())
    cert, key = member_cert(pki, "pod-member")
    tls = {"tls_cert_file": str(cert), "tls_key_file": str(key), "tls_ca_file": str(pki.ca)}
    clients = Clients()
    with LocalPod(tmp_path / "pod", 2, pod=tls) as pod:
        n1, n2 = pod.nodes
        keys = ctxmem.chain_hashes(range(16 * 5), 16)
        data = blocks(5, 11)
        try:
            assert clients.put(n1.endpoint, keys, data) == 5
            wait_for(lambda: clients.hits(n2.endpoint, keys) == 5, what="publish")
            assert clients.get(n2.endpoint, keys, data) == 5
            assert clients.stats(n2.endpoint)["pod_fetch_blocks_peer"] == 5
            # Plain TCP to the TLS port: the hello never gets through.
            host, port = n1.config["pod"]["listen"].rsplit(":", 1)
            hello = w.pack_hello(w.HELLO_MAGIC, w.new_nonce(), "intruder")
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(hello)
                s.settimeout(5)
                try:
                    answer = s.recv(4)
                except ConnectionResetError:
                    answer = b""
                assert answer != w.CHALLENGE_MAGIC
            # TLS without a client certificate: refused in the handshake.
            ctx = ssl.create_default_context(cafile=str(pki.ca))
            ctx.check_hostname = False
            with socket.create_connection((host, int(port)), timeout=5) as raw, \
                    ctx.wrap_socket(raw) as s:
                s.settimeout(5)
                with pytest.raises((ssl.SSLError, ConnectionResetError, OSError)):
                    s.sendall(hello)
                    if s.recv(1) == b"":
                        raise ConnectionResetError("closed")
        finally:
            clients.close()


def test_peer_fetch_beyond_loopback_needs_tls(tmp_path: Path) -> None:
    cfg = local_config(tmp_path / "n")
    cfg["pod"] = pod_section("redis://127.0.0.1:1/0", "n1", "x" * 32, host="0.0.0.0")
    with pytest.raises(RuntimeError, match=r"pod\.listen: '0\.0\.0\.0:\d+' is not loopback"):
        ServiceProcess(tmp_path / "n", cfg)


def test_index_over_tls(tmp_path: Path) -> None:
    """``rediss://``: a TLS-only redis-server (no plain port), the nodes verify it against
    ``pod.index_ca_file``; a cross-node get is byte exact."""
    pki = make_pki(tmp_path / "pki", tenants=())
    clients = Clients()
    with RedisServer(tmp_path / "redis", tls=(pki.server_cert, pki.server_key, pki.ca)) \
            as index, LocalPod(tmp_path / "pod", 2, index=index,
                               pod={"index_ca_file": str(pki.ca)}) as pod:
        assert index.url.startswith("rediss://")
        n1, n2 = pod.nodes
        keys = ctxmem.chain_hashes(range(16 * 4), 16)
        data = blocks(4, 17)
        try:
            assert clients.put(n1.endpoint, keys, data) == 4
            wait_for(lambda: clients.hits(n2.endpoint, keys) == 4, what="publish over TLS")
            assert clients.get(n2.endpoint, keys, data) == 4
            assert clients.stats(n2.endpoint)["pod_fetch_blocks_peer"] == 4
            assert clients.stats(n2.endpoint)["pod_index_errors"] == 0
        finally:
            clients.close()


def test_index_with_the_wrong_ca_is_unreachable_not_fatal(tmp_path: Path) -> None:
    """Every node trusts another CA than the one that signed the index's certificate: the
    handshake fails, so the index is unreachable; each node keeps serving its own blocks,
    cross-node gets are misses, and the failures are counted (``pod_index_errors``)."""
    pki = make_pki(tmp_path / "pki", tenants=())
    other = make_pki(tmp_path / "other", tenants=())
    clients = Clients()
    with RedisServer(tmp_path / "redis", tls=(pki.server_cert, pki.server_key, pki.ca)) \
            as index, LocalPod(tmp_path / "pod", 2, index=index,
                               pod={"index_ca_file": str(other.ca)}) as pod:
        n1, n2 = pod.nodes
        keys = ctxmem.chain_hashes(range(16 * 4), 16)
        data = blocks(4, 19)
        try:
            assert clients.put(n1.endpoint, keys, data) == 4
            wait_for(lambda: clients.stats(n1.endpoint)["pod_index_errors"] >= 2,
                     what="the index failures to be counted")
            assert clients.get(n1.endpoint, keys, data) == 4  # its own blocks: served
            assert clients.hits(n2.endpoint, keys) == 0
            assert clients.get(n2.endpoint, keys, data) == 0
            assert clients.stats(n2.endpoint)["pod_index_errors"] >= 1
            assert n1.proc is not None and n1.proc.poll() is None
            assert n2.proc is not None and n2.proc.poll() is None
        finally:
            clients.close()
