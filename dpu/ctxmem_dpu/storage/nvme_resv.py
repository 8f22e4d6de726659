"""NVMe persistent reservations on a namespace, sent through the kernel's passthrough
ioctl (``NVME_IOCTL_IO_CMD`` on the namespace's block device; Identify through
``NVME_IOCTL_ADMIN_CMD`` on the same descriptor).

A pod's shared flash device (docs/pod.md, "Shared flash") is fenced by the slab headers'
epochs everywhere and, where the target offers them, by reservations:

* every live node *registers* a key derived from its node id (:func:`node_key`; Register,
  action Replace with IEKEY, so a restarted node registers again under the same key);
* the namespace is reserved **Write Exclusive - All Registrants** (:data:`RESV_TYPE`): every
  registered node may write, everyone may read (the read-only ``SharedFlashSource``
  of any node needs no registration), and the reservation stays as long as any node is
  registered (with *Registrants Only* there is one holder: preempting or losing it would
  release the reservation and let unregistered hosts write);
* a node that takes a dead node's slab first *preempts and aborts* the dead node's key
  (Acquire, action Preempt and Abort, PRKEY = the dead node's key): the target
  unregisters it and aborts its queued commands, so any write it still sends fails on the
  device with Reservation Conflict (the block layer's ``EBADE``);
* a node whose key is gone stops acknowledging durable writes (the service's fence).

Where the target offers none (a plain file, a device that is not an NVMe namespace, a
controller whose Identify Controller clears ONCS bit 5 — kernel ``nvmet`` before Linux
6.13 — or a namespace reporting no Write Exclusive - All Registrants in RESCAP) :func:`probe`
says why and the on-device epoch alone fences; the caller logs it once and shows it in
its metrics.

The passthrough structure is ``struct nvme_passthru_cmd`` of ``linux/nvme_ioctl.h``
(72 bytes); a positive ioctl return is the NVMe status (status code in bits 7:0, status
code type in 10:8, More 13, Do Not Retry 14), a negative one an errno (``OSError``).
The kernel requires CAP_SYS_ADMIN for passthrough on 6.1 (and for these commands after).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import logging
import os
import stat
import struct
from dataclasses import dataclass
from enum import IntEnum
from types import TracebackType

log = logging.getLogger(__name__)

#: ``struct nvme_passthru_cmd``: opcode, flags, rsvd1, nsid, cdw2, cdw3, metadata, addr,
#: metadata_len, data_len, cdw10..cdw15, timeout_ms, result.
PASSTHRU = struct.Struct("<BBHIIIQQII6III")
assert PASSTHRU.size == 72


def _iowr(kind: str, nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (ord(kind) << 8) | nr


NVME_IOCTL_ID = (ord("N") << 8) | 0x40  # _IO('N', 0x40): the namespace id
NVME_IOCTL_ADMIN_CMD = _iowr("N", 0x41, PASSTHRU.size)  # 0xC0484E41
NVME_IOCTL_IO_CMD = _iowr("N", 0x43, PASSTHRU.size)  # 0xC0484E43


class Opcode(IntEnum):
    IDENTIFY = 0x06  # admin
    RESV_REGISTER = 0x0D
    RESV_REPORT = 0x0E
    RESV_ACQUIRE = 0x11
    RESV_RELEASE = 0x15


COMMAND_NAMES = {Opcode.IDENTIFY: "Identify", Opcode.RESV_REGISTER: "Reservation Register",
                 Opcode.RESV_REPORT: "Reservation Report",
                 Opcode.RESV_ACQUIRE: "Reservation Acquire",
                 Opcode.RESV_RELEASE: "Reservation Release"}


class ResvType(IntEnum):
    WRITE_EXCLUSIVE = 1
    EXCLUSIVE_ACCESS = 2
    WRITE_EXCLUSIVE_REGISTRANTS_ONLY = 3
    EXCLUSIVE_ACCESS_REGISTRANTS_ONLY = 4
    WRITE_EXCLUSIVE_ALL_REGISTRANTS = 5
    EXCLUSIVE_ACCESS_ALL_REGISTRANTS = 6


#: The type a pod reserves its shared namespaces with (module docstring).
RESV_TYPE = ResvType.WRITE_EXCLUSIVE_ALL_REGISTRANTS


class RegisterAction(IntEnum):
    REGISTER = 0
    UNREGISTER = 1
    REPLACE = 2


class AcquireAction(IntEnum):
    ACQUIRE = 0
    PREEMPT = 1
    PREEMPT_AND_ABORT = 2


class ReleaseAction(IntEnum):
    RELEASE = 0
    CLEAR = 1


# Generic command status (status code type 0) values a caller may meet here.
SC_INVALID_OPCODE = 0x01
SC_INVALID_FIELD = 0x02
SC_RESERVATION_CONFLICT = 0x83
STATUS_NAMES = {
    0x00: "Successful Completion", 0x01: "Invalid Command Opcode",
    0x02: "Invalid Field in Command", 0x04: "Data Transfer Error", 0x06: "Internal Error",
    0x07: "Command Abort Requested", 0x08: "Command Aborted due to SQ Deletion",
    0x0B: "Invalid Namespace or Format", 0x0C: "Command Sequence Error",
    0x18: "Host Identifier Inconsistent Format", 0x80: "LBA Out of Range",
    0x82: "Namespace Not Ready", 0x83: "Reservation Conflict",
}

ONCS_OFFSET = 520  # Identify Controller: Optional NVM Command Support (16 bits)
ONCS_RESERVATIONS = 1 << 5
RESCAP_OFFSET = 31  # Identify Namespace: Reservation Capabilities (8 bits)
IDENTIFY_BYTES = 4096
REPORT_HEADER = 64  # the extended Reservation Status data structure (EDS = 1)
REPORT_ENTRY = 64  # one Registrant Controller Extended data structure


def status_text(status: int) -> str:
    """``0x83 Reservation Conflict (SCT 0)`` for the status an ioctl returned."""
    sct, sc = (status >> 8) & 0x7, status & 0xFF
    name = STATUS_NAMES.get(sc, "status") if sct == 0 else "command specific" if sct == 1 \
        else "media error" if sct == 2 else "path error" if sct == 3 else "status"
    return f"0x{sc:02x} {name} (SCT {sct})"


def node_key(node_id: str) -> int:
    """The reservation key of pod node ``node_id``: 64 bits of BLAKE2b over it, never 0
    (0 means "no key" to Preempt). Any node derives any other's (to preempt it)."""
    d = hashlib.blake2b(node_id.encode(), digest_size=8, person=b"ctxmem-resv-key").digest()
    return int.from_bytes(d, "little") or 1


