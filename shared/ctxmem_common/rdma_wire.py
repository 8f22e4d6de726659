"""What both ends of the RDMA data path agree on: the connection exchange and GID choice.

The RDMA transport moves bytes with one-sided RDMA WRITE and READ on a reliable-connected
(RC) queue pair per session. The two queue pairs are connected by exchanging their
attributes over the *control plane*: two methods on the service's gRPC server, framed
here (bytes in, bytes out, outside ``ctxmem.proto`` so the RDMA path needs no change to
the shared protocol; see ``docs/rdma.md`` for why not rdma_cm)::

    /ctxmem.rdma.v1.Rdma/Info    unary   INFO_REQ   -> INFO_RESP   (+ UTF-8 message)
    /ctxmem.rdma.v1.Rdma/Attach  stream  ATTACH_REQ -> ATTACH_RESP (+ UTF-8 message),
                                         then nothing until either side ends the call

``Info`` tells the client the service's GID (so it can pick its own device and GID by
route), ``Attach`` creates the session's protection domain and queue pair on the service
and connects both. The ``Attach`` call stays open for the life of the RDMA connection:
when the client goes away (close, crash, dropped connection) the service tears the
session's verbs resources down, and when the service goes away the client sees the call
end and reconnects. Both requests carry the session id and token from ``Connect``.

All integers little-endian; GIDs are the 16 raw bytes of ``ibv_gid``.

GID choice (:func:`find_gid`) reads sysfs (``/sys/class/infiniband``), not verbs, so it
is the same code on both sides and testable without a device.
"""

from __future__ import annotations

import enum
import errno as errno_mod
import ipaddress
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ctxmem_common.errors import Unavailable

RDMA_SERVICE = "ctxmem.rdma.v1.Rdma"
INFO_METHOD = f"/{RDMA_SERVICE}/Info"
ATTACH_METHOD = f"/{RDMA_SERVICE}/Attach"
VERSION = 1

# magic, version, session_id, token
INFO_REQ = struct.Struct("<4sHxxQ16s")
# magic, version, status, gid, lid, mtu (ibv_mtu), responder depth (max_dest_rd_atomic)
INFO_RESP = struct.Struct("<4sHH16sHBB")
# magic, version, session_id, token, then the client's QP: qpn, psn, gid, lid, mtu,
# initiator depth (max_rd_atomic)
ATTACH_REQ = struct.Struct("<4sHxxQ16sII16sHBB")
# magic, version, status, then the service's QP: qpn, psn, gid, lid, mtu, responder depth
ATTACH_RESP = struct.Struct("<4sHHII16sHBB")

INFO_REQ_MAGIC, INFO_RESP_MAGIC = b"CXRI", b"CXRi"
ATTACH_REQ_MAGIC, ATTACH_RESP_MAGIC = b"CXRA", b"CXRa"

SYSFS_IB = Path("/sys/class/infiniband")


class RdmaStatus(enum.IntEnum):
    OK = 0
    BAD_REQUEST = 1
    UNAUTHENTICATED = 2
    WRONG_TRANSPORT = 3
    ALREADY_ATTACHED = 4
    DEVICE_ERROR = 5
    SHUTTING_DOWN = 6
    VERSION_MISMATCH = 7


STATUS_TEXT = {
    RdmaStatus.OK: "ok",
    RdmaStatus.BAD_REQUEST: "malformed RDMA exchange message",
    RdmaStatus.UNAUTHENTICATED: "unknown session or wrong session token (service restarted?)",
    RdmaStatus.WRONG_TRANSPORT: "the session was not opened with transport 'rdma' (Connect)",
    RdmaStatus.ALREADY_ATTACHED: "this session already has an RDMA connection",
    RdmaStatus.DEVICE_ERROR: "the service could not create or connect its queue pair",
    RdmaStatus.SHUTTING_DOWN: "the service is shutting down",
    RdmaStatus.VERSION_MISMATCH: "shim and service speak different RDMA exchange versions",
}


def status_text(status: int) -> str:
    try:
        return STATUS_TEXT[RdmaStatus(status)]
    except ValueError:
        return f"unknown status {status}"


