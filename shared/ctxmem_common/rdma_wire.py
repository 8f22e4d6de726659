"""What both ends of the RDMA data path agree on: queue-pair attributes and GID choice.

The RDMA transport moves bytes with one-sided RDMA WRITE and READ on a reliable-connected
(RC) queue pair per session. The two queue pairs are connected by exchanging their
attributes over the *control plane*, with two calls of ``ctxmem.v1.ContextMemory``
(``ctxmem.proto`` is the schema; see ``docs/rdma.md`` for why not rdma_cm)::

    RdmaInfo    unary   RdmaInfoRequest   -> RdmaInfoResponse
    RdmaAttach  stream  RdmaAttachRequest -> one RdmaAttachResponse, then nothing until
                                             either side ends the call

``RdmaInfo`` tells the client the service's GID (so it can pick its own device and GID by
route), ``RdmaAttach`` creates the session's protection domain and queue pair on the
service and connects both. The ``RdmaAttach`` call stays open for the life of the RDMA
connection: when the client goes away (close, crash, dropped connection) the service
tears the session's verbs resources down, and when the service goes away the client sees
the call end and reconnects. Both requests carry the session id and token from
``Connect``; refusals are gRPC status codes from :mod:`ctxmem_common.errors`, as for
every other call.

:class:`QpInfo` is the checked, typed form of an ``RdmaQp`` message that both sides work
with. GID choice (:func:`find_gid`) reads sysfs (``/sys/class/infiniband``), not verbs, so
it is the same code on both sides and testable without a device.
"""

from __future__ import annotations

import errno as errno_mod
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from ctxmem_common.errors import InvalidArgument, Unavailable
from ctxmem_common.proto import ctxmem_pb2 as pb

SYSFS_IB = Path("/sys/class/infiniband")

# Upper bounds of RdmaQp's fields, from the verbs types they end up in: QPNs and PSNs are
# 24 bits, a LID 16 bits, the MTU an enum ibv_mtu (0: not given, use the other end's),
# the READ depths uint8_t.
_QP_LIMITS = {"qpn": 0xFFFFFF, "psn": 0xFFFFFF, "lid": 0xFFFF, "mtu": 5, "rd_atomic": 0xFF}


@dataclass(frozen=True)
class QpInfo:
    """One end of an RC connection, as the other end needs it to reach RTR/RTS."""

    qpn: int
    psn: int
    gid: bytes
    lid: int
    mtu: int
    rd_atomic: int

    @staticmethod
    def from_pb(msg: pb.RdmaQp) -> QpInfo:
        return QpInfo(msg.qpn, msg.psn, msg.gid, msg.lid, msg.mtu, msg.rd_atomic)

    def to_pb(self) -> pb.RdmaQp:
        return pb.RdmaQp(qpn=self.qpn, psn=self.psn, gid=self.gid, lid=self.lid, mtu=self.mtu,
                         rd_atomic=self.rd_atomic)

    def check(self, what: str) -> QpInfo:
        """``self`` if every field fits its verbs type, else :class:`InvalidArgument`
        naming the field (``what``: where the QP came from, e.g. ``RdmaAttachRequest.qp``)."""
        bad = [f"{name} {getattr(self, name)} > {limit}" for name, limit in _QP_LIMITS.items()
               if getattr(self, name) > limit]
        if len(self.gid) != 16:
            bad.append(f"gid is {len(self.gid)} bytes, not 16")
        if bad:
            raise InvalidArgument(f"{what}: {'; '.join(bad)} (RdmaQp fields are the verbs "
                                  f"values of the sender's queue pair)")
        return self


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
