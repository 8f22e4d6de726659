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
from ctxmem_common.progress import enabled as progress_enabled
from ctxmem_common.progress import progress as progress_bar
from ctxmem_tools.chaos.records import (
    CORRUPTION,
    CRASH,
    DEVICE,
    SERVICE_COUNTERS,
)
from ctxmem_tools.chaos.scenarios import (
    SCENARIO,
    ScenarioFaults,
    mount_tmpfs,
    unmount,
    unrunnable,
)

KINDS = CORRUPTION + DEVICE + CRASH + SCENARIO
"""Every fault kind the campaign knows."""
DEFAULT_KINDS = CORRUPTION + DEVICE + CRASH
"""What the short CI campaign selects: the scenario kinds (seconds each) have tests of
their own."""


def select_kinds(spec: str) -> tuple[tuple[str, ...], list[str]]:
    """The kinds named by ``spec`` (comma-separated kinds or groups: ``all``,
    ``corruption``, ``device``, ``crash``, ``scenario``; a leading ``-`` leaves one out),
    less those this machine cannot run; returns (kinds, messages about those skipped)."""
    groups = {"all": KINDS, "corruption": CORRUPTION, "device": DEVICE, "crash": CRASH,
              "scenario": SCENARIO}
    chosen: list[str] = []
    for word in (w.strip() for w in spec.split(",") if w.strip()):
        drop = word.startswith("-")
        names = groups.get(word.lstrip("-"), (word.lstrip("-"),))
        for name in names:
            if name not in KINDS:
                raise ValueError(f"unknown fault kind {name!r} (kinds: {', '.join(KINDS)})")
            if drop and name in chosen:
                chosen.remove(name)
            elif not drop and name not in chosen:
                chosen.append(name)
    if spec.strip().startswith("-"):  # only exclusions: from everything
        return select_kinds(",".join(("all", spec)))
    skipped = [msg for msg in map(unrunnable, chosen) if msg]
    kinds = tuple(k for k in KINDS if k in chosen and not unrunnable(k))
    if not kinds:
        raise ValueError(f"no fault kind left to run ({'; '.join(skipped) or spec})")
    return kinds, skipped


TIMELINE_POINTS = 200
"""About how many points the report's ``timeline`` holds (one every n/200 faults)."""

MAX_TRIES = 200
"""How often a kind that has not run yet is tried again before the campaign gives up on it
(and says so in ``problems``)."""


