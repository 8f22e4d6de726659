"""The faults ``ctxmem chaos`` injects: on-device corruption (edits of the flash files),
device faults through the service's file layer, and crashes (kill or power cut at a
named fault point, at random, during rebuild; devices swapped or truncated).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from typing import Any

from ctxmem_common.faultpoints import ENV_POINTS, arm_spec
from ctxmem_common.flash_format import (
    REC_SIZE,
    SB_BACKUP_OFFSET,
    SB_OFFSET,
    SECTOR,
    parse_header_columns,
    slab_base,
)
from ctxmem_tools.chaos.records import (
    IO_ERRORS,
    KILL_POINTS,
    POWERCUT_POINTS,
    TENANTS,
    Key,
    Loc,
    overwrite,
    scan_file,
)
from ctxmem_tools.chaos.workload import Workload


class FaultInjector(Workload):
    """Fault injection on top of the workload (each fault keeps the model right)."""

    # -- faults -------------------------------------------------------------------------
    def _targets(self, scan: list[Loc]) -> list[Loc]:
        """Records of durable, undamaged keys that are on flash only (so a get reads the
        device), each found exactly once on the files (``scan``)."""
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
        scan = self.files.scan()
        targets = self._targets(scan)
        self.rng.shuffle(targets)
        done: list[str] = []
        hit: list[Loc] = []
        for kind in kinds:
            if not targets:
                break
            loc = targets.pop()
            if (loc.dev, loc.slab) in self.damaged_slabs or not self._still(loc):
                continue
            # Copies may take any record on the files (the other device's too) as source.
            if self._corrupt(kind, loc, targets + scan):
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
            off = SB_OFFSET if rng.random() < 0.5 else SB_BACKUP_OFFSET
            if loc.dev in self.sb_damaged:
                return False  # one copy per device until the restart repairs it
            f.damage_superblock(loc.dev, (off,))
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
        sb = self.files.superblock(loc.dev)
        if sb is not None:
            first = (cut - slab_base(0, sb.slab_size)) // sb.slab_size + 1
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
            "slow_device": {"delay_s": 1.2},  # flash.slow_io_s is 1.0 here (driver.FAST_HEALTH)
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
        overwrite(a, db)
        overwrite(b, da)
        try:
            for t in TENANTS:
                self.get(t, self.live(t, durable=True)[:12])
        finally:
            overwrite(a, da)
            overwrite(b, db)
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
            self.restart_and_verify(env={ENV_POINTS: arm_spec("rebuild.after_scan", "kill")})
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
            size = self.files.paths[dev].stat().st_size
            os.truncate(self.files.paths[dev], cut)
            # The service refuses to grow a file that holds records back behind the
            # operator's back (tests/reliability/test_durability_guards.py); the operator
            # restores its length (the cut part comes back as zeros), then restarts.
            os.truncate(self.files.paths[dev], size)
            self.restart_and_verify()
            return True
        raise ValueError(kind)  # pragma: no cover

    def _kill_at_point(self, kind: str) -> bool:
        if not self.quiesce():
            return False
        points = KILL_POINTS if kind == "kill_point" else POWERCUT_POINTS
        point = self.rng.choice(points)
        action = "kill" if kind == "kill_point" else "powercut"
        self._fold_counters()
        self.set_faults(points=arm_spec(point, action))
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
