"""Which local user is on the other end of a loopback TCP connection.

The embedded default trusts the tenant name a client sends (``service.insecure: true``,
loopback only), and GPU servers are shared by many users: without this, uid ``nobody``
could connect as any tenant and read, delete or replace its blocks (issue 25). gRPC over
TCP gives a server only the caller's address (``context.peer()``, e.g.
``ipv4:127.0.0.1:40312``); the kernel knows the user that made the client's socket.
:func:`loopback_peer_uid` asks it with one exact ``SOCK_DIAG_BY_FAMILY`` request on a
``NETLINK_SOCK_DIAG`` socket (what ``ss -e`` reads): the client's socket is the one whose
source is the caller's address and whose destination is this listener's, and the answer's
``idiag_uid`` is the user that created it. No privilege is needed, and the cost is one
netlink round trip per Connect (not per block).

A Unix-socket listener has SO_PEERCRED instead, but gRPC does not expose its socket: the
service makes a ``unix:`` listen's file mode 0600, so only its own user (and root) reach
it (``ctxmem_dpu.app``).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
from urllib.parse import unquote

from ctxmem_common.identity import UID_SCOPE, scoped_tenant

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLMSG_ERROR = 0x2
_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_REQ_HEAD = struct.Struct("=BBBxI")  # family, protocol, ext, pad, states
_PORTS = struct.Struct("!HH")  # inet_diag_sockid: ports in network byte order
_TAIL = struct.Struct("=III")  # interface, cookie (INET_DIAG_NOCOOKIE: all ones)
_UID_OFFSET = _NLMSGHDR.size + 4 + 48 + 12  # inet_diag_msg: after the queue sizes
_REPLY_TIMEOUT_S = 1.0


class PeerUnknown(OSError):
    """The kernel could not name the user behind a connection (it closed, or the address
    is not one this host's sockets use); ``errno`` says why."""


def parse_grpc_peer(peer: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """``ipv4:127.0.0.1:40312`` or ``ipv6:[::1]:40312`` (gRPC percent-encodes the
    brackets in some versions) -> (address, port).

    Raises:
        ValueError: not a TCP peer (e.g. ``unix:``), or malformed.
    """
    kind, _, rest = unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6"):
        raise ValueError(f"not a TCP peer: {peer!r}")
    host, _, port = rest.rpartition(":")
    return ipaddress.ip_address(host.strip("[]")), int(port)


def loopback_peer_uid(peer: tuple[str, int], local: tuple[str, int]) -> int:
    """The uid that created the client socket connected from ``peer`` (address, port) to
    ``local`` (this listener's address, port).

    Raises:
        PeerUnknown: no such socket (ENOENT), or the kernel refused the query (its errno).
    """
    src, dst = ipaddress.ip_address(peer[0]), ipaddress.ip_address(local[0])
    if src.version != dst.version:  # an IPv4 client on a dual-stack listener
        src = ipaddress.IPv6Address(f"::ffff:{src}") if src.version == 4 else src
        dst = ipaddress.IPv6Address(f"::ffff:{dst}") if dst.version == 4 else dst
    family = socket.AF_INET if src.version == 4 else socket.AF_INET6
    sockid = (_PORTS.pack(peer[1], local[1]) + src.packed.ljust(16, b"\0")
              + dst.packed.ljust(16, b"\0") + _TAIL.pack(0, 0xFFFFFFFF, 0xFFFFFFFF))
    body = _REQ_HEAD.pack(family, socket.IPPROTO_TCP, 0, 0xFFFFFFFF) + sockid
    msg = _NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST,
                         1, 0) + body
    where = f"{src}:{peer[1]} -> {dst}:{local[1]}"
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(_REPLY_TIMEOUT_S)
            nl.sendto(msg, (0, 0))
            reply = nl.recv(65536)
        return _diag_uid(reply, where)
    except OSError as exc:
        # No sock_diag (a kernel without tcp_diag answers ENOENT too, a sandbox may refuse
        # netlink): the same fact from /proc/net/tcp[6], one scan of its lines.
        uid = proc_net_uid((src, peer[1]), (dst, local[1]))
        if uid is not None:
            return uid
        if isinstance(exc, PeerUnknown):
            raise
        raise PeerUnknown(exc.errno or errno.EPROTO,
                          f"sock_diag for {where}: {exc}; not in /proc/net/tcp either") from exc


def _diag_uid(reply: bytes, where: str) -> int:
    """``idiag_uid`` of a SOCK_DIAG_BY_FAMILY reply, or PeerUnknown with its errno."""
    if len(reply) < _NLMSGHDR.size:
        raise PeerUnknown(errno.EPROTO, f"sock_diag: short reply ({len(reply)} bytes) for "
                          f"{where}")
    _, mtype, _, _, _ = _NLMSGHDR.unpack_from(reply)
    if mtype == NLMSG_ERROR:
        (code,) = struct.unpack_from("=i", reply, _NLMSGHDR.size)
        err = -code or errno.EPROTO
        raise PeerUnknown(err, f"sock_diag: no socket {where}: {os.strerror(err)}")
    if mtype != SOCK_DIAG_BY_FAMILY or len(reply) < _UID_OFFSET + 4:
        raise PeerUnknown(errno.EPROTO, f"sock_diag: unexpected reply type {mtype} for "
                          f"{where}")
    (uid,) = struct.unpack_from("=I", reply, _UID_OFFSET)
    return int(uid)


def _proc_hex(addr: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> str:
    """``addr:port`` as /proc/net/tcp[6] prints it: each 32-bit word of the address in
    host byte order, ``%08X``, then ``:%04X`` of the port."""
    words = struct.unpack(f"={len(addr.packed) // 4}I", addr.packed)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def proc_net_uid(peer: tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int],
                 local: tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]
                 ) -> int | None:
    """The uid of the socket from ``peer`` to ``local`` as /proc/net/tcp[6] lists it
    (its ``uid`` column), or None when no line matches or the files cannot be read. An
    IPv4 connection may be made by a dual-stack IPv6 socket (gRPC's client does that):
    it is listed in tcp6 under IPv4-mapped addresses, so both files are read."""
    tables: list[tuple[str, tuple[str, str]]] = []
    if peer[0].version == 4 and local[0].version == 4:
        tables.append(("/proc/net/tcp", (_proc_hex(*peer), _proc_hex(*local))))
        mapped = [(ipaddress.IPv6Address(f"::ffff:{a}"), p) for a, p in (peer, local)]
        tables.append(("/proc/net/tcp6", (_proc_hex(*mapped[0]), _proc_hex(*mapped[1]))))
    else:
        tables.append(("/proc/net/tcp6", (_proc_hex(*peer), _proc_hex(*local))))
    for name, want in tables:
        try:
            with open(name) as f:
                next(f, None)  # the header
                for line in f:
                    cols = line.split()
                    if len(cols) > 7 and (cols[1], cols[2]) == want:
                        return int(cols[7])
        except OSError:
            continue
    return None