# -- packing (pure: the host tests check each against the specification) ---------------
def pack_cmd(opcode: int, nsid: int, addr: int, data_len: int, cdw10: int = 0,
             cdw11: int = 0, timeout_ms: int = 0) -> bytearray:
    """A ``struct nvme_passthru_cmd``, mutable (the kernel writes ``result`` back)."""
    return bytearray(PASSTHRU.pack(opcode, 0, 0, nsid, 0, 0, 0, addr, 0, data_len,
                                   cdw10, cdw11, 0, 0, 0, 0, timeout_ms, 0))


def register_cdw10(action: RegisterAction, iekey: bool = False, cptpl: int = 0) -> int:
    """RREGA (bits 2:0), IEKEY (bit 3), CPTPL (bits 31:30: 0 no change)."""
    return int(action) | (int(iekey) << 3) | ((cptpl & 3) << 30)


def acquire_cdw10(action: AcquireAction, rtype: ResvType, iekey: bool = False) -> int:
    """RACQA (bits 2:0), IEKEY (bit 3), RTYPE (bits 15:8)."""
    return int(action) | (int(iekey) << 3) | (int(rtype) << 8)


def release_cdw10(action: ReleaseAction, rtype: ResvType, iekey: bool = False) -> int:
    """RRELA (bits 2:0), IEKEY (bit 3), RTYPE (bits 15:8)."""
    return int(action) | (int(iekey) << 3) | (int(rtype) << 8)


def key_pair(first: int, second: int = 0) -> bytes:
    """Register's CRKEY+NRKEY, Acquire's CRKEY+PRKEY: two little-endian 64-bit keys."""
    return struct.pack("<QQ", first, second)


def report_cdw10(nbytes: int) -> int:
    """NUMD: the number of dwords to transfer, less one."""
    return nbytes // 4 - 1


@dataclass(frozen=True, slots=True)
class Registrant:
    cntlid: int
    holder: bool  # RCSTS bit 0: this registrant holds the reservation
    key: int
    hostid: bytes  # 128-bit host identifier (the initiator's hostid)


@dataclass(frozen=True, slots=True)
class ReservationStatus:
    generation: int
    rtype: int  # 0: not reserved
    ptpls: bool
    registrants: tuple[Registrant, ...]

    def registered_keys(self) -> set[int]:
        return {r.key for r in self.registrants}