@dataclass(frozen=True)
class QpInfo:
    """One end of an RC connection, as the other end needs it to reach RTR/RTS."""

    qpn: int
    psn: int
    gid: bytes
    lid: int
    mtu: int
    rd_atomic: int


@dataclass(frozen=True)
class InfoRequest:
    session_id: int
    token: bytes

    def pack(self) -> bytes:
        return INFO_REQ.pack(INFO_REQ_MAGIC, VERSION, self.session_id, self.token)

    @staticmethod
    def unpack(data: bytes) -> InfoRequest:
        if len(data) != INFO_REQ.size:
            raise ValueError(f"INFO request is {len(data)} bytes, expected {INFO_REQ.size}")
        magic, version, session_id, token = INFO_REQ.unpack(data)
        _check(magic, INFO_REQ_MAGIC, version)
        return InfoRequest(session_id, token)


@dataclass(frozen=True)
class InfoResponse:
    status: int
    gid: bytes = bytes(16)
    lid: int = 0
    mtu: int = 0
    rd_atomic: int = 0
    message: str = ""

    def pack(self) -> bytes:
        head = INFO_RESP.pack(INFO_RESP_MAGIC, VERSION, self.status, self.gid, self.lid,
                              self.mtu, self.rd_atomic)
        return head + self.message.encode()

    @staticmethod
    def unpack(data: bytes) -> InfoResponse:
        if len(data) < INFO_RESP.size:
            raise ValueError(f"INFO response is {len(data)} bytes, expected >= {INFO_RESP.size}")
        magic, version, status, gid, lid, mtu, rd = INFO_RESP.unpack_from(data)
        _check(magic, INFO_RESP_MAGIC, version)
        return InfoResponse(status, gid, lid, mtu, rd,
                            data[INFO_RESP.size:].decode(errors="replace"))


@dataclass(frozen=True)
class AttachRequest:
    session_id: int
    token: bytes
    qp: QpInfo

    def pack(self) -> bytes:
        q = self.qp
        return ATTACH_REQ.pack(ATTACH_REQ_MAGIC, VERSION, self.session_id, self.token,
                               q.qpn, q.psn, q.gid, q.lid, q.mtu, q.rd_atomic)

    @staticmethod
    def unpack(data: bytes) -> AttachRequest:
        if len(data) != ATTACH_REQ.size:
            raise ValueError(f"ATTACH request is {len(data)} bytes, expected {ATTACH_REQ.size}")
        magic, version, sid, token, qpn, psn, gid, lid, mtu, rd = ATTACH_REQ.unpack(data)
        _check(magic, ATTACH_REQ_MAGIC, version)
        return AttachRequest(sid, token, QpInfo(qpn, psn, gid, lid, mtu, rd))


@dataclass(frozen=True)
class AttachResponse:
    status: int
    qp: QpInfo | None = None
    message: str = ""

    def pack(self) -> bytes:
        q = self.qp or QpInfo(0, 0, bytes(16), 0, 0, 0)
        head = ATTACH_RESP.pack(ATTACH_RESP_MAGIC, VERSION, self.status, q.qpn, q.psn, q.gid,
                                q.lid, q.mtu, q.rd_atomic)
        return head + self.message.encode()

    @staticmethod
    def unpack(data: bytes) -> AttachResponse:
        if len(data) < ATTACH_RESP.size:
            raise ValueError(f"ATTACH response is {len(data)} bytes, expected >= "
                             f"{ATTACH_RESP.size}")
        magic, version, status, qpn, psn, gid, lid, mtu, rd = ATTACH_RESP.unpack_from(data)
        _check(magic, ATTACH_RESP_MAGIC, version)
        qp = QpInfo(qpn, psn, gid, lid, mtu, rd) if status == RdmaStatus.OK else None
        return AttachResponse(status, qp, data[ATTACH_RESP.size:].decode(errors="replace"))


class VersionMismatch(ValueError):
    pass


