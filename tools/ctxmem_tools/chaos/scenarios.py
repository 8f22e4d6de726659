"""The campaign's scenario faults (issue 13): a stalled shared-memory client, a full
filesystem under the flash files, both superblock copies damaged, and a second service
on the same bytes (an alias). Each is one episode of a few seconds, checked against the
key model like every other fault, and whatever it finds is also counted per kind
(``kind_failures``) so a report says which case failed.

Expected outcomes (what the service must do):

* ``stalled_client``: a raw client (:class:`ctxmem_tools.rawclient.RawSession`) allocates,
  stalls past ``allocation_ttl_s``, then writes junk into the slots it held while the
  campaign puts new blocks; every block read afterwards must be exact (or a miss), and the
  late Commit must be refused.
* ``full_filesystem``: the flash files' tmpfs is filled up (a filler file) while blocks are
  put and demoted; nothing wrong is served, and under ``write_through`` every
  acknowledged put survives a ``kill -9`` and restart.
* ``superblock_both``: with the service stopped, both superblock copies of a device are
  damaged; the service must refuse to start (telling the operator to run
  ``ctxmem check --repair``) or serve without the device; after ``ctxmem check --repair``
  it starts and every durable block is there.
* ``alias_service``: while the service runs, a second one is started on the same file
  (bigger size, ``create: true``) and on a loop device over it; each must be refused
  before it changes anything, and the first service's blocks stay intact (also across a
  restart).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from ctxmem_common.flash_format import SB_BACKUP_OFFSET, SB_OFFSET, SECTOR, FlashReader
from ctxmem_tools.chaos.inject import FaultInjector
from ctxmem_tools.chaos.records import IO_ERRORS, TENANTS
from ctxmem_tools.launcher import ServiceProcess, local_config
from ctxmem_tools.rawclient import RawSession

SCENARIO = ("stalled_client", "full_filesystem", "superblock_both", "alias_service")


def is_root() -> bool:
    """Mounting a tmpfs and attaching loop devices need root."""
    return os.geteuid() == 0


def unrunnable(kind: str) -> str:
    """Why ``kind`` cannot run on this machine ("" when it can)."""
    if kind == "full_filesystem" and not is_root():
        return "full_filesystem needs root (it mounts a small tmpfs for the flash files)"
    return ""


def mount_tmpfs(where: Path, size: int) -> None:
    """Mount a tmpfs of ``size`` bytes at ``where`` (the full-filesystem fault's home)."""
    where.mkdir(parents=True, exist_ok=True)
    # mode=0700: a tmpfs root is 1777 by default, and the service refuses a flash
    # directory other users can write (ctxmem_common.safepaths).
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                    str(where)], check=True, capture_output=True)


def unmount(where: Path) -> None:
    """Unmount ``where`` (lazily: a killed service may still be closing its files)."""
    subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