def parse_report(buf: bytes | bytearray | memoryview) -> ReservationStatus:
    """The extended Reservation Status data structure (Report with EDS = 1): a 64-byte
    header (GEN, RTYPE, REGCTL, PTPLS) and REGCTL 64-byte entries (CNTLID, RCSTS, RKEY,
    HOSTID); entries beyond the buffer are left out."""
    mv = memoryview(buf)
    gen, rtype, regctl = struct.unpack_from("<IBH", mv, 0)
    ptpls = mv[9]
    regs: list[Registrant] = []
    for i in range(regctl):
        at = REPORT_HEADER + i * REPORT_ENTRY
        if at + REPORT_ENTRY > len(mv):
            break
        cntlid, rcsts = struct.unpack_from("<HB", mv, at)
        (key,) = struct.unpack_from("<Q", mv, at + 8)
        regs.append(Registrant(cntlid, bool(rcsts & 1), key, bytes(mv[at + 16:at + 32])))
    return ReservationStatus(gen, rtype, bool(ptpls & 1), tuple(regs))


# -- errors -------------------------------------------------------------------------------
class NvmeCommandError(OSError):
    """An NVMe command failed: names the device, the command, the NVMe status or errno,
    and what to do. ``status``: the NVMe status (``None`` when the ioctl itself failed)."""

    def __init__(self, err: int, message: str, status: int | None = None) -> None:
        super().__init__(err, message)
        self.status = status

    @property
    def sc(self) -> int | None:
        return None if self.status is None or (self.status >> 8) & 7 else self.status & 0xFF


class ReservationConflict(NvmeCommandError):
    """The target refused the command with Reservation Conflict (0x83)."""


@dataclass(frozen=True, slots=True)
class Support:
    """Whether reservations can fence this device, and why not."""

    ok: bool
    reason: str  # why not ("" when ok)