def _check(magic: bytes, want: bytes, version: int) -> None:
    if magic != want:
        raise ValueError(f"bad magic {magic!r}, expected {want!r}")
    if version != VERSION:
        raise VersionMismatch(f"RDMA exchange version {version}, this side speaks {VERSION}")


# ---------------------------------------------------------------------------------------
# GIDs and devices
# ---------------------------------------------------------------------------------------


def gid_from_str(text: str) -> bytes:
    """``"0000:...:ffff:0a00:020f"`` (sysfs, pyverbs ``GID.gid``) -> 16 bytes."""
    raw = bytes.fromhex(text.strip().replace(":", ""))
    if len(raw) != 16:
        raise ValueError(f"not a GID: {text!r}")
    return raw


def gid_to_str(gid: bytes) -> str:
    h = gid.hex()
    return ":".join(h[i : i + 4] for i in range(0, 32, 4))


def gid_ipv4(gid: bytes) -> str | None:
    """The IPv4 address of an IPv4-mapped GID (RoCE), else ``None``."""
    mapped = ipaddress.IPv6Address(gid).ipv4_mapped
    return str(mapped) if mapped is not None else None


class RdmaDeviceError(Unavailable):
    """No usable RDMA device/port/GID, or a verbs call failed; says what to check.

    ``errno`` is the OS error number when a verbs call or sysfs read failed, else 0.
    """

    def __init__(self, message: str, errno: int = 0) -> None:
        if errno:
            message = f"{message} (errno {errno}: {os.strerror(errno)})"
        super().__init__(message)
        self.errno = errno


# What to check, by errno, for verbs calls that fail on a misconfigured device or port.
_HINTS = {
    errno_mod.EINVAL: "check the GID index (service.rdma_gid_index / CTXMEM_RDMA_GID_INDEX), "
                      "the path MTU and the port state (`rdma link show`, `ibv_devinfo -v`)",
    errno_mod.ENOMEM: "registered memory is pinned: raise the memlock limit (ulimit -l, "
                      "systemd LimitMEMLOCK=infinity) or run with CAP_IPC_LOCK",
    errno_mod.EPERM: "the process may not use the device: check /dev/infiniband permissions "
                     "and the memlock limit",
    errno_mod.EACCES: "the process may not use the device: check /dev/infiniband permissions",
    errno_mod.ENODEV: "the device went away: check `rdma link show` and the driver",
    errno_mod.ETIMEDOUT: "the peer did not answer: check the port state, the GID index and "
                         "that both ends use RoCE v2 on a routable IP",
    errno_mod.EFAULT: "the buffer is not mapped for the requested access",
}


def verbs_hint(errno: int) -> str:
    return _HINTS.get(errno, "check the device (`ibv_devinfo`), the port state, the GID "
                             "index and the MTU")


@dataclass(frozen=True)
class GidChoice:
    device: str
    port: int
    gid_index: int
    gid: bytes
    gid_type: str
    netdev: str = ""

    @property
    def ipv4(self) -> str | None:
        return gid_ipv4(self.gid)

    def describe(self) -> str:
        return (f"{self.device} port {self.port} GID[{self.gid_index}] {gid_to_str(self.gid)} "
                f"({self.gid_type}{', ' + self.netdev if self.netdev else ''})")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # unpopulated GID entries fail with EINVAL
        return None


def _port_gids(port_dir: Path) -> list[tuple[int, bytes, str, str]]:
    out = []
    gids = port_dir / "gids"
    try:
        names = sorted(os.listdir(gids), key=lambda n: int(n) if n.isdigit() else -1)
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        text = _read(gids / name)
        if not text:
            continue
        try:
            gid = gid_from_str(text)
        except ValueError:
            continue
        if gid == bytes(16):
            continue
        gtype = _read(port_dir / "gid_attrs" / "types" / name) or ""
        ndev = _read(port_dir / "gid_attrs" / "ndevs" / name) or ""
        out.append((int(name), gid, gtype, ndev))
    return out


