"""``ctxmem_dpu.control.localpeer``: the kernel names the user behind a loopback
connection (sock_diag), and gRPC's peer strings parse."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket

import pytest

from ctxmem_common.identity import scoped_tenant, tenant_scope
from ctxmem_dpu.control.localpeer import (
    LocalUsers,
    PeerUnknown,
    loopback_peer_uid,
    parse_grpc_peer,
    proc_net_uid,
)


@pytest.mark.parametrize(("peer", "addr", "port"), [
    ("ipv4:127.0.0.1:40312", "127.0.0.1", 40312),
    ("ipv6:[::1]:5", "::1", 5),
    ("ipv6:%5B::1%5D:50051", "::1", 50051),
])
def test_grpc_peer_strings_parse(peer: str, addr: str, port: int) -> None:
    assert parse_grpc_peer(peer) == (ipaddress.ip_address(addr), port)


def test_a_unix_peer_is_not_a_tcp_peer() -> None:
    with pytest.raises(ValueError, match="not a TCP peer"):
        parse_grpc_peer("unix:")


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_the_uid_of_a_loopback_client_is_this_process_user(family: int) -> None:
    host = "127.0.0.1" if family == socket.AF_INET else "::1"
    with socket.socket(family) as srv:
        srv.bind((host, 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        with socket.create_connection((host, port)):
            conn, addr = srv.accept()
            with conn:
                assert loopback_peer_uid(addr[:2], (host, port)) == os.geteuid()
                # The fallback where sock_diag is missing reads the same fact.
                ip = ipaddress.ip_address(host)
                assert proc_net_uid((ip, addr[1]), (ip, port)) == os.geteuid()
                assert proc_net_uid((ip, 1), (ip, port)) is None
                users = LocalUsers("separate", f"{host}:{port}" if family == socket.AF_INET
                                   else f"[{host}]:{port}")
                users.port = port
                kind = "ipv4" if family == socket.AF_INET else "ipv6"
                shown = addr[0] if family == socket.AF_INET else f"[{addr[0]}]"
                assert users.tenant("alice", f"{kind}:{shown}:{addr[1]}") == "alice"


def test_a_dual_stack_client_of_an_ipv4_listener_is_found_in_tcp6() -> None:
    """gRPC's client connects to 127.0.0.1 from an IPv6 socket (IPv4-mapped): where
    sock_diag is missing, /proc/net/tcp6 lists it, under ::ffff:127.0.0.1."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        with socket.socket(socket.AF_INET6) as c:
            c.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            c.connect(("::ffff:127.0.0.1", port))
            conn, addr = srv.accept()
            with conn:
                ip = ipaddress.ip_address("127.0.0.1")
                assert proc_net_uid((ip, addr[1]), (ip, port)) == os.geteuid()
                assert loopback_peer_uid(addr, ("127.0.0.1", port)) == os.geteuid()


def test_no_such_connection_is_enoent_naming_it() -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        port = srv.getsockname()[1]
        with pytest.raises(PeerUnknown) as info:
            loopback_peer_uid(("127.0.0.1", 1), ("127.0.0.1", port))
    assert info.value.errno == errno.ENOENT
    assert f"127.0.0.1:1 -> 127.0.0.1:{port}" in str(info.value)


def test_an_unknown_caller_is_refused_saying_what_to_do() -> None:
    users = LocalUsers("separate", "127.0.0.1:1")
    users.port = 1
    with pytest.raises(PermissionError, match=r"cannot tell which local user.*errno 2"):
        users.tenant("alice", "ipv4:127.0.0.1:2")


def test_scoped_names() -> None:
    assert scoped_tenant("alice", 1000) == "alice@uid1000"
    assert tenant_scope("alice@uid1000") == "uid1000"
    assert tenant_scope("alice") == "" and tenant_scope("a@b") == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="a client of another uid needs root to drop "
                    "to uid 65534; run the suite as root (CI does)")
def test_a_client_of_another_user_is_named_by_both_sources() -> None:
    """sock_diag and the /proc/net/tcp fallback both name uid 65534 for a socket a process
    of that user made (uid 0 would not tell a wrong column from the right one)."""
    import subprocess
    import sys

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.settimeout(60)
        port = srv.getsockname()[1]
        code = ("import os, socket, sys; os.setgroups([]); os.setgid(65534); "
                "os.setuid(65534); s = socket.socket(); "
                f"s.connect(('127.0.0.1', {port})); sys.stdin.read()")
        child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
        try:
            conn, addr = srv.accept()
            with conn:
                ip = ipaddress.ip_address("127.0.0.1")
                assert loopback_peer_uid(addr, ("127.0.0.1", port)) == 65534
                assert proc_net_uid((ip, addr[1]), (ip, port)) == 65534
        finally:
            child.communicate(b"", timeout=30)