# -- the device ---------------------------------------------------------------------------
class NvmeReservation:
    """Reservations on one namespace for one pod node. Owns a descriptor (a ``dup`` of
    the caller's, or its own ``open``); :meth:`close` (or ``with``) releases it and sends
    nothing: unregistering is :meth:`unregister`, explicit."""

    def __init__(self, fd: int, device: str, node_id: str, *, own: bool = False,
                 timeout_ms: int = 30_000) -> None:
        self.fd = fd if own else os.dup(fd)
        self.device = device
        self.node_id = node_id
        self.key = node_key(node_id)
        self.timeout_ms = timeout_ms
        self.nsid = 0

    @classmethod
    def open(cls, path: str, node_id: str, device: str | None = None) -> NvmeReservation:
        return cls(os.open(path, os.O_RDONLY | os.O_CLOEXEC), device or path, node_id,
                   own=True)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> NvmeReservation:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- probe ----------------------------------------------------------------------
    def probe(self) -> Support:
        """Can reservations fence this device? Not a block device, not an NVMe namespace
        (ENOTTY), a controller without ONCS bit 5, a namespace whose RESCAP lacks Write
        Exclusive - All Registrants, or passthrough not permitted: no, and why."""
        mode = os.fstat(self.fd).st_mode
        if not stat.S_ISBLK(mode):
            return Support(False, "not a block device (a file has no NVMe reservations)")
        try:
            self.nsid = fcntl.ioctl(self.fd, NVME_IOCTL_ID)
        except OSError as exc:
            if exc.errno in (errno.ENOTTY, errno.EINVAL):
                return Support(False, f"not an NVMe namespace (NVME_IOCTL_ID: "
                                      f"{errno.errorcode.get(exc.errno, exc.errno)})")
            raise
        try:
            ctrl = self._identify(cns=1, nsid=0)
            oncs = struct.unpack_from("<H", ctrl, ONCS_OFFSET)[0]
            if not oncs & ONCS_RESERVATIONS:
                return Support(False, f"the controller does not support reservations "
                                      f"(ONCS 0x{oncs:04x}: bit 5 clear in Identify "
                                      f"Controller)")
            ns = self._identify(cns=0, nsid=self.nsid)
            rescap = ns[RESCAP_OFFSET]
            if not rescap & (1 << RESV_TYPE):
                return Support(False, f"namespace {self.nsid} offers no Write Exclusive - "
                                      f"All Registrants reservation (RESCAP 0x{rescap:02x})")
        except NvmeCommandError as exc:
            if exc.errno in (errno.EPERM, errno.EACCES):
                return Support(False, f"NVMe passthrough not permitted ({exc}): the service "
                                      f"needs CAP_SYS_ADMIN to send reservations")
            if exc.sc == SC_INVALID_OPCODE or exc.errno == errno.ENOTTY:
                return Support(False, str(exc))
            raise
        return Support(True, "")

    # -- commands -------------------------------------------------------------------
    def _submit(self, request: int, opcode: Opcode, nsid: int, data: bytearray | None,
                cdw10: int, cdw11: int = 0, what: str = "") -> None:
        buf = (ctypes.c_char * len(data)).from_buffer(data) if data else None
        cmd = pack_cmd(opcode, nsid, ctypes.addressof(buf) if buf is not None else 0,
                       len(data) if data else 0, cdw10, cdw11, self.timeout_ms)
        name = COMMAND_NAMES.get(opcode, f"opcode 0x{opcode:02x}") + (f" ({what})" if what
                                                                       else "")
        try:
            status = fcntl.ioctl(self.fd, request, cmd)
        except OSError as exc:
            hint = ("the service needs CAP_SYS_ADMIN for NVMe passthrough"
                    if exc.errno in (errno.EPERM, errno.EACCES) else
                    "the device is not an NVMe namespace" if exc.errno == errno.ENOTTY else
                    "check the controller's state (nvme list-subsys) and the target")
            err = exc.errno or errno.EIO
            raise NvmeCommandError(err, f"{self.device}: {name} failed: "
                                   f"{errno.errorcode.get(err, err)} "
                                   f"({exc.strerror}); {hint}") from None
        finally:
            del buf
        if status:
            cls = (ReservationConflict if (status >> 8) & 7 == 0
                   and status & 0xFF == SC_RESERVATION_CONFLICT else NvmeCommandError)
            hint = ("another host holds a conflicting reservation, or this node's key is "
                    "not registered (preempted by a node that took its slabs): restart "
                    "the service to register again" if cls is ReservationConflict else
                    "the target does not support this command: the on-device epoch alone "
                    "fences" if status & 0x7FF == SC_INVALID_OPCODE else
                    "see the target's log")
            raise cls(errno.EBADE if cls is ReservationConflict else errno.EIO,
                      f"{self.device}: {name} failed with NVMe status {status_text(status)}"
                      f"; {hint}", status)

    def _io(self, opcode: Opcode, data: bytearray | None, cdw10: int, cdw11: int = 0,
            what: str = "") -> None:
        self._submit(NVME_IOCTL_IO_CMD, opcode, self.nsid or self._nsid(), data, cdw10,
                     cdw11, what)

    def _nsid(self) -> int:
        self.nsid = fcntl.ioctl(self.fd, NVME_IOCTL_ID)
        return self.nsid

    def _identify(self, cns: int, nsid: int) -> bytearray:
        data = bytearray(IDENTIFY_BYTES)
        self._submit(NVME_IOCTL_ADMIN_CMD, Opcode.IDENTIFY, nsid, data, cns,
                     what="controller" if cns == 1 else f"namespace {nsid}")
        return data

    def register(self) -> None:
        """Register this node's key (Replace with IEKEY: registers it when this host has
        no key, replaces a stale one; the same key again is a no-op)."""
        self._io(Opcode.RESV_REGISTER, bytearray(key_pair(0, self.key)),
                 register_cdw10(RegisterAction.REPLACE, iekey=True),
                 what=f"register node {self.node_id!r}")

    def unregister(self) -> None:
        self._io(Opcode.RESV_REGISTER, bytearray(key_pair(self.key, 0)),
                 register_cdw10(RegisterAction.UNREGISTER),
                 what=f"unregister node {self.node_id!r}")

    def acquire(self, rtype: ResvType = RESV_TYPE) -> None:
        """Reserve the namespace (a no-op success when it is already reserved with
        ``rtype`` of All Registrants: every registrant holds it)."""
        self._io(Opcode.RESV_ACQUIRE, bytearray(key_pair(self.key, 0)),
                 acquire_cdw10(AcquireAction.ACQUIRE, rtype),
                 what=f"acquire {rtype.name} as node {self.node_id!r}")

    def preempt(self, victim_key: int, rtype: ResvType = RESV_TYPE, abort: bool = True,
                victim: str = "") -> None:
        """Unregister the hosts registered with ``victim_key`` (and abort their queued
        commands when ``abort``)."""
        action = AcquireAction.PREEMPT_AND_ABORT if abort else AcquireAction.PREEMPT
        self._io(Opcode.RESV_ACQUIRE, bytearray(key_pair(self.key, victim_key)),
                 acquire_cdw10(action, rtype),
                 what=f"{action.name.lower().replace('_', '-')} "
                      f"{'node ' + repr(victim) if victim else hex(victim_key)}")

    def release(self, rtype: ResvType = RESV_TYPE, clear: bool = False) -> None:
        action = ReleaseAction.CLEAR if clear else ReleaseAction.RELEASE
        self._io(Opcode.RESV_RELEASE, bytearray(struct.pack("<Q", self.key)),
                 release_cdw10(action, rtype), what=action.name.lower())

    def report(self, max_registrants: int = 64) -> ReservationStatus:
        n = REPORT_HEADER + max_registrants * REPORT_ENTRY
        data = bytearray(n)
        self._io(Opcode.RESV_REPORT, data, report_cdw10(n), 1, what="extended")
        return parse_report(data)

    def registered(self) -> bool:
        """Is this node's key registered on the namespace now?"""
        return self.key in self.report().registered_keys()