class LocalUsers:
    """Insecure mode's rule for telling local users apart (``service.local_users``).

    ``listen`` is the gRPC listen address (``service.listen``); :attr:`port` is set by the
    app once gRPC has bound it (``listen`` may name port 0). A ``unix:`` listen's file is
    made mode 0600 by the app, so a Unix-socket caller is the service's own user."""

    def __init__(self, policy: str, listen: str, own_uid: int | None = None) -> None:
        self.policy = policy
        self.own_uid = os.geteuid() if own_uid is None else own_uid
        self.unix = listen.strip().startswith("unix:")
        host = listen.rpartition(":")[0].strip("[]") if not self.unix else ""
        try:
            self.host: ipaddress.IPv4Address | ipaddress.IPv6Address | None = \
                ipaddress.ip_address(host)
        except ValueError:  # "localhost": 127.0.0.1 and ::1, by the caller's family
            self.host = None
        self.port = 0

    def uid_of(self, peer: str) -> int:
        """The uid of the caller at ``peer`` (``context.peer()``).

        Raises:
            PeerUnknown: the kernel could not say (the error names the address and errno).
        """
        if self.unix and peer.startswith("unix:"):
            return self.own_uid  # the socket file admits only the service's user
        try:
            addr, port = parse_grpc_peer(peer)
        except ValueError as exc:
            raise PeerUnknown(errno.EINVAL, f"caller {peer!r}: {exc}") from exc
        local = self.host
        if local is None or local.version != addr.version:
            local = ipaddress.ip_address("127.0.0.1" if addr.version == 4 else "::1")
        return loopback_peer_uid((str(addr), port), (str(local), self.port))

    def tenant(self, claimed: str, peer: str) -> str:
        """The tenant a Connect claiming ``claimed`` from ``peer`` acts as.

        Raises:
            PermissionError: ``owner`` policy and another user; a claimed name that holds
                the reserved ``@uid`` (another user's scope); the caller unknown.
        """
        if self.policy == "shared":
            return claimed
        if UID_SCOPE in claimed:
            raise PermissionError(
                f"tenant {claimed!r}: names containing {UID_SCOPE!r} are reserved in "
                f"insecure mode (they name another local user's tenants); pick another name")
        try:
            uid = self.uid_of(peer)
        except PeerUnknown as exc:
            raise PermissionError(
                f"tenant {claimed!r}: cannot tell which local user is calling from {peer} "
                f"(errno {exc.errno}: {exc.strerror}), so the call is refused "
                f"(service.local_users={self.policy!r}); connect over loopback TCP, or "
                f"authenticate tenants (service.tenant_tokens or mutual TLS)") from exc
        if uid == self.own_uid:
            return claimed
        if self.policy == "owner":
            raise PermissionError(
                f"tenant {claimed!r}: local user uid {uid} refused: this service "
                f"(uid {self.own_uid}, service.local_users: owner) serves only its own "
                f"user; run your own service, or ask its operator for "
                f"service.local_users: separate or for a tenant token")
        return scoped_tenant(claimed, uid)
