"""What ``ctxmem chaos`` knows about the world: the fault kinds, the model of each key
(:class:`Key`), the records found on the device files (:class:`Loc`, :func:`scan_file`,
:class:`Files`) and the counters of the report (:class:`Stats`).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ctxmem.transport.base import TransportError
from ctxmem_common.errors import CtxmemError
from ctxmem_common.faultpoints import POINTS
from ctxmem_common.flash_format import (
    SECTOR,
    FlashReader,
    Superblock,
    fit_records,
    header_offset,
    payload_offset,
)

CORRUPTION = ("bitflip_payload", "bitflip_header", "zero_payload_sector", "zero_header",
              "copy_record", "copy_record_cross_device", "foreign_namespace", "stale_extent",
              "truncate_payload_area", "zero_slab_header", "superblock_damage")
DEVICE = ("eio_read", "eio_write", "enospc_write", "eio_sync", "slow_device", "flaky_device",
          "swap_devices_live")
CRASH = ("kill_point", "powercut_point", "kill_random", "kill_rebuild", "swap_devices_restart",
         "truncate_device_restart")
KILL_POINTS = ("allocate.after_reserve", "commit.after_crc", "commit.after_index",
               "demote.before_write", "demote.after_payload", "demote.after_payload_sync",
               "demote.after_header", "demote.after_sync", "evict.after_demote",
               "delete.after_index", "delete.after_zero", "delete.after_sync",
               "promote.after_read")
POWERCUT_POINTS = ("demote.after_payload", "demote.after_payload_sync", "demote.after_header",
                   "demote.after_sync", "delete.after_zero")
# The campaign's choice among the service's points (ctxmem_common.faultpoints): a renamed
# point must fail here, at import, not arm nothing.
assert set(KILL_POINTS + POWERCUT_POINTS) <= set(POINTS), "unknown fault point"
TENANTS = ("alice", "bob")
IO_ERRORS = (CtxmemError, TransportError, OSError)


@dataclass
class Key:
    tenant: str
    durable: bool = False
    tainted: bool = False
    uncertain: bool = False
    deleted: bool = False


@dataclass
class Loc:
    """One valid record found on a device file."""

    dev: str
    path: Path
    slab: int
    slot: int
    slot_size: int
    slab_size: int
    ns: bytes
    key: bytes
    seq: int
    length: int

    @property
    def header_off(self) -> int:
        return header_offset(self.slab, self.slot, self.slab_size)

    @property
    def payload_off(self) -> int:
        return payload_offset(self.slab, self.slot, self.slab_size, self.slot_size)


def scan_file(name: str, path: Path, orphan_slot: int = 0
              ) -> tuple[list[Loc], Superblock | None, list[int]]:
    """The valid records of a device file as a restart would find them (buffered reads),
    its superblock, and the used slabs. With ``orphan_slot``, also the records of slabs
    whose header is damaged, read as slabs of that slot size (the running service still
    uses them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        reader = FlashReader(fd)
        sb = reader.superblocks().current
        if sb is None:
            return [], None, []
        out: list[Loc] = []
        used: list[int] = []
        for scan in reader.walk(sb, orphan_slot_size=orphan_slot):
            if scan.records.slot:
                used.append(scan.slab)
            for i, ns, key, length, _crc, seq, _enc, _ts in zip(
                    *fit_records(scan.records, scan.slot_size), strict=True):
                out.append(Loc(name, path, scan.slab, i, scan.slot_size, sb.slab_size, ns, key,
                               seq, length))
        return out, sb, used
    finally:
        os.close(fd)


class Files:
    """Direct access to the service's flash files (buffered; the service uses O_DIRECT,
    and the kernel keeps the two coherent)."""

    def __init__(self, paths: dict[str, Path], slot: int) -> None:
        self.paths = paths
        self.slot = slot
        self.seen: dict[bytes, Loc] = {}  # where each key's record was last seen

    def read(self, dev: str, off: int, n: int) -> bytes:
        fd = os.open(self.paths[dev], os.O_RDONLY)
        try:
            return os.pread(fd, n, off)
        finally:
            os.close(fd)

    def write(self, dev: str, off: int, data: bytes) -> None:
        fd = os.open(self.paths[dev], os.O_WRONLY)
        try:
            os.pwrite(fd, data, off)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def superblock(self, dev: str) -> Superblock | None:
        """The superblock of ``dev`` that counts (either copy), ``None`` when both are bad."""
        fd = os.open(self.paths[dev], os.O_RDONLY)
        try:
            return FlashReader(fd).superblocks().current
        finally:
            os.close(fd)

    def damage_superblock(self, dev: str, offsets: tuple[int, ...]) -> None:
        """Flip a bit inside the superblock copies at ``offsets`` (``SB_OFFSET``,
        ``SB_BACKUP_OFFSET``): each then fails its CRC. A copy that is already damaged (an
        earlier fault, not repaired by a restart yet) is left alone: flipping the same bit
        again would repair it."""
        for off in offsets:
            if Superblock.unpack(self.read(dev, off, SECTOR)) is None:
                continue
            byte = self.read(dev, off + 8, 1)[0]
            self.write(dev, off + 8, bytes([byte ^ 0x10]))

    def scan(self, restart_view: bool = False) -> list[Loc]:
        """Every record the running service uses (``restart_view``: only those a restart
        would find: none in slabs whose header is damaged)."""
        out: list[Loc] = []
        for name, path in self.paths.items():
            out += scan_file(name, path, 0 if restart_view else self.slot)[0]
        for loc in out:
            self.seen[loc.key] = loc
        return out


SERVICE_COUNTERS = ("integrity_failures", "flash_device_failures", "flash_device_recoveries",
                    "evictions_flash")
"""The service's own counters the report carries (summed over its incarnations)."""


@dataclass
class Stats:
    """The campaign's counters (the report's fields of the same names)."""

    # what was done to the service
    faults_injected: int = 0
    restarts: int = 0
    kills: int = 0
    io_errors_injected: int = 0
    powercut_writes_dropped: int = 0
    faults_by_kind: Counter[str] = field(default_factory=Counter)
    # what the workload saw
    blocks_committed: int = 0
    blocks_served: int = 0
    wrong_blocks: int = 0
    blocks_lost: int = 0
    durable_blocks_lost: int = 0
    kill_points_hit: Counter[str] = field(default_factory=Counter)
    resurrected_blocks: int = 0
    tainted_blocks: int = 0
    tainted_misses: int = 0
    op_errors: int = 0
    # per kind: the failures each found (wrong or lost blocks, an alias not refused, ...)
    kind_failures: Counter[str] = field(default_factory=Counter)
    # after every restart
    space_leak_bytes: int = 0
    leak_checks: int = 0
    service: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)


def overwrite(path: Path, data: bytes) -> None:
    """Rewrite a file in place (no truncation: the service has it open)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, 0)
        os.fdatasync(fd)
    finally:
        os.close(fd)