class Campaign(ScenarioFaults):
    """A whole campaign against one service (see :mod:`ctxmem_tools.chaos`)."""

    kinds: tuple[str, ...] = DEFAULT_KINDS
    skipped: tuple[str, ...] = ()  # why a selected kind cannot run here

    # -- the campaign -------------------------------------------------------------------
    def schedule(self, n: int, fractions: dict[str, float]) -> Iterator[str]:
        """``n`` kinds to inject: first every selected kind once, in seeded order (so each
        is scheduled whatever the seed), then draws by group (``fractions`` of crashes,
        device faults and scenarios; corruption takes the rest)."""
        first = list(self.kinds)
        self.rng.shuffle(first)
        yield from first[:n]
        groups = [(fractions.get(name, 0.0), [k for k in group if k in self.kinds])
                  for name, group in (("crash", CRASH), ("device", DEVICE),
                                      ("scenario", SCENARIO))]
        rest = [k for k in CORRUPTION if k in self.kinds]
        for _ in range(n - len(first)):
            r = self.rng.random()
            for frac, kinds in groups:
                if r < frac and kinds:
                    yield self.rng.choice(kinds)
                    break
                r -= frac
            else:
                yield self.rng.choice(rest or [k for _f, g in groups for k in g])

    def run(self, n: int, fractions: dict[str, float], progress: bool) -> None:
        if not self.start():
            raise RuntimeError("the service did not start")
        t0 = time.monotonic()
        pending: list[str] = []
        planned = list(self.schedule(n, fractions))
        last_report = 0
        i = 0
        stuck = 0
        tries: Counter[str] = Counter()
        # On a terminal a bar with an ETA; elsewhere a line every 5% (when not quiet).
        bar = progress_bar(n, "ctxmem chaos", "faults", show=progress and progress_enabled())
        self.timeline = [self._sample(t0)]
        every = max(1, n // TIMELINE_POINTS)

        def never_ran() -> list[str]:
            return [k for k in self.kinds
                    if not self.st.faults_by_kind[k] and tries[k] <= MAX_TRIES]

        while self.st.faults_injected < n or never_ran():
            if i >= len(planned):  # some faults could not be applied: draw more
                more = list(self.schedule(max(1, n - self.st.faults_injected) + len(self.kinds),
                                          fractions))[len(self.kinds):]
                planned += never_ran() + more
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
                if kind in DEVICE:
                    done = int(self.device_fault(kind))
                elif kind in CRASH:
                    done = int(self.crash_fault(kind))
                else:
                    done = int(self.scenario_fault(kind))
                if done:
                    self.st.faults_by_kind[kind] += 1
                retry = [] if done else [kind]
            for k in retry:  # not applicable right now (e.g. nothing deleted yet): later
                tries[k] += 1
                if not self.st.faults_by_kind[k]:  # every kind runs once: retry until then
                    if tries[k] <= MAX_TRIES:
                        planned.insert(min(len(planned), i + 2), k)
                    elif tries[k] == MAX_TRIES + 1:
                        self.st.problems.append(f"{k}: could not be applied in {MAX_TRIES} "
                                                "tries")
            if not self.alive():  # died outside a fault: that is a bug, but keep going
                self.st.problems.append(f"the service died outside a fault (after {kind})")
                self.crashed()
            self.st.faults_injected += done
            stuck = 0 if done else stuck + 1
            if stuck > 200:
                raise RuntimeError("no fault could be applied in 200 tries: the campaign is "
                                   "stuck (see the service log)")
            if self.st.faults_injected - self.timeline[-1]["faults"] >= every:
                self.timeline.append(self._sample(t0))
            if bar.active:
                bar.set(min(n, self.st.faults_injected))
                bar.note(served=self.st.blocks_served, wrong=self.st.wrong_blocks,
                         starts=self.st.restarts)
            elif progress and self.st.faults_injected - last_report >= max(100, n // 20):
                last_report = self.st.faults_injected
                print(f"  {self.st.faults_injected}/{n} faults, {self.st.restarts} starts, "
                      f"{self.st.blocks_served} blocks served, {self.st.wrong_blocks} wrong, "
                      f"{time.monotonic() - t0:.0f} s", flush=True)
        bar.close()
        if self.timeline[-1]["faults"] != self.st.faults_injected:
            self.timeline.append(self._sample(t0))
        self.finish()

    def _sample(self, t0: float) -> dict[str, float]:
        """One point of the campaign's timeline (``--png`` draws it)."""
        st = self.st
        return {"t_s": round(time.monotonic() - t0, 2), "faults": st.faults_injected,
                "blocks_committed": st.blocks_committed, "blocks_served": st.blocks_served,
                "wrong_blocks": st.wrong_blocks, "durable_blocks_lost": st.durable_blocks_lost,
                "restarts": st.restarts}

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
            "kinds": list(self.kinds),
            "kinds_skipped": list(self.skipped),
            "kind_failures": {k: st.kind_failures[k] for k in SCENARIO if k in self.kinds},
            "service": {name: st.service[name] for name in SERVICE_COUNTERS},
            "check": {
                "before_repair_errors": self.check_before.get("errors"),
                "repaired": self.check_repair.get("repaired"),
                "after_repair_errors": self.check_after.get("errors"),
            },
            "duration_s": round(duration, 1),
            "seed": self.seed,
            "problems": st.problems[:50],
            "timeline": getattr(self, "timeline", []),
        }
        out["passed"] = (st.wrong_blocks == 0 and st.durable_blocks_lost == 0
                         and st.resurrected_blocks == 0 and st.space_leak_bytes == 0
                         and not sum(st.kind_failures.values())
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
                 progress: bool = False, keep: bool = False, kinds: str = "",
                 scenario_frac: float = 0.002, write_policy: str = "write_back",
                 allocation_ttl_s: float | None = None) -> dict[str, Any]:
    """Run a campaign; returns the report (also what ``--json`` writes). ``kinds`` selects
    fault kinds (:func:`select_kinds`; default :data:`DEFAULT_KINDS`)."""
    selected, skipped = select_kinds(kinds or ",".join(DEFAULT_KINDS))
    if progress:
        for msg in skipped:
            print(f"ctxmem chaos: skipped: {msg}", flush=True)
    if allocation_ttl_s is None:  # a stalled client must outlive its allocation quickly
        allocation_ttl_s = 2.0 if "stalled_client" in selected else 30.0
    base = workdir or Path(tempfile.mkdtemp(prefix="ctxmem-chaos-", dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    flash_fs = base / "fs" if "full_filesystem" in selected else None
    if flash_fs is not None:  # the two 64 MiB flash files and a little room
        mount_tmpfs(flash_fs, 2 * 64 * 2**20 + 8 * 2**20)
    env = {ENV_CTL: str(base / "faults.json"), ENV_JOURNAL: "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        camp = Campaign(base, seed, block, progress, working_set, flash_dir=flash_fs,
                        write_policy=write_policy, allocation_ttl_s=allocation_ttl_s)
        camp.kinds, camp.skipped, camp.flash_fs = selected, tuple(skipped), flash_fs
        t0 = time.monotonic()
        try:
            camp.run(faults, {"crash": crash_frac, "device": device_frac,
                              "scenario": scenario_frac}, progress)
            report = camp.report(time.monotonic() - t0)
        except BaseException:
            print(f"ctxmem chaos: failed; service log:\n{camp.svc.log()}", file=sys.stderr)
            raise
        finally:
            camp.svc.kill()
            if camp.client is not None:
                camp.client.close()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if flash_fs is not None:
            unmount(flash_fs)
        if not keep and workdir is None:
            shutil.rmtree(base, ignore_errors=True)
    report["workdir"] = str(base) if keep or workdir is not None else ""
    return report