def _carries(gid: bytes, want: ipaddress.IPv4Address | ipaddress.IPv6Address | None) -> bool:
    """Whether ``gid`` is the GID of address ``want`` (``None``: of any IPv4 address)."""
    if want is None:
        return gid_ipv4(gid) is not None
    if isinstance(want, ipaddress.IPv4Address):
        return gid_ipv4(gid) == str(want)
    return ipaddress.IPv6Address(gid) == want


def list_devices(sysfs: Path = SYSFS_IB) -> list[str]:
    try:
        return sorted(os.listdir(sysfs))
    except OSError:
        return []


def find_gid(ip: str, device: str = "", gid_index: int = -1,
             sysfs: Path = SYSFS_IB) -> GidChoice:
    """The device, port and GID that carry ``ip`` (RoCE v2), or those named explicitly.

    Args:
        ip: an IPv4 address of the RDMA device; ``""``/``"0.0.0.0"`` means any (the first
            ACTIVE port with an IPv4 RoCE v2 GID).
        device: restrict to this verbs device (``rxe0``, ``mlx5_0``); ``""`` searches all.
        gid_index: use this GID index instead of searching (``-1``: search).

    Raises:
        RdmaDeviceError: with what was found and what to check.
    """
    any_ip = ip in ("", "0.0.0.0")
    want = None if any_ip else ipaddress.ip_address(ip)
    devices = list_devices(sysfs)
    if not devices:
        raise RdmaDeviceError(
            f"no RDMA devices ({sysfs} is empty or absent): load the NIC's RDMA driver, or "
            f"for Soft-RoCE `rdma link add rxe0 type rxe netdev <netdev>`")
    if device:
        if device not in devices:
            raise RdmaDeviceError(f"RDMA device {device!r} not found; present: {devices} "
                                  f"(check service.rdma_device / CTXMEM_RDMA_DEVICE)")
        devices = [device]
    seen: list[str] = []
    down: list[str] = []
    for dev in devices:
        ports_dir = sysfs / dev / "ports"
        try:
            ports = sorted(int(p) for p in os.listdir(ports_dir) if p.isdigit())
        except OSError:
            continue
        for port in ports:
            pdir = ports_dir / str(port)
            state = _read(pdir / "state") or "?"
            gids = _port_gids(pdir)
            if gid_index >= 0:
                match = [g for g in gids if g[0] == gid_index]
                if not match:
                    seen.append(f"{dev}/{port}: GID[{gid_index}] unpopulated")
                    continue
                idx, gid, gtype, ndev = match[0]
                if not _carries(gid, want):
                    seen.append(f"{dev}/{port}: GID[{gid_index}] is {gid_to_str(gid)}, not {ip}")
                    continue
            else:
                cands = [g for g in gids if "v2" in g[2].lower() and _carries(g[1], want)]
                seen.extend(f"{dev}/{port}: GID[{g[0]}] {gid_to_str(g[1])} {g[2]}"
                            for g in gids)
                if not cands:
                    continue
                idx, gid, gtype, ndev = cands[0]
            if "ACTIVE" not in state:
                down.append(f"{dev} port {port} is {state}")
                continue
            return GidChoice(dev, port, idx, gid, gtype, ndev)
    if down:
        raise RdmaDeviceError(
            f"RDMA port not ACTIVE: {'; '.join(down)}; check the link (`rdma link show`, "
            f"`ip link`) and, for Soft-RoCE, that the netdev is up")
    where = f"device {device!r}" if device else f"devices {devices}"
    what = (f"GID index {gid_index}" if gid_index >= 0 else
            f"a RoCE v2 GID for {'any IPv4 address' if any_ip else ip}")
    raise RdmaDeviceError(
        f"no {what} on {where}; found: {seen or 'no GIDs'}; check service.rdma_listen's IP "
        f"(it must be an address of the RDMA netdev), service.rdma_gid_index and "
        f"`rdma link show`")


def local_ip_towards(peer_ip: str) -> str:
    """The source address the kernel would use to reach ``peer_ip`` (no packet is sent)."""
    import socket

    family = socket.AF_INET6 if ":" in peer_ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((peer_ip, 4791))  # RoCE v2's UDP port; connect() on UDP sends nothing
        return str(s.getsockname()[0])
