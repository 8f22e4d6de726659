"""``ctxmem chaos``: a fault campaign against a live ctxmem service.

The service runs as a child process (``python -m ctxmem_dpu serve``, via
:class:`ctxmem.launcher.ServiceProcess`) on two flash files, with two tenants writing
through the shim; this program injects faults and checks, after every operation, that
nothing wrong is ever served and that durable blocks survive. It never imports the
service: it edits the flash files directly (with the format code in
``ctxmem_common.flash_format``), drives the service's fault layer through its control
file (``CTXMEM_FAULT_CTL``, see ``ctxmem_dpu/faults.py``), and kills it.

Fault kinds (``KINDS``):

* on-device corruption, many per round, cheap: bit flips in a payload or a header, a
  zeroed payload sector or header, a record copied over another slot (same device or the
  other one), a record of the other tenant's namespace copied over a slot, a stale record
  of a deleted block written back over a live slot, a truncated payload area, a zeroed
  slab header, a damaged superblock copy;
* device faults through the file layer: EIO on reads, EIO or ENOSPC on writes, EIO on
  fdatasync, a slow device, a flaky one (30% of calls fail), and the two devices swapped
  under the running service (contents exchanged, then put back);
* crashes: SIGKILL at a named fault point (``kill``), a power cut at a named point
  (unsynced writes dropped or torn, then SIGKILL), SIGKILL at a random moment, SIGKILL
  during the index rebuild itself, the device files swapped between restarts, a device
  truncated between restarts.

The model: every key's content is a function of the key (keys are content hashes, as
engines' block hashes are), so "what was committed under this key" is known exactly and
every served block is compared byte for byte. Per key it tracks: committed, durable (seen
flash-only after Evict, or recovered by a restart), tainted (its record was damaged on
purpose: a miss is expected), uncertain (an operation on it was cut by a crash), deleted.

Checks, counted in the JSON (``faults_injected``, ``blocks_committed``, ``blocks_served``,
``wrong_blocks`` and ``blocks_lost`` at the top level):

* ``wrong_blocks`` — served bytes that differ from the key's content: must be 0;
* ``durable_blocks_lost`` — after a restart, a durable, undamaged block not served:
  must be 0; ``blocks_lost`` counts committed blocks that were not yet durable at a crash
  and did not come back (allowed), with ``lost_fraction`` of all committed blocks;
* ``resurrected_blocks`` — a block whose delete was acknowledged served again: must be 0;
* ``space_leak_bytes`` — after every restart, the service's ``flash_used_bytes`` minus the
  slot bytes of the valid records on the files: must be 0 (no leaked or doubly used
  extent); at the end ``ctxmem check --repair`` then ``ctxmem check`` must be clean.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ctxmem.client import Client, Namespace
from ctxmem.launcher import ServiceProcess, local_config
from ctxmem.transport.base import TransportError
from ctxmem_common.errors import CtxmemError
from ctxmem_common.flash_format import (
    DATA_START,
    REC_SIZE,
    SB_BACKUP_OFFSET,
    SECTOR,
    SlabHeader,
    Superblock,
    header_offset,
    parse_header_columns,
    payload_offset,
    slab_base,
    slots_per_slab,
)
from ctxmem_common.layout import KVLayout
from ctxmem_common.proto import ctxmem_pb2 as pb

CORRUPTION = ("bitflip_payload", "bitflip_header", "zero_payload_sector", "zero_header",
              "copy_record", "copy_record_cross_device", "foreign_namespace", "stale_extent",
              "truncate_payload_area", "zero_slab_header", "superblock_damage")
DEVICE = ("eio_read", "eio_write", "enospc_write", "eio_sync", "slow_device", "flaky_device",
          "swap_devices_live")
CRASH = ("kill_point", "powercut_point", "kill_random", "kill_rebuild", "swap_devices_restart",
         "truncate_device_restart")
KINDS = CORRUPTION + DEVICE + CRASH
KILL_POINTS = ("allocate.after_reserve", "commit.after_crc", "commit.after_index",
               "demote.before_write", "demote.after_payload", "demote.after_payload_sync",
               "demote.after_header", "demote.after_sync", "evict.after_demote",
               "delete.after_index", "delete.after_zero", "delete.after_sync",
               "promote.after_read")
POWERCUT_POINTS = ("demote.after_payload", "demote.after_payload_sync", "demote.after_header",
                   "demote.after_sync", "delete.after_zero")
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
        raw = os.pread(fd, 2 * SECTOR, 0)
        sb = Superblock.unpack(raw[:SECTOR]) or Superblock.unpack(raw[SECTOR:])
        if sb is None:
            return [], None, []
        size = os.fstat(fd).st_size
        out: list[Loc] = []
        used: list[int] = []
        for slab in range(sb.num_slabs):
            base = slab_base(slab, sb.slab_size)
            if base + SECTOR > size:
                break
            sh = SlabHeader.unpack(os.pread(fd, SECTOR, base))
            if sh is None or sh.slots != slots_per_slab(sb.slab_size, sh.slot_size):
                if not orphan_slot:
                    continue
                sh = SlabHeader(orphan_slot, slots_per_slab(sb.slab_size, orphan_slot))
            table = os.pread(fd, sh.slots * SECTOR, base + SECTOR)
            cols = parse_header_columns(table, len(table) // SECTOR)
            if cols.slot:
                used.append(slab)
            for i, ns, key, length, _crc, seq, _enc, _ts in zip(*cols, strict=True):
                if 0 < length <= sh.slot_size:
                    out.append(Loc(name, path, slab, i, sh.slot_size, sb.slab_size, ns, key,
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

    def scan(self, restart_view: bool = False) -> list[Loc]:
        """Every record the running service uses (``restart_view``: only those a restart
        would find: none in slabs whose header is damaged)."""
        out: list[Loc] = []
        for name, path in self.paths.items():
            out += scan_file(name, path, 0 if restart_view else self.slot)[0]
        for loc in out:
            self.seen[loc.key] = loc
        return out


@dataclass
class Stats:
    faults_injected: int = 0
    faults_by_kind: Counter[str] = field(default_factory=Counter)
    blocks_committed: int = 0
    blocks_served: int = 0
    wrong_blocks: int = 0
    blocks_lost: int = 0
    durable_blocks_lost: int = 0
    resurrected_blocks: int = 0
    tainted_blocks: int = 0
    tainted_misses: int = 0
    restarts: int = 0
    kills: int = 0
    kill_points_hit: Counter[str] = field(default_factory=Counter)
    space_leak_bytes: int = 0
    leak_checks: int = 0
    io_errors_injected: int = 0
    powercut_writes_dropped: int = 0
    op_errors: int = 0
    service_integrity_failures: int = 0
    service_flash_device_failures: int = 0
    service_flash_device_recoveries: int = 0
    service_evictions_flash: int = 0
    problems: list[str] = field(default_factory=list)


class Campaign:
    def __init__(self, workdir: Path, seed: int, block: int, verbose: bool,
                 working_set: int) -> None:
        self.workdir = workdir
        self.rng = random.Random(seed)
        self.seed = seed
        self.block = block
        self.verbose = verbose
        self.working_set = working_set
        self.layout = KVLayout(dtype="uint8", num_layers=1, num_kv_heads=1,
                               head_dim=block // 2, tokens_per_block=1)
        self.st = Stats()
        self.keys: dict[bytes, Key] = {}
        self.content: dict[bytes, bytes] = {}
        self.deleted: dict[bytes, Key] = {}
        self.captured: list[tuple[str, bytes, bytes, bytes]] = []  # tenant, key, hdr, payload
        self.next_key = 0
        self.gen = 0
        self.ctl = workdir / "faults.json"
        self.damaged_slabs: set[tuple[str, int]] = set()
        self.sb_damaged: set[str] = set()
        self.incarnation: dict[str, float] = {}
        self.events: deque[str] = deque(maxlen=400)
        self.ack_base: dict[str, int] = {}
        flash = {"flash0": workdir / "flash0.img", "flash1": workdir / "flash1.img"}
        self.files = Files(flash, (block + SECTOR - 1) // SECTOR * SECTOR)
        cfg = local_config(workdir, encryption=True, dram_size="16MiB", dram_slab="4MiB",
                           flash_size="64MiB", flash_slab="4MiB", flash_path=str(flash["flash0"]),
                           transports=["shm"], lease_ttl_s=30.0, allocation_ttl_s=30.0,
                           logging={"level": os.environ.get("CTXMEM_CHAOS_LOG", "warning")})
        cfg["flash"]["devices"].append({"name": "flash1", "backend": "local",
                                        "path": str(flash["flash1"]), "size": "64MiB",
                                        "create": True})
        cfg["flash"]["demote_batch"] = 16
        cfg["metrics"]["listen"] = ""
        self.config = cfg
        self._write_ctl()
        self.svc = ServiceProcess(workdir, cfg, start=False)
        self.client: Client | None = None
        self.ns: dict[str, Namespace] = {}
        self.check_before: dict[str, Any] = {}
        self.check_repair: dict[str, Any] = {}
        self.check_after: dict[str, Any] = {}

    # -- service ------------------------------------------------------------------------
    def start(self, env: dict[str, str] | None = None) -> bool:
        """Start the service; False if it died during start (a rebuild fault point)."""
        self._before_start()
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            self.svc.start(timeout_s=120)
        except RuntimeError as exc:
            if "status -9" in str(exc):
                return False
            raise
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.st.restarts += 1
        self.ack_base = {}
        # A new client after every start: the old one's channel may sit in gRPC's
        # reconnect backoff for a second (the shim would answer misses meanwhile).
        if self.client is not None:
            self.client.close()
        self.client = fresh_client(self.svc.endpoint)
        for t in TENANTS:
            self.ns[t] = self.client.open_namespace(self.layout, model_id="chaos", tenant=t)
        return True

    def _before_start(self) -> None:
        # A damaged slab header loses the slab's records at the restart: whatever the
        # service wrote there since, and what was there before, is gone (tainted).
        for dev, slab in self.damaged_slabs:
            self._taint_slab(dev, slab)
        self.damaged_slabs.clear()
        self.sb_damaged.clear()
        self._write_ctl()

    def _taint_slab(self, dev: str, slab: int) -> None:
        sb = scan_file(dev, self.files.paths[dev])[1]
        if sb is None:
            return
        base = slab_base(slab, sb.slab_size)
        if SlabHeader.unpack(self.files.read(dev, base, SECTOR).ljust(SECTOR, b"\0")):
            self.events.append(f"slab {dev}/{slab} header intact at restart")
            return  # the service rewrote it (scrub after a truncation): nothing is lost
        # The slot size is unknown (the header is gone); every record in the table counts.
        cap = (sb.slab_size - SECTOR) // (2 * SECTOR)
        table = self.files.read(dev, base + SECTOR, cap * SECTOR)
        cols = parse_header_columns(table, len(table) // SECTOR)
        for key in cols.key:
            self._taint(key)
        if cols.key:
            self.events.append(f"slab {dev}/{slab} lost at restart: {len(cols.key)} tainted")

    def alive(self) -> bool:
        return self.svc.proc is not None and self.svc.proc.poll() is None

    def wait_dead(self, timeout: float = 3.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                return True
            time.sleep(0.01)
        return False

    def crashed(self) -> None:
        """The service is gone (killed by us or by a fault point): restart and verify."""
        self._fold_counters(final=True)
        self.svc.kill()
        self.st.kills += 1
        self.restart_and_verify()

    def restart_and_verify(self, env: dict[str, str] | None = None) -> None:
        while not self.start(env):
            env = None  # died in the rebuild: start again, plainly
            self.st.kills += 1
        self.leak_check()
        self.verify_all(after_restart=True)

    def stats(self) -> dict[str, float]:
        assert self.client is not None
        return self.client.stats()

    def _fold_counters(self, final: bool = False) -> None:
        """Carry the service's counters over restarts (they restart at 0)."""
        cur: dict[str, float] = {}
        if self.alive():
            with contextlib.suppress(*IO_ERRORS):
                cur = self.stats()
        if not cur:
            cur = self.incarnation
        if final:
            self.st.service_integrity_failures += int(cur.get("integrity_failures", 0))
            self.st.service_flash_device_failures += int(cur.get("flash_device_failures", 0))
            self.st.service_flash_device_recoveries += int(
                cur.get("flash_device_recoveries", 0))
            self.st.service_evictions_flash += int(cur.get("evictions_flash", 0))
            self.incarnation = {}
        else:
            self.incarnation = cur

    # -- fault control file -------------------------------------------------------------
    def _write_ctl(self, points: str | None = None,
                   devices: dict[str, Any] | None = None) -> None:
        """Write the control file; ``None`` leaves points (devices) out, so the service
        keeps what it has (at a start: the points armed by CTXMEM_FAULTS)."""
        self.gen += 1
        body: dict[str, Any] = {"gen": self.gen, "journal": True}
        if points is not None:
            body["points"] = points
        if devices is not None:
            body["devices"] = devices
        tmp = self.ctl.with_suffix(".tmp")
        tmp.write_text(json.dumps(body))
        os.replace(tmp, self.ctl)

    def set_faults(self, points: str = "", devices: dict[str, Any] | None = None) -> None:
        self._write_ctl(points, devices or {})
        deadline = time.monotonic() + 3.0
        while self.alive() and time.monotonic() < deadline:
            ack = self._ack()
            if ack.get("gen", -1) >= self.gen:
                return
            time.sleep(0.003)
        if self.alive():
            raise RuntimeError("the service did not apply the fault control file in 3 s")

    def _ack(self) -> dict[str, Any]:
        try:
            return dict(json.loads(Path(f"{self.ctl}.ack").read_text()))
        except (OSError, ValueError):
            return {}

    def _collect_injected(self) -> None:
        ack = self._ack()
        inj = ack.get("injected", {})
        io = sum(v for k, v in inj.items() if k.split(":")[0] in ("read", "write", "sync"))
        base = self.ack_base.get("io", 0)
        if io > base:
            self.st.io_errors_injected += io - base
            self.ack_base["io"] = io
        pc = int(inj.get("powercut_writes_dropped", 0))
        if pc > self.ack_base.get("pc", 0):
            self.st.powercut_writes_dropped += pc - self.ack_base.get("pc", 0)
            self.ack_base["pc"] = pc

    def wait_healthy(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.alive():
            with contextlib.suppress(*IO_ERRORS):
                s = self.stats()
                if s["flash_devices_healthy"] == 2:
                    return True
            time.sleep(0.02)
        return False

    def quiesce(self, timeout: float = 10.0) -> bool:
        """Healthy devices, nothing waiting for demotion, no parked extents."""
        if not self.wait_healthy(timeout):
            return False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.alive():
            with contextlib.suppress(*IO_ERRORS):
                s = self.stats()
                if s["dirty_blocks"] == 0:
                    time.sleep(0.03)  # one reaper tick: parked extents get zeroed
                    return True
            time.sleep(0.01)
        return False

    # -- model --------------------------------------------------------------------------
    def content_of(self, key: bytes) -> bytes:
        data = self.content.get(key)
        if data is None:
            if len(self.content) >= 8192:  # a cache; contents are a function of the key
                self.content.clear()
            rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
            data = self.content[key] = rng.integers(0, 256, self.block, dtype=np.uint8).tobytes()
        return data

    def fresh_keys(self, tenant: str, n: int) -> list[bytes]:
        out = []
        for _ in range(n):
            self.next_key += 1
            out.append(hashlib.sha256(f"{self.seed}/{tenant}/{self.next_key}".encode())
                       .digest())
        return out

    def _taint(self, key: bytes) -> None:
        k = self.keys.get(key) or self.deleted.get(key)
        if k is not None and not k.tainted:
            k.tainted = True
            self.st.tainted_blocks += 1

    def live(self, tenant: str | None = None, *, durable: bool | None = None,
             clean: bool = True) -> list[bytes]:
        return [key for key, k in self.keys.items()
                if (tenant is None or k.tenant == tenant)
                and (durable is None or k.durable == durable)
                and (not clean or (not k.tainted and not k.uncertain))]

    # -- operations (each tolerates the service dying under it) -------------------------
    def put(self, tenant: str, keys: list[bytes]) -> bool:
        ns = self.ns[tenant]
        for key in keys:
            self.keys[key] = Key(tenant, uncertain=True)
            self.deleted.pop(key, None)
        try:
            r = ns.put(keys, [self.content_of(k) for k in keys])
        except IO_ERRORS:
            if self.alive():
                self.st.op_errors += 1
                for key in keys:  # refused (e.g. DRAM full while flash fails): not stored
                    self.keys.pop(key, None)
            return False
        self.st.blocks_committed += r.stored
        for key in keys:
            self.keys[key].uncertain = False
        return True

    def tiers(self, tenant: str, keys: list[bytes]) -> list[str]:
        ns = self.ns[tenant]
        assert self.client is not None
        names = {pb.TIER_DRAM: "dram", pb.TIER_FLASH: "flash", pb.TIER_UNSPECIFIED: ""}

        def op(s: Any) -> list[str]:
            r = ns.client._rpc("Lookup", pb.LookupRequest(
                session_id=s.id, namespace_handle=ns.handle, keys=keys, prefix=False))
            return [names[t] for t in r.tiers]

        return ns._retrying(op)

    def evict(self, tenant: str, keys: list[bytes]) -> None:
        if not keys:
            return
        ns = self.ns[tenant]
        marks = {k: self.keys[k].uncertain for k in keys if k in self.keys}
        for k in marks:
            self.keys[k].uncertain = True
        try:
            ns.evict(keys)
            tiers = self.tiers(tenant, keys)
        except IO_ERRORS:
            if self.alive():
                self.st.op_errors += 1
            return
        for k, tier in zip(keys, tiers, strict=True):
            if k in self.keys:
                self.keys[k].uncertain = marks.get(k, False)
                if tier == "flash":
                    self.keys[k].durable = True

    def delete(self, tenant: str, keys: list[bytes]) -> None:
        for k in keys:
            self.keys[k].uncertain = True
        try:
            self.ns[tenant].delete(keys)
        except IO_ERRORS:
            if self.alive():
                self.st.op_errors += 1
            return
        for k in keys:
            state = self.keys.pop(k)
            state.uncertain = False
            state.deleted = True
            self.deleted[k] = state

    def get(self, tenant: str, keys: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Get ``keys`` (not a chain: a miss does not hide the keys after it); every
        served block is compared with the key's content. Returns (served, missed)."""
        ns = self.ns[tenant]
        bufs = [bytearray(self.block) for _ in keys]
        served: list[bytes] = []
        missed: list[bytes] = []
        i = 0
        while i < len(keys):
            try:
                n = ns.get(keys[i:], bufs[i:])
            except IO_ERRORS:
                n = 0
            for j in range(i, i + n):
                self._check_served(keys[j], bufs[j])
                served.append(keys[j])
            i += n
            if i < len(keys):
                # A run can also come back short when DRAM cannot stage more right now
                # (another tenant holds the slabs): ask for that key alone before calling
                # it a miss.
                try:
                    one = ns.get([keys[i]], [bufs[i]])
                except IO_ERRORS:
                    one = 0
                if one:
                    self._check_served(keys[i], bufs[i])
                    served.append(keys[i])
                else:
                    missed.append(keys[i])
                i += 1
            if not self.alive():
                missed += keys[i:]
                break
        return served, missed

    def _check_served(self, key: bytes, data: bytearray) -> None:
        self.st.blocks_served += 1
        if data != self.content_of(key):
            self.st.wrong_blocks += 1
            k = self.keys.get(key) or self.deleted.get(key)
            self.st.problems.append(f"WRONG BLOCK served for key {key.hex()[:16]} ({k})")
        if key in self.deleted and key not in self.keys:
            k = self.deleted[key]
            if not k.tainted and not k.uncertain:
                self.st.resurrected_blocks += 1
                self.st.problems.append(f"deleted key {key.hex()[:16]} served again")

    def verify_all(self, after_restart: bool) -> None:
        """Read every key of the model; after a restart, durable ones must all be there."""
        for tenant in TENANTS:
            keys = [k for k, s in self.keys.items() if s.tenant == tenant]
            gone = [k for k, s in self.deleted.items() if s.tenant == tenant][-200:]
            try:
                present = self.ns[tenant].exists(keys + gone) if keys or gone else []
            except IO_ERRORS:
                return
            want = [k for k, p in zip(keys + gone, present, strict=True) if p]
            served, _missed = self.get(tenant, want)
            got = set(served)
            for key in keys:
                s = self.keys[key]
                if key in got:
                    if after_restart:
                        s.durable = True
                        s.uncertain = False
                    continue
                if not after_restart:
                    if s.tainted:
                        self.st.tainted_misses += 1
                    continue
                if s.durable and not s.tainted and not s.uncertain:
                    self.st.durable_blocks_lost += 1
                    loc = self.files.seen.get(key)
                    where = (f"last seen on {loc.dev} slab {loc.slab} slot {loc.slot}"
                             if loc else "never seen on flash")
                    self.st.problems.append(
                        f"durable key {key.hex()[:16]} lost ({s}; {where}); recent: "
                        + " | ".join(list(self.events)[-40:]))
                elif s.tainted:
                    self.st.tainted_misses += 1
                elif not s.durable and not s.uncertain:
                    self.st.blocks_lost += 1  # committed, not yet durable at the crash
                del self.keys[key]
            if after_restart:
                for key in gone:
                    if key not in got:
                        self.deleted[key].uncertain = False

    def leak_check(self) -> None:
        """Right after a restart: every allocated flash byte is a valid record's slot."""
        try:
            st = self.stats()
        except IO_ERRORS:
            return
        slot = (self.block + SECTOR - 1) // SECTOR * SECTOR
        used = st["flash_used_bytes"] - st["flash_quarantined_slots"] * slot
        on_disk = sum(loc.slot_size for loc in self.files.scan(restart_view=True))
        self.st.leak_checks += 1
        if used != on_disk:
            self.st.space_leak_bytes = max(self.st.space_leak_bytes, int(abs(used - on_disk)))
            self.st.problems.append(f"space accounting: service uses {used:.0f} bytes, "
                                    f"valid records on flash hold {on_disk}")

    # -- workload -----------------------------------------------------------------------
    def workload_round(self) -> None:
        """Put a batch, make part of it durable, read a sample, trim the working set."""
        tenant = self.rng.choice(TENANTS)
        keys = self.fresh_keys(tenant, self.rng.randint(4, 16))
        if not self.put(tenant, keys):
            return
        self.evict(tenant, keys[: len(keys) * 3 // 4])
        sample = self.rng.sample(list(self.keys), min(24, len(self.keys)))
        for t in TENANTS:
            self.get(t, [k for k in sample if self.keys.get(k, Key("?")).tenant == t])
        over = len(self.keys) > self.working_set
        if over or self.rng.random() < 0.2:
            old = [k for k, s in self.keys.items() if s.tenant == tenant and not s.uncertain]
            victims = old[: max(8, len(self.keys) - self.working_set) if over else 4]
            self._capture_before_delete(tenant, victims[:2])
            self.delete(tenant, victims)

    def _capture_before_delete(self, tenant: str, keys: list[bytes]) -> None:
        if len(self.captured) > 64 or not keys:
            return
        locs = {loc.key: loc for loc in self.files.scan() if loc.key in keys}
        for key in keys:
            loc = locs.get(key)
            if loc is not None:
                hdr = self.files.read(loc.dev, loc.header_off, SECTOR)
                body = self.files.read(loc.dev, loc.payload_off, loc.slot_size)
                self.captured.append((tenant, key, hdr, body))

    # -- faults -------------------------------------------------------------------------
    def _targets(self) -> list[Loc]:
        """Records of durable, undamaged keys that are on flash only (so a get reads the
        device), each found exactly once on the files."""
        scan = self.files.scan()
        counts = Counter((loc.ns, loc.key) for loc in scan)
        flash_only: set[bytes] = set()
        for t in TENANTS:
            keys = self.live(t, durable=True)
            with contextlib.suppress(*IO_ERRORS):
                flash_only.update(k for k, tier in zip(keys, self.tiers(t, keys), strict=True)
                                  if tier == "flash")
        return [loc for loc in scan if loc.key in flash_only and counts[(loc.ns, loc.key)] == 1
                and (loc.dev, loc.slab) not in self.damaged_slabs]

    def _still(self, loc: Loc) -> bool:
        """Does the slot still hold the record the scan saw?"""
        raw = self.files.read(loc.dev, loc.header_off, REC_SIZE)
        cols = parse_header_columns(raw.ljust(SECTOR, b"\0"), 1)
        return bool(cols.key) and cols.key[0] == loc.key and cols.seq[0] == loc.seq

    def corruption_round(self, kinds: list[str]) -> list[str]:
        """Apply ``kinds`` to distinct durable records, then read them: each must be a
        miss (or, for a harmless hit, the exact bytes). Returns the kinds applied."""
        if not self.quiesce():
            return []
        targets = self._targets()
        self.rng.shuffle(targets)
        done: list[str] = []
        hit: list[Loc] = []
        for kind in kinds:
            if not targets:
                break
            loc = targets.pop()
            if (loc.dev, loc.slab) in self.damaged_slabs or not self._still(loc):
                continue
            if self._corrupt(kind, loc, targets):
                self.events.append(f"{kind}@{loc.dev}/{loc.slab}/{loc.slot}/{loc.key.hex()[:8]}")
                done.append(kind)
                self.st.faults_by_kind[kind] += 1
                hit.append(loc)
        for t in TENANTS:
            mine = [loc.key for loc in hit if self.keys.get(loc.key, Key("?")).tenant == t]
            _served, missed = self.get(t, mine)
            self.st.tainted_misses += len(missed)
        return done

    def _corrupt(self, kind: str, loc: Loc, others: list[Loc]) -> bool:
        f = self.files
        rng = self.rng
        if kind == "bitflip_payload":
            off = loc.payload_off + rng.randrange(loc.length)
            byte = f.read(loc.dev, off, 1)[0]
            f.write(loc.dev, off, bytes([byte ^ (1 << rng.randrange(8))]))
        elif kind == "bitflip_header":
            off = loc.header_off + rng.randrange(REC_SIZE)
            byte = f.read(loc.dev, off, 1)[0]
            f.write(loc.dev, off, bytes([byte ^ (1 << rng.randrange(8))]))
        elif kind == "zero_payload_sector":
            sector = rng.randrange(max(1, loc.length // SECTOR))
            f.write(loc.dev, loc.payload_off + sector * SECTOR, bytes(SECTOR))
        elif kind == "zero_header":
            f.write(loc.dev, loc.header_off, bytes(SECTOR))
        elif kind in ("copy_record", "copy_record_cross_device", "foreign_namespace"):
            src = self._source(kind, loc, others)
            if src is None:
                return False
            f.write(loc.dev, loc.header_off, f.read(src.dev, src.header_off, SECTOR))
            f.write(loc.dev, loc.payload_off, f.read(src.dev, src.payload_off, src.slot_size))
        elif kind == "stale_extent":
            if not self.captured:
                return False
            _tenant, old_key, hdr, body = self.captured.pop(rng.randrange(len(self.captured)))
            if len(body) != loc.slot_size or old_key in self.keys:
                return False
            f.write(loc.dev, loc.header_off, hdr)
            f.write(loc.dev, loc.payload_off, body)
            self._taint(old_key)  # a restart may find the stale record: not a resurrection
        elif kind == "truncate_payload_area":
            return self._truncate_live(loc)
        elif kind == "zero_slab_header":
            f.write(loc.dev, slab_base(loc.slab, loc.slab_size), bytes(SECTOR))
            self.damaged_slabs.add((loc.dev, loc.slab))
            # The slab's records stay readable until the restart, which loses them.
            return True
        elif kind == "superblock_damage":
            off = 0 if rng.random() < 0.5 else SB_BACKUP_OFFSET
            if loc.dev in self.sb_damaged:
                return False  # one copy per device until the restart repairs it
            byte = f.read(loc.dev, off + 8, 1)[0]
            f.write(loc.dev, off + 8, bytes([byte ^ 0x10]))
            self.sb_damaged.add(loc.dev)
            return True
        else:  # pragma: no cover
            raise ValueError(kind)
        self._taint(loc.key)
        return True

    def _source(self, kind: str, loc: Loc, others: list[Loc]) -> Loc | None:
        tenant = self.keys[loc.key].tenant if loc.key in self.keys else ""
        for src in others:
            if src.slot_size != loc.slot_size or src.key == loc.key:
                continue
            src_tenant = self.keys[src.key].tenant if src.key in self.keys else ""
            if kind == "copy_record" and src.dev == loc.dev and src_tenant == tenant:
                return src
            if kind == "copy_record_cross_device" and src.dev != loc.dev:
                return src
            if kind == "foreign_namespace" and src_tenant and src_tenant != tenant:
                return src
        return None

    def _truncate_live(self, loc: Loc) -> bool:
        """Cut the device inside ``loc``'s payload, read the blocks beyond the cut (misses),
        then restore the length (the cut bytes come back as zeros)."""
        path = self.files.paths[loc.dev]
        size = path.stat().st_size
        cut = loc.payload_off + SECTOR
        beyond = [x for x in self.files.scan() if x.dev == loc.dev
                  and (x.payload_off + x.slot_size > cut or x.header_off + SECTOR > cut)]
        os.truncate(path, cut)
        for x in beyond:
            self._taint(x.key)
        self.events.append(f"truncated: {len(beyond)} records cut")
        # Slab headers past the cut come back as zeros: what the service writes into those
        # slabs from now on is lost at the next restart, unless it rewrites the headers.
        sb = scan_file(loc.dev, path)[1]
        if sb is not None:
            first = (cut - DATA_START) // sb.slab_size + 1
            self.damaged_slabs.update((loc.dev, s) for s in range(first, sb.num_slabs))
        for t in TENANTS:
            self.get(t, [x.key for x in beyond if self.keys.get(x.key, Key("?")).tenant == t])
        os.truncate(path, max(size, path.stat().st_size))
        return True

    def device_fault(self, kind: str) -> bool:
        if not self.quiesce():
            return False
        dev = self.rng.choice(list(self.files.paths))
        specs: dict[str, dict[str, Any]] = {
            "eio_read": {"read": "eio"},
            "eio_write": {"write": "eio"},
            "enospc_write": {"write": "enospc"},
            "eio_sync": {"sync": "eio"},
            "slow_device": {"delay_s": 1.2},  # CTXMEM_FLASH_SLOW_IO_S is 1.0 here
            "flaky_device": {"read": "eio", "write": "eio", "prob": 0.3},
        }
        spec = specs.get(kind, {})
        if kind == "swap_devices_live":
            return self._swap_live()
        on_dev = {loc.key for loc in self.files.scan() if loc.dev == dev}
        self.set_faults(devices={dev: spec})
        try:
            # Reads of blocks on the device, and new blocks that must be demoted (a slow
            # device: one read is enough to be found slow, and each call takes a second).
            for t in TENANTS:
                keys = [k for k in self.live(t, durable=True) if k in on_dev]
                self.get(t, keys[: 1 if kind == "slow_device" else 4])
            tenant = self.rng.choice(TENANTS)
            keys = self.fresh_keys(tenant, 4)
            if kind != "slow_device" and self.put(tenant, keys):
                self.evict(tenant, keys)
        finally:
            if self.alive():
                self.set_faults()
        self._collect_injected()
        if not self.wait_healthy(15.0):
            self.st.problems.append(f"{kind}: device {dev} did not recover in 15 s")
            return True
        # Recovered: what was written meanwhile goes to flash now.
        for t in TENANTS:
            self.evict(t, self.live(t, durable=False)[:32])
        return True

    def _swap_live(self) -> bool:
        """Exchange the two files' contents under the running service (quiesced), read
        blocks from both (misses: the devices are not the ones it knows), put them back."""
        a, b = self.files.paths["flash0"], self.files.paths["flash1"]
        da, db = a.read_bytes(), b.read_bytes()
        _overwrite(a, db)
        _overwrite(b, da)
        try:
            for t in TENANTS:
                self.get(t, self.live(t, durable=True)[:12])
        finally:
            _overwrite(a, da)
            _overwrite(b, db)
        if not self.wait_healthy(15.0):
            self.st.problems.append("swap_devices_live: devices did not recover in 15 s")
        return True

    def crash_fault(self, kind: str) -> bool:
        if kind == "kill_point" or kind == "powercut_point":
            return self._kill_at_point(kind)
        self._fold_counters()
        if kind == "kill_random":
            tenant = self.rng.choice(TENANTS)
            keys = self.fresh_keys(tenant, 16)
            self.put(tenant, keys)
            time.sleep(self.rng.random() * 0.03)
            self.svc.kill()
            self.crashed()
            return True
        if kind == "kill_rebuild":
            self.svc.kill()
            self._fold_counters(final=True)
            self.st.kills += 1
            self.st.kill_points_hit["rebuild.after_scan"] += 1
            self.restart_and_verify(env={"CTXMEM_FAULTS": "rebuild.after_scan:kill"})
            return True
        if kind == "swap_devices_restart":
            self._fold_counters(final=True)
            self.svc.stop()
            self._before_start()  # damaged-slab bookkeeping is by device name: before
            a, b = self.files.paths["flash0"], self.files.paths["flash1"]
            tmp = a.with_suffix(".swap")
            os.replace(a, tmp)
            os.replace(b, a)
            os.replace(tmp, b)
            self.restart_and_verify()
            return True
        if kind == "truncate_device_restart":
            self.svc.kill()
            self._fold_counters(final=True)
            self.st.kills += 1
            # Damaged slab headers first: their tables are still there to read (after the
            # cut they may not be, and their blocks would go uncounted).
            self._before_start()
            dev = self.rng.choice(list(self.files.paths))
            locs, sb, used = scan_file(dev, self.files.paths[dev], self.files.slot)
            if sb is None or not used:
                self.restart_and_verify()
                return True
            last = used[-1]
            cut = slab_base(last, sb.slab_size) + SECTOR * self.rng.randint(0, 3)
            for loc in locs:
                if loc.slab >= last:
                    self._taint(loc.key)
            os.truncate(self.files.paths[dev], cut)
            self.restart_and_verify()  # the backend grows the file back: zeros
            return True
        raise ValueError(kind)  # pragma: no cover

    def _kill_at_point(self, kind: str) -> bool:
        if not self.quiesce():
            return False
        points = KILL_POINTS if kind == "kill_point" else POWERCUT_POINTS
        point = self.rng.choice(points)
        action = "kill" if kind == "kill_point" else "powercut"
        self._fold_counters()
        self.set_faults(points=f"{point}:{action}")
        tenant = self.rng.choice(TENANTS)
        stage = point.split(".")[0]
        if stage in ("allocate", "commit"):
            self.put(tenant, self.fresh_keys(tenant, 8))
        elif stage in ("demote", "evict"):
            keys = self.fresh_keys(tenant, 8)
            if self.put(tenant, keys):
                self.evict(tenant, keys)
        elif stage == "delete":
            victims = self.live(tenant, durable=True)[:4] or self.live(tenant)[:4]
            if victims:
                self.delete(tenant, victims)
        elif stage == "promote":
            keys = self.live(tenant, durable=True)
            with contextlib.suppress(*IO_ERRORS):
                keys = [k for k, t in zip(keys, self.tiers(tenant, keys), strict=True)
                        if t == "flash"]
            self.get(tenant, keys[:8])
        if not self.wait_dead(3.0):
            # The operation did not reach the point (e.g. nothing to demote): disarm.
            if self.alive():
                self.set_faults()
            return False
        self._collect_injected()
        self.st.kill_points_hit[f"{point}:{action}"] += 1
        self.events.append(f"{point}:{action}")
        self.crashed()
        return True

    # -- the campaign -------------------------------------------------------------------
    def schedule(self, n: int, device_frac: float, crash_frac: float) -> Iterator[str]:
        first = list(KINDS)
        self.rng.shuffle(first)
        for i in range(n):
            if i < len(first):
                yield first[i]
                continue
            r = self.rng.random()
            if r < crash_frac:
                yield self.rng.choice(CRASH)
            elif r < crash_frac + device_frac:
                yield self.rng.choice(DEVICE)
            else:
                yield self.rng.choice(CORRUPTION)

    def run(self, n: int, device_frac: float, crash_frac: float, progress: bool) -> None:
        if not self.start():
            raise RuntimeError("the service did not start")
        t0 = time.monotonic()
        pending: list[str] = []
        planned = list(self.schedule(n, device_frac, crash_frac))
        last_report = 0
        i = 0
        stuck = 0
        tries: Counter[str] = Counter()
        while self.st.faults_injected < n:
            if i >= len(planned):  # some faults could not be applied: draw more
                planned += list(self.schedule(n - self.st.faults_injected + len(KINDS),
                                              device_frac, crash_frac))[len(KINDS):]
            kind = planned[i]
            i += 1
            if kind in CORRUPTION:
                pending.append(kind)
                if (len(pending) < 8 and i < len(planned) and planned[i] in CORRUPTION
                        and self.st.faults_injected + len(pending) < n):
                    continue
                self.workload_round()
                applied = self.corruption_round(pending)
                done = len(applied)
                for k in applied:
                    pending.remove(k)
                retry = pending
                pending = []
            else:
                self.workload_round()
                self.events.append(kind)
                done = int(self.device_fault(kind) if kind in DEVICE else self.crash_fault(kind))
                if done:
                    self.st.faults_by_kind[kind] += 1
                retry = [] if done else [kind]
            for k in retry:  # not applicable right now (e.g. nothing deleted yet): later
                tries[k] += 1
                if tries[k] <= 20 and not self.st.faults_by_kind[k]:
                    planned.insert(min(len(planned), i + 5), k)
            if not self.alive():  # died outside a fault: that is a bug, but keep going
                self.st.problems.append(f"the service died outside a fault (after {kind})")
                self.crashed()
            self.st.faults_injected += done
            stuck = 0 if done else stuck + 1
            if stuck > 200:
                raise RuntimeError("no fault could be applied in 200 tries: the campaign is "
                                   "stuck (see the service log)")
            if progress and self.st.faults_injected - last_report >= max(100, n // 20):
                last_report = self.st.faults_injected
                print(f"  {self.st.faults_injected}/{n} faults, {self.st.restarts} starts, "
                      f"{self.st.blocks_served} blocks served, {self.st.wrong_blocks} wrong, "
                      f"{time.monotonic() - t0:.0f} s", flush=True)
        self.finish()

    def finish(self) -> None:
        """Clean stop, repair with ``ctxmem check --repair``, check again (clean), start
        again and verify everything durable is served and nothing leaks."""
        self.verify_all(after_restart=False)
        self._fold_counters(final=True)
        self.svc.stop()
        self._before_start()
        cfg = str(self.svc.config_path)
        self.check_before = _check(cfg, [])
        self.check_repair = _check(cfg, ["--repair"])
        self.check_after = _check(cfg, [])
        self.restart_and_verify()
        self._fold_counters(final=True)
        self.svc.stop()

    def report(self, duration: float) -> dict[str, Any]:
        st = self.st
        out: dict[str, Any] = {
            "faults_injected": st.faults_injected,
            "blocks_committed": st.blocks_committed,
            "blocks_served": st.blocks_served,
            "wrong_blocks": st.wrong_blocks,
            "blocks_lost": st.blocks_lost,
            "lost_fraction": round(st.blocks_lost / max(1, st.blocks_committed), 6),
            "durable_blocks_lost": st.durable_blocks_lost,
            "resurrected_blocks": st.resurrected_blocks,
            "space_leak_bytes": st.space_leak_bytes,
            "check_after_repair_clean": self.check_after.get("clean", False),
            "faults_by_kind": dict(sorted(st.faults_by_kind.items())),
            "kill_points_hit": dict(sorted(st.kill_points_hit.items())),
            "restarts": st.restarts,
            "kills": st.kills,
            "tainted_blocks": st.tainted_blocks,
            "tainted_misses": st.tainted_misses,
            "io_errors_injected": st.io_errors_injected,
            "powercut_writes_dropped": st.powercut_writes_dropped,
            "leak_checks": st.leak_checks,
            "op_errors": st.op_errors,
            "service": {
                "integrity_failures": st.service_integrity_failures,
                "flash_device_failures": st.service_flash_device_failures,
                "flash_device_recoveries": st.service_flash_device_recoveries,
                "evictions_flash": st.service_evictions_flash,
            },
            "check": {
                "before_repair_errors": self.check_before.get("errors"),
                "repaired": self.check_repair.get("repaired"),
                "after_repair_errors": self.check_after.get("errors"),
            },
            "duration_s": round(duration, 1),
            "seed": self.seed,
            "problems": st.problems[:50],
        }
        out["passed"] = (st.wrong_blocks == 0 and st.durable_blocks_lost == 0
                         and st.resurrected_blocks == 0 and st.space_leak_bytes == 0
                         and bool(out["check_after_repair_clean"]))
        return out


def fresh_client(endpoint: str, timeout_s: float = 15.0) -> Client:
    """A shim client on a gRPC channel of its own. gRPC shares subchannels between channels
    to one address, with their reconnect backoff: after a killed service, even a new
    client's first calls would fail for a second or more. A local subchannel pool avoids
    that (the shim's own reconnect-after-restart behaviour is unchanged)."""
    import grpc

    from ctxmem_common.proto import ctxmem_pb2_grpc as pb_grpc

    c = Client(endpoint, transport="shm", timeout_s=timeout_s)
    c._pid = os.getpid()
    c._channel = grpc.insecure_channel(endpoint, options=[
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.use_local_subchannel_pool", 1),
    ])
    c._stub = pb_grpc.ContextMemoryStub(c._channel)
    return c


def _overwrite(path: Path, data: bytes) -> None:
    """Rewrite a file in place (no truncation: the service has it open)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, 0)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _check(config: str, extra: list[str]) -> dict[str, Any]:
    """Run ``ctxmem check`` (the service's command, as a separate program) on the files."""
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ctxmem_common.cli", "check", "--config", config, "-q",
             "--json", str(out), *extra], capture_output=True, text=True, timeout=600)
        if proc.returncode == 8:
            return {"error": proc.stderr.strip()}
        return dict(json.loads(out.read_text() or "{}"))
    finally:
        out.unlink(missing_ok=True)


def run_campaign(faults: int, seed: int, workdir: Path | None = None, device_frac: float = 0.05,
                 crash_frac: float = 0.02, block: int = 16384, working_set: int = 1200,
                 progress: bool = False, keep: bool = False) -> dict[str, Any]:
    """Run a campaign; returns the report (also what ``--json`` writes)."""
    base = workdir or Path(tempfile.mkdtemp(prefix="ctxmem-chaos-", dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    env = {"CTXMEM_FAULT_CTL": str(base / "faults.json"), "CTXMEM_FAULT_JOURNAL": "1",
           "CTXMEM_FLASH_PROBE_INTERVAL_S": "0.05", "CTXMEM_FLASH_SLOW_IO_S": "1.0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    camp = Campaign(base, seed, block, progress, working_set)
    t0 = time.monotonic()
    try:
        camp.run(faults, device_frac, crash_frac, progress)
        report = camp.report(time.monotonic() - t0)
    except BaseException:
        print(f"ctxmem chaos: failed; service log:\n{camp.svc.log()}", file=sys.stderr)
        raise
    finally:
        camp.svc.kill()
        if camp.client is not None:
            camp.client.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if not keep and workdir is None:
            shutil.rmtree(base, ignore_errors=True)
    report["workdir"] = str(base) if keep or workdir is not None else ""
    return report


def chaos_command(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="ctxmem chaos",
        description="Inject faults (corruption, device errors, crashes) into a live ctxmem "
                    "service under a put/get workload; check no wrong block is ever served "
                    "and no durable block is lost.")
    p.add_argument("--faults", type=int, default=10_000, help="faults to inject (10000)")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument("--workdir", help="keep the service's files here (default: a temp dir)")
    p.add_argument("--device-fraction", type=float, default=0.05,
                   help="share of device faults (EIO, ENOSPC, slow, flaky, swap)")
    p.add_argument("--crash-fraction", type=float, default=0.02,
                   help="share of crashes (kill -9 at fault points, power cuts, ...)")
    p.add_argument("--block-size", type=int, default=16384)
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    p.add_argument("-q", "--quiet", action="store_true")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    if not args.quiet:
        print(f"ctxmem chaos: {args.faults} faults, seed {seed}", flush=True)
    # The shim warns on every get that a killed service answers with a miss: expected here.
    shim_log = logging.getLogger("ctxmem")
    level = shim_log.level
    shim_log.setLevel(logging.ERROR)
    try:
        report = run_campaign(args.faults, seed, Path(args.workdir) if args.workdir else None,
                              args.device_fraction, args.crash_fraction, args.block_size,
                              progress=not args.quiet, keep=args.keep)
    finally:
        shim_log.setLevel(level)
    summary = {k: report[k] for k in ("faults_injected", "blocks_committed", "blocks_served",
                                      "wrong_blocks", "blocks_lost", "lost_fraction",
                                      "durable_blocks_lost", "resurrected_blocks",
                                      "space_leak_bytes", "check_after_repair_clean",
                                      "restarts", "duration_s", "passed")}
    print(json.dumps(summary, indent=2))
    for line in report["problems"]:
        print(f"problem: {line}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1
