"""A campaign: the schedule of faults and workload rounds, the final checks
(``ctxmem check`` before and after ``--repair``) and the report; :func:`run_campaign`
runs one against a fresh service.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ctxmem_common.faultpoints import ENV_CTL, ENV_JOURNAL
from ctxmem_tools.chaos.inject import FaultInjector
from ctxmem_tools.chaos.records import (
    CORRUPTION,
    CRASH,
    DEVICE,
    KINDS,
)


class Campaign(FaultInjector):
    """A whole campaign against one service (see :mod:`ctxmem_tools.chaos`)."""

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
        self.check_before = run_check(cfg, [])
        self.check_repair = run_check(cfg, ["--repair"])
        self.check_after = run_check(cfg, [])
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


def run_check(config: str, extra: list[str]) -> dict[str, Any]:
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
    env = {ENV_CTL: str(base / "faults.json"), ENV_JOURNAL: "1",
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