def fill_filesystem(filler: Path) -> int:
    """Take every free byte of ``filler``'s filesystem with one preallocated file; returns
    its size."""
    st = os.statvfs(filler.parent)
    free = st.f_bavail * st.f_frsize
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        size = free
        while size >= SECTOR:
            try:
                os.posix_fallocate(fd, 0, size)
                return size
            except OSError:
                size -= max(SECTOR, size // 64)  # tmpfs keeps a little for itself
        return 0
    finally:
        os.close(fd)


class ScenarioFaults(FaultInjector):
    """The scenario episodes on top of the other faults."""

    flash_fs: Path | None = None  # the tmpfs holding the flash files, when mounted

    def scenario_fault(self, kind: str) -> bool:
        """Run one episode of ``kind``; False when it could not run right now."""
        episodes: dict[str, Callable[[], list[str] | None]] = {
            "stalled_client": self._stalled_client,
            "full_filesystem": self._full_filesystem,
            "superblock_both": self._superblock_both,
            "alias_service": self._alias_service,
        }
        before = (self.st.wrong_blocks, self.st.durable_blocks_lost,
                  self.st.resurrected_blocks)
        failures = episodes[kind]()
        if failures is None:
            return False
        after = (self.st.wrong_blocks, self.st.durable_blocks_lost, self.st.resurrected_blocks)
        for what, b, a in zip(("wrong blocks", "durable blocks lost", "blocks resurrected"),
                              before, after, strict=True):
            if a > b:
                failures.append(f"{a - b} {what}")
        self.st.kind_failures[kind] += len(failures)
        self.st.problems += [f"{kind}: {f}" for f in failures]
        return True

    # -- stalled client -------------------------------------------------------------------
    def _stalled_client(self) -> list[str] | None:
        if not self.quiesce():
            return None
        ttl = float(self.config["service"]["allocation_ttl_s"])
        tenant = self.rng.choice(TENANTS)
        failures: list[str] = []
        try:
            raw = RawSession(self.svc.endpoint, self.layout, tenant=tenant, model_id="chaos")
        except Exception as exc:
            self.events.append(f"stalled_client: no raw session ({exc})")
            return None
        try:
            held = raw.allocate(self.fresh_keys(tenant, 8))  # keys the model never reads
            time.sleep(ttl + 1.0)  # stalled past allocation_ttl_s: the reaper ended it
            victims = self.fresh_keys(tenant, 8)
            self.put(tenant, victims)  # may reuse the stalled client's slots (or be refused)
            junk = bytes([0x5A]) * raw.block_nbytes
            raw.write(held, [junk] * len(held.slots))
            with contextlib.suppress(Exception):
                raw.commit(held)
                failures.append("a Commit of an expired allocation was accepted")
            self.get(tenant, victims)
            for t in TENANTS:
                self.get(t, self.live(t)[-48:])
            # Out of the model: what the junk did to them is this kind's finding, not a
            # later kind's.
            self.delete(tenant, [k for k in victims if k in self.keys])
        finally:
            raw.close()
        return failures

    # -- full filesystem --------------------------------------------------------------------
    def _full_filesystem(self) -> list[str] | None:
        if self.flash_fs is None or not self.quiesce():
            return None
        write_through = self.config["flash"]["write_policy"] == "write_through"
        filler = self.flash_fs / "filler"
        size = fill_filesystem(filler)
        self.events.append(f"full_filesystem: {size} bytes of filler")
        failures: list[str] = []
        acked: list[bytes] = []
        try:
            for _ in range(3):
                tenant = self.rng.choice(TENANTS)
                keys = self.fresh_keys(tenant, 16)
                if self.put(tenant, keys) and write_through:
                    acked += keys  # acknowledged write-through: on flash, says the service
                else:
                    self.evict(tenant, keys)  # demotion into a full filesystem
                for t in TENANTS:
                    self.get(t, self.live(t)[-32:])
        finally:
            filler.unlink(missing_ok=True)
        for key in acked:
            if key in self.keys:
                self.keys[key].durable = True
        if write_through:
            self.crashed()  # kill -9: every acknowledged put must be served after it
        elif not self.wait_healthy(15.0):
            failures.append("the devices did not recover in 15 s after space came back")
        return failures

    # -- both superblock copies damaged ----------------------------------------------------
    def _superblock_both(self) -> list[str] | None:
        from ctxmem_tools.chaos.campaign import run_check  # campaign imports this module

        self._fold_counters(final=True)
        self.svc.stop()
        self._before_start()
        dev = self.rng.choice(list(self.files.paths))
        saved = self.files.read(dev, SB_OFFSET, 2 * SECTOR)
        # A device with no slab header is blank (nothing was ever assigned, or every slab
        # it held was damaged by earlier faults): formatting it at start is right then.
        with open(self.files.paths[dev], "rb") as f:
            size = os.fstat(f.fileno()).st_size
            headers = FlashReader(f.fileno()).find_slab_headers(size)
        self.files.damage_superblock(dev, (SB_OFFSET, SB_BACKUP_OFFSET))
        self.events.append(f"superblock_both@{dev}")
        failures: list[str] = []
        try:
            started = self.start()
            refusal = ""
        except RuntimeError as exc:
            started, refusal = False, str(exc)
        if started:
            if headers:
                tail = [line for line in self.svc.log().splitlines() if dev in line][-3:]
                failures.append(f"the service started with both superblock copies of {dev} "
                                f"damaged and {len(headers)} slab headers on it (expected: "
                                f"refused); its log: {tail}")
            for t in TENANTS:
                self.get(t, self.live(t)[-64:])
            self._fold_counters(final=True)
            self.svc.stop()
        elif "check --repair" not in refusal:
            failures.append("refused to start without naming `ctxmem check --repair`")
        cfg = str(self.svc.config_path)
        repair = run_check(cfg, ["--repair"])
        after = run_check(cfg, [])
        if not after.get("clean", False):
            failures.append("ctxmem check after --repair not clean "
                            f"({repair.get('error') or after.get('errors')})")
        try:
            self.restart_and_verify()
        except RuntimeError:
            failures.append("the service did not start after ctxmem check --repair; the "
                            "campaign put the saved superblocks back")
            self.files.write(dev, SB_OFFSET, saved)
            self.restart_and_verify()
        return failures

    # -- a second service on the same bytes ------------------------------------------------
    def _alias_service(self) -> list[str] | None:
        if not self.quiesce():
            return None
        path = self.files.paths["flash0"]
        failures: list[str] = []
        cases: list[tuple[str, str, str]] = [("same file, bigger, create: true", str(path),
                                              "128MiB")]
        loop = ""
        if is_root() and shutil.which("losetup"):
            proc = subprocess.run(["losetup", "--find", "--show", str(path)],
                                  capture_output=True, text=True, check=False)
            loop = proc.stdout.strip()
            if loop:
                cases.append((f"loop device {loop} over the file", loop, "64MiB"))
            else:
                self.events.append(f"alias_service: no loop device ({proc.stderr.strip()})")
        else:
            self.events.append("alias_service: loop device case skipped (needs root)")
        try:
            for label, target, size in cases:
                failures += self._second_service(label, target, size)
        finally:
            if loop:
                subprocess.run(["losetup", "-d", loop], check=False, capture_output=True)
        self.verify_all(after_restart=False)
        self.crashed()  # and across a restart: every durable block is still there
        return failures

    def _second_service(self, label: str, target: str, size: str) -> list[str]:
        """Start a second service on ``target``: it must be refused, changing nothing."""
        path = self.files.paths["flash0"]
        before = (path.stat().st_size, self.files.read("flash0", SB_OFFSET, 2 * SECTOR))
        wd = self.workdir / "alias"
        shutil.rmtree(wd, ignore_errors=True)
        cfg = local_config(wd, encryption=True, dram_size="8MiB", dram_slab="4MiB",
                           flash_size=size, flash_slab="4MiB", flash_path=target,
                           transports=["shm"], logging={"level": "warning"})
        cfg["metrics"]["listen"] = ""
        second = ServiceProcess(wd, cfg, start=False)
        out: list[str] = []
        try:
            second.start(timeout_s=60)
            out.append(f"a second service on the {label} was not refused")
        except RuntimeError as exc:
            reason = str(exc).splitlines()
            self.events.append(f"alias_service: {label} refused ({reason[-1] if reason else ''})")
        finally:
            second.kill()
        after = (path.stat().st_size, self.files.read("flash0", SB_OFFSET, 2 * SECTOR))
        if after != before:
            out.append(f"the second service on the {label} changed the device (size "
                       f"{before[0]} -> {after[0]}, superblocks "
                       f"{'changed' if after[1] != before[1] else 'same'})")
        with contextlib.suppress(*IO_ERRORS):
            self.stats()
        return out
