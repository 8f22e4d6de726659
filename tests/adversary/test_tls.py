"""Issue 12, items 1 (mTLS identity) and 2 (encryption on the wire), against a REAL service.

Before this change the service had no TLS at all: a client certificate meant nothing, the
tenant came from the request, and the TCP data plane carried block bytes in clear (the
relay test's plaintext control shows what a recorder on the path then sees).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

import ctxmem
from ctxmem.transport.base import TransportError
from ctxmem.transport.tcp import TcpChannel
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_tools.bench.security_pki import Pki, make_pki, server_cert
from ctxmem_tools.launcher import ServiceProcess, free_port, local_config
from tests.kit import byte_layout, keys, until

BLOCK = 64 << 10
LAYOUT = byte_layout(BLOCK)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki")


def tls_section(pki: Pki, mutual: bool = True, reload_s: float = 10.0) -> dict[str, Any]:
    return {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key),
            "client_ca_file": str(pki.ca) if mutual else "", "reload_interval_s": reload_s}


def client_tls(pki: Pki, tenant: str | None) -> ctxmem.TlsConfig:
    if tenant is None:
        return ctxmem.TlsConfig(ca_file=str(pki.ca))
    cert, key = pki.client[tenant]
    return ctxmem.TlsConfig(ca_file=str(pki.ca), cert_file=str(cert), key_file=str(key))


@pytest.fixture
def tls_service(service_factory: Callable[..., Any], pki: Pki) -> Callable[..., Any]:
    def start(mutual: bool = True, reload_s: float = 10.0) -> Any:
        return service_factory(dram_size="8MiB", dram_slab="2MiB", flash_size=None,
                               transports=["tcp"], tls=tls_section(pki, mutual, reload_s))
    return start


def roundtrip(client: ctxmem.Client, tenant: str, tag: str = "x", n: int = 4) -> None:
    ns = client.open_namespace(LAYOUT, model_id="m", tenant=tenant)
    ks = keys(tag, n)
    blocks = [secrets.token_bytes(BLOCK) for _ in ks]
    assert ns.put(ks, blocks).stored == n
    out = [bytearray(BLOCK) for _ in ks]
    assert ns.get(ks, out) == n
    assert [bytes(b) for b in out] == blocks


@pytest.mark.parametrize("mutual", [False, True], ids=["server-only", "mutual"])
def test_grpc_and_tcp_round_trip_over_tls(tls_service: Callable[..., Any], pki: Pki,
                                          mutual: bool) -> None:
    svc = tls_service(mutual=mutual)
    with ctxmem.Client(svc.endpoint, transport="tcp",
                       tls=client_tls(pki, "alice" if mutual else None)) as c:
        roundtrip(c, "alice")
        assert c.transport_in_use == "tcp"


def test_plaintext_client_fails_cleanly(tls_service: Callable[..., Any], pki: Pki) -> None:
    svc = tls_service()
    with ctxmem.Client(svc.endpoint, transport="tcp", timeout_s=3) as c, \
            pytest.raises(ctxmem.Unavailable):
        c.health()
    # A plaintext HELLO on the TCP data port: closed, and one log line, no traceback.
    with ctxmem.Client(svc.endpoint, transport="tcp", tls=client_tls(pki, "alice")) as c:
        host, port = c.health().data_endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"CXT1" + bytes(60))
        with contextlib.suppress(ConnectionResetError):
            assert s.recv(64) == b""
    until(lambda: "TLS handshake failed" in svc.log(), 5, svc.log)
    log = svc.log()
    assert log.count("TLS handshake failed") == 1, log
    assert "Traceback" not in log, log


def test_client_without_certificate_refused_in_mutual_mode(tls_service: Callable[..., Any],
                                                            pki: Pki) -> None:
    svc = tls_service(mutual=True)
    with ctxmem.Client(svc.endpoint, transport="tcp", timeout_s=3,
                       tls=client_tls(pki, None)) as c, pytest.raises(ctxmem.Unavailable):
        c.open_namespace(LAYOUT, model_id="m", tenant="alice")


def test_certificate_of_a_cannot_connect_as_b_nor_read_bs_blocks(
        tls_service: Callable[..., Any], pki: Pki) -> None:
    svc = tls_service()
    ks = keys("bob-secret", 4)
    with ctxmem.Client(svc.endpoint, transport="tcp", tls=client_tls(pki, "bob")) as bob:
        nsb = bob.open_namespace(LAYOUT, model_id="m", tenant="bob")
        assert nsb.put(ks, [secrets.token_bytes(BLOCK) for _ in ks]).stored == 4
    with ctxmem.Client(svc.endpoint, transport="tcp", tls=client_tls(pki, "alice")) as a:
        with pytest.raises(ctxmem.PermissionDenied, match="certificate is for tenant 'alice'"):
            a.open_namespace(LAYOUT, model_id="m", tenant="bob")
        nsa = a.open_namespace(LAYOUT, model_id="m", tenant="alice")
        assert nsa.get(ks, [bytearray(BLOCK) for _ in ks]) == 0


def test_tcp_data_connection_with_bs_certificate_for_as_session_refused(
        tls_service: Callable[..., Any], pki: Pki) -> None:
    svc = tls_service()
    with ctxmem.Client(svc.endpoint, transport="tcp", tls=client_tls(pki, "alice")) as a:
        a.open_namespace(LAYOUT, model_id="m", tenant="alice")
        s = a._sessions["alice"]
        host, port = a.health().data_endpoint.rsplit(":", 1)
        with pytest.raises(TransportError, match="refused"):
            TcpChannel(host, int(port), s.id, a._tokens[s.id], 5.0,
                       tls=client_tls(pki, "bob"))
        # A's own certificate with A's session is fine (the refusal is the tenant's).
        TcpChannel(host, int(port), s.id, a._tokens[s.id], 5.0,
                   tls=client_tls(pki, "alice")).close()
    assert "the client certificate names tenant 'bob'" in svc.log()


def peer_serial(host: str, port: int, pki: Pki, alpn: list[str] | None = None) -> int:
    ctx = client_tls(pki, "alice").ssl_context()
    if alpn:
        ctx.set_alpn_protocols(alpn)
    with socket.create_connection((host, port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        der = s.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_certificate_reload_without_restart(tls_service: Callable[..., Any], pki: Pki) -> None:
    svc = tls_service(reload_s=0.2)
    tls = client_tls(pki, "alice")
    old = ctxmem.Client(svc.endpoint, transport="tcp", tls=tls)
    roundtrip(old, "alice", "before")
    host, port = old.health().data_endpoint.rsplit(":", 1)
    gport = int(svc.endpoint.rsplit(":", 1)[1])
    assert peer_serial(host, int(port), pki) != 4242
    # Rotate like a Secret volume would: new files in place (new inode, new mtime).
    tmp_c, tmp_k = pki.dir / "new.crt", pki.dir / "new.key"
    server_cert(pki, tmp_c, tmp_k, serial=4242)
    os.replace(tmp_k, pki.server_key)
    os.replace(tmp_c, pki.server_cert)
    until(lambda: peer_serial(host, int(port), pki) == 4242, 10,
          "the TCP data plane to load the new certificate", 0.1)
    until(lambda: peer_serial("127.0.0.1", gport, pki, ["h2"]) == 4242, 10,
          "gRPC to load the new certificate", 0.1)
    roundtrip(old, "alice", "after")  # connections opened before keep working
    with ctxmem.Client(svc.endpoint, transport="tcp", tls=tls) as new:
        roundtrip(new, "alice", "new")
    old.close()


class Relay:
    """A TCP relay that records every byte the client sends and the server answers."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.recorded = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            s = socket.create_connection(self.target)
            for a, b in ((c, s), (s, c)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    self.recorded += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for x in (src, dst):
                with contextlib.suppress(OSError):
                    x.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.lsock.close()


@pytest.mark.parametrize("tls_on", [True, False], ids=["tls", "plaintext-control"])
def test_tcp_data_plane_bytes_are_not_plaintext_on_the_wire(
        service_factory: Callable[..., Any], pki: Pki, tls_on: bool) -> None:
    extra = {"tls": tls_section(pki)} if tls_on else {}
    svc = service_factory(dram_size="8MiB", dram_slab="2MiB", flash_size=None,
                          transports=["tcp"], **extra)
    tls = client_tls(pki, "alice") if tls_on else None
    with ctxmem.Client(svc.endpoint, transport="tcp", tls=tls) as probe:
        host, port = probe.health().data_endpoint.rsplit(":", 1)
    relay = Relay((host, int(port)))

    class Relayed(ctxmem.Client):
        def health(self) -> pb.HealthResponse:
            h = pb.HealthResponse()
            h.CopyFrom(super().health())
            h.data_endpoint = f"127.0.0.1:{relay.port}"
            return h

    try:
        with Relayed(svc.endpoint, transport="tcp", tls=tls) as c:
            ns = c.open_namespace(LAYOUT, model_id="m", tenant="alice")
            ks = keys("wire", 2)
            blocks = [secrets.token_bytes(BLOCK) for _ in ks]
            assert ns.put(ks, blocks).stored == 2
            out = [bytearray(BLOCK) for _ in ks]
            assert ns.get(ks, out) == 2 and [bytes(b) for b in out] == blocks
        time.sleep(0.2)
        with relay._lock:
            wire = bytes(relay.recorded)
        assert len(wire) > 4 * BLOCK  # the put and the get both went through the relay
        leaked = any(b[i:i + 64] in wire for b in blocks for i in range(0, BLOCK, 8192))
        assert leaked is (not tls_on)
    finally:
        relay.close()


def test_refuses_wildcard_listen_without_tls_or_tokens_and_starts_with_mtls(
        tmp_path: Path, pki: Pki) -> None:
    def cfg(name: str, **sections: Any) -> dict[str, Any]:
        c = local_config(tmp_path / name, dram_size="8MiB", dram_slab="2MiB",
                         flash_size=None, transports=["tcp"], **sections)
        c["service"]["listen"] = f"0.0.0.0:{free_port()}"
        c["service"]["data_listen"] = "0.0.0.0:0"
        return c

    for name, extra in (("plain", {}), ("server-tls", {"tls": tls_section(pki, False)})):
        with pytest.raises(RuntimeError, match="refused on a non-loopback address"):
            ServiceProcess(tmp_path / name, cfg(name, **extra))
    with ServiceProcess(tmp_path / "mtls", cfg("mtls", tls=tls_section(pki))) as svc, \
            ctxmem.Client(svc.endpoint, transport="tcp", tls=client_tls(pki, "alice")) as c:
        roundtrip(c, "alice")




def test_tcp_data_plane_refuses_tls_below_1_3(tls_service: Callable[..., Any], pki: Pki) -> None:
    svc = tls_service()
    with ctxmem.Client(svc.endpoint, transport="tcp", tls=client_tls(pki, "alice")) as c:
        host, port = c.health().data_endpoint.rsplit(":", 1)
    ctx = client_tls(pki, "alice").ssl_context()
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    with socket.create_connection((host, int(port)), timeout=5) as raw, \
            pytest.raises((ssl.SSLError, ConnectionResetError)):
        ctx.wrap_socket(raw, server_hostname="127.0.0.1")


def test_rotated_client_ca_ends_connections_it_no_longer_trusts(
        service_factory: Callable[..., Any], pki: Pki, tmp_path: Path) -> None:
    """Issue 25, item 5: after tls.client_ca_file is rotated to a CA that no longer trusts
    a tenant's certificate, that tenant's open channel stops working (Connect included),
    its sessions end and its TCP data connections are closed, within the reload interval;
    a certificate of the new CA connects. Before, the old channel kept working for ever."""
    import grpc

    from ctxmem_common.protoconv import transport_to_pb
    from ctxmem_tools.bench.security_pki import make_pki

    client_ca = tmp_path / "client-ca.pem"
    client_ca.write_bytes(pki.ca.read_bytes())
    reload_s = 0.3
    tls = {**tls_section(pki, reload_s=reload_s), "client_ca_file": str(client_ca)}
    svc = service_factory(dram_size="8MiB", dram_slab="2MiB", flash_size=None,
                          transports=["tcp"], tls=tls)
    new_pki = make_pki(tmp_path / "pki2", tenants=("bob",))
    alice = ctxmem.Client(svc.endpoint, transport="tcp", tls=client_tls(pki, "alice"))
    try:
        roundtrip(alice, "alice", "before")
        ns = alice.open_namespace(LAYOUT, model_id="m", tenant="alice")
        s = alice._sessions["alice"]
        host, port = alice.health().data_endpoint.rsplit(":", 1)
        data = TcpChannel(host, int(port), s.id, alice._tokens[s.id], 5.0,
                          tls=client_tls(pki, "alice"))
        assert alice.stats()["sessions"] == 1
        # Rotate: the new client CA file holds only the new CA (new inode, new mtime).
        tmp = tmp_path / "client-ca.new"
        tmp.write_bytes(new_pki.ca.read_bytes())
        os.replace(tmp, client_ca)
        t0 = time.monotonic()

        def refusal() -> Exception | None:
            try:
                ns.lookup(keys("before", 4))
            except ctxmem.PermissionDenied as exc:
                return exc
            return None
        refused = until(refusal, reload_s + 5, lambda: "the old channel's refusal (it still "
                        f"works); the service's log:\n{svc.log()[-3000:]}")
        assert time.monotonic() - t0 < reload_s + 5
        assert "no longer trusted" in str(refused) and "client_ca_file" in str(refused)
        # A new Connect on the old channel is refused too.
        assert alice._stub is not None
        with pytest.raises(grpc.RpcError) as info:
            alice._stub.Connect(pb.ConnectRequest(
                client_name="x", transport=transport_to_pb("tcp"), tenant="alice"), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The session it opened ended, and the TCP data connection was closed.
        deadline = time.monotonic() + reload_s + 5
        with ctxmem.Client(svc.endpoint, transport="tcp", tls=ctxmem.TlsConfig(
                ca_file=str(pki.ca), cert_file=str(new_pki.client["bob"][0]),
                key_file=str(new_pki.client["bob"][1]))) as bob:
            until(lambda: bob.stats()["sessions"] == 0, deadline - time.monotonic(),
                  "alice's session to end")
            data._sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                got = data._sock.recv(1)
            except (ConnectionResetError, ssl.SSLEOFError):
                got = b""
            assert got == b"", "the data connection is still open"
            # The new CA's certificate is served.
            roundtrip(bob, "bob", "after")
        assert "closed 2 data connection(s)" in svc.log()  # the shim's and ``data``
        assert "ended 1 session(s)" in svc.log()
    finally:
        alice.close()
