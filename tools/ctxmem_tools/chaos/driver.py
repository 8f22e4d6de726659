"""The campaign's hold on the service: start, kill and restart it, arm faults through the
fault control file (the protocol in :mod:`ctxmem_common.faultpoints`), and the model of
every key's content and state. The operations build on it in :mod:`.workload`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from ctxmem.client import Client, Namespace
from ctxmem_common.faultpoints import DEVICE_OPS, POWERCUT_DROPPED, read_ack, write_control
from ctxmem_common.flash_format import SECTOR, FlashReader, max_table_slots
from ctxmem_common.layout import KVLayout
from ctxmem_tools.chaos.records import (
    IO_ERRORS,
    SERVICE_COUNTERS,
    TENANTS,
    Files,
    Key,
    Stats,
)
from ctxmem_tools.launcher import ServiceProcess, local_config


def fresh_client(endpoint: str, timeout_s: float = 15.0) -> Client:
    """A shim client on a gRPC channel of its own. gRPC shares subchannels between channels
    to one address, with their reconnect backoff: after a killed service, even a new
    client's first calls would fail for a second or more. A local subchannel pool avoids
    that (the shim's own reconnect-after-restart behaviour is unchanged)."""
    return Client(endpoint, transport="shm", timeout_s=timeout_s,
                  channel_options=[("grpc.use_local_subchannel_pool", 1)])


# The service's flash health timings in a campaign: failed devices probed every 50 ms, a
# device call over 1 s is slow (flash.probe_interval_s, flash.slow_io_s).
FAST_HEALTH = {"probe_interval_s": 0.05, "slow_io_s": 1.0}


class ServiceDriver:
    """The service under test, its fault controls and the key model."""

    def __init__(self, workdir: Path, seed: int, block: int, verbose: bool,
                 working_set: int, *, flash_dir: Path | None = None,
                 write_policy: str = "write_back", allocation_ttl_s: float = 30.0) -> None:
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
        fdir = flash_dir or workdir
        flash = {"flash0": fdir / "flash0.img", "flash1": fdir / "flash1.img"}
        self.files = Files(flash, (block + SECTOR - 1) // SECTOR * SECTOR)
        cfg = local_config(workdir, encryption=True, dram_size="16MiB", dram_slab="4MiB",
                           flash_size="64MiB", flash_slab="4MiB", flash_path=str(flash["flash0"]),
                           transports=["shm"], lease_ttl_s=30.0,
                           allocation_ttl_s=allocation_ttl_s, write_policy=write_policy,
                           logging={"level": os.environ.get("CTXMEM_CHAOS_LOG", "warning")},
                           flash=FAST_HEALTH)
        cfg["flash"]["devices"].append({"name": "flash1", "backend": "local",
                                        "path": str(flash["flash1"]), "size": "64MiB",
                                        "create": True})
        # Small batches (16 blocks, not filled to flash.demote_batch_bytes): more batch
        # boundaries for the crash points to land between.
        cfg["flash"]["demote_batch"] = 16
        cfg["flash"]["demote_batch_bytes"] = 0
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
        fd = os.open(self.files.paths[dev], os.O_RDONLY)
        try:
            reader = FlashReader(fd)
            sb = reader.superblocks().current
            if sb is None:
                return
            if reader.slab_header(slab, sb.slab_size) is not None:
                self.events.append(f"slab {dev}/{slab} header intact at restart")
                return  # the service rewrote it (scrub after a truncation): nothing is lost
            # The slot size is unknown (the header is gone); every record in the table counts.
            cols = reader.read_table(slab, sb.slab_size, max_table_slots(sb.slab_size))[0]
        finally:
            os.close(fd)
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
            for name in SERVICE_COUNTERS:
                self.st.service[name] += int(cur.get(name, 0))
            self.incarnation = {}
        else:
            self.incarnation = cur

    # -- fault control file -------------------------------------------------------------
    def _write_ctl(self, points: str | None = None,
                   devices: dict[str, Any] | None = None) -> None:
        """Write the control file; ``None`` leaves points (devices) out, so the service
        keeps what it has (at a start: the points armed by CTXMEM_FAULTS)."""
        self.gen += 1
        write_control(self.ctl, self.gen, points=points, devices=devices, journal=True)

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
        return read_ack(self.ctl)

    def _collect_injected(self) -> None:
        ack = self._ack()
        inj = ack.get("injected", {})
        io = sum(v for k, v in inj.items() if k.split(":")[0] in DEVICE_OPS)
        base = self.ack_base.get("io", 0)
        if io > base:
            self.st.io_errors_injected += io - base
            self.ack_base["io"] = io
        pc = int(inj.get(POWERCUT_DROPPED, 0))
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
