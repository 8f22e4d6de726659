"""The fuzz campaign: one real service, legitimate sessions, seeded cases, checks.

The service runs as its own process (``launcher.local_config`` + ``ServiceProcess``,
small DRAM and flash, tenant tokens for two tenants). Tenant "victim" holds two
legitimate sessions (shared memory and TCP) with committed blocks; tenant "attacker"
holds the fuzzer's sessions, which also commit blocks so cases reach real allocations,
leases and slabs. Cases are drawn from one seeded RNG over three targets: the gRPC
methods (:mod:`.rpc`), the TCP data port and the shared-memory socket (:mod:`.frames`);
and, when asked for (``peer``), a fourth: the peer port of a pod of two nodes
(:mod:`.peer`, with its own checks after every batch, :meth:`.peer.PeerFuzz.check`).

After every batch: the process is alive (else a crash), ``Health`` answers within a
deadline (else a hang), and every victim block reads back byte-exact through its
session's data channel (a wrong byte is a failure; a miss is counted). The run stops at
the first crash or hang. At the end the stalled connections close, the service settles
(grants expire) and its RSS is compared with the RSS after the first batch; the log is
searched for ``Traceback``. Every loop is bounded by the case count and ``max_seconds``.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c
import grpc

from ctxmem_common.faultpoints import ENV_CTL, read_ack, write_control
from ctxmem_common.layout import KVLayout
from ctxmem_common.netaddr import split_hostport
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.proto import ctxmem_pb2_grpc as pb_grpc
from ctxmem_tools.fuzz.frames import FrameTarget
from ctxmem_tools.fuzz.messages import Identity, MessageFuzzer, Pools
from ctxmem_tools.fuzz.peer import PeerFuzz
from ctxmem_tools.fuzz.rpc import RpcTarget
from ctxmem_tools.launcher import ServiceProcess, local_config
from ctxmem_tools.rawclient import RawSession

LAYOUT = KVLayout(dtype="float16", num_layers=2, num_kv_heads=1, head_dim=64, tokens_per_block=16)
TOKENS = {"victim": "victim-token-" + "v" * 20, "attacker": "attacker-token-" + "a" * 20}
TARGET_WEIGHTS = {"rpc": 0.5, "tcp": 0.25, "shm": 0.25, "peer": 0.25}
#: The targets a run has unless told otherwise (``peer`` starts a pod: opt in).
DEFAULT_TARGETS = ("rpc", "tcp", "shm")


@dataclass
class FuzzOptions:
    """What one run does; the defaults suit CI (a few thousand cases in about a minute)."""

    cases: int = 3000
    seed: int = 0
    batch: int = 100
    workdir: Path | None = None
    keep: bool = False
    max_seconds: float = 3600.0
    health_deadline_s: float = 10.0
    settle_s: float = 5.0
    rss_tolerance: float = 0.10
    max_repeated: int = 20_000
    service_env: dict[str, str] = field(default_factory=dict)
    victim_blocks: int = 8
    targets: tuple[str, ...] = DEFAULT_TARGETS


@dataclass
class _Victim:
    session: RawSession
    keys: list[bytes]
    blocks: list[bytes]


def _rss_kib(pid: int) -> dict[str, int]:
    """The resident set of ``pid`` in KiB (/proc/PID/status): ``rss`` (VmRSS) and its
    parts ``anon`` (the heap: what a leak grows), ``shmem`` (the DRAM tier's memfd
    slabs, a fixed size touched as slots are used) and ``file``."""
    got = {"rss": 0, "anon": 0, "shmem": 0, "file": 0}
    names = {"VmRSS:": "rss", "RssAnon:": "anon", "RssShmem:": "shmem", "RssFile:": "file"}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key = names.get(line.split(":")[0] + ":")
            if key:
                got[key] = int(line.split()[1])
    return got


def _settled_rss(pid: int, seconds: float, ctl: Path, gen: int) -> dict[str, int]:
    """The RSS of ``pid`` once settled: a full garbage collection in the service (asked
    for through its fault control file ``ctl``, generation ``gen``), then the sample with
    the least RssAnon over ``seconds`` of idling (every 0.25 s). Failed calls leave
    reference cycles (gRPC's AbortError and the call state) that only a full collection
    frees; without it the heap reads tens of MiB higher or lower by chance."""
    write_control(ctl, gen, collect_garbage=True)
    deadline = time.monotonic() + 10.0
    while read_ack(ctl).get("gen") != gen and time.monotonic() < deadline:
        time.sleep(0.05)
    best = _rss_kib(pid)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = _rss_kib(pid)
        if now["anon"] and now["anon"] < best["anon"]:
            best = now
    return best


@contextlib.contextmanager
def _env(extra: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``extra`` while the service starts (it inherits it)."""
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _put(s: RawSession, rng: random.Random, keys: list[bytes],
         regions: set[tuple[int, int]] | None = None) -> list[bytes]:
    """Write and commit one random block per key; the blocks written. The slabs the
    slots live in are added to ``regions`` (MAP cases name them)."""
    blocks = [rng.randbytes(s.block_nbytes) for _ in keys]
    a = s.allocate(keys)
    if regions is not None:
        regions.update((slot.region, slot.generation) for slot in a.slots)
    s.write(a, blocks)
    s.commit(a, [crc32c.crc32c(b) for b in blocks])
    return blocks


class FuzzRun:
    """One campaign; :meth:`run` returns the report (a JSON-able dict)."""

    def __init__(self, opts: FuzzOptions, progress: Callable[[str], None] | None = None) -> None:
        self.opts = opts
        self.progress = progress or (lambda _msg: None)
        self.rng = random.Random(opts.seed)
        self.per_target: dict[str, Counter[str]] = defaultdict(Counter)
        self.cases = Counter[str]()
        self.failures: list[str] = []
        self.crashes = self.hangs = self.wrong_blocks = self.readback_errors = 0
        self.readback_misses = 0
        self.warmup = 0
        self.rss_trace: list[tuple[int, int]] = []  # (cases, RssAnon KiB) every 20 batches

    # -- set-up ---------------------------------------------------------------------------
    def _start(self, workdir: Path) -> ServiceProcess:
        cfg = local_config(workdir, dram_size="64MiB", dram_slab="4MiB", flash_size="128MiB",
                           flash_slab="8MiB", lease_ttl_s=3.0, allocation_ttl_s=3.0,
                           service={"tenant_tokens": TOKENS}, logging={"level": "info"})
        env = {ENV_CTL: str(self.ctl), **self.opts.service_env}
        with _env(env):
            return ServiceProcess(workdir / "svc", cfg)

    def _sessions(self, endpoint: str) -> tuple[list[_Victim], list[RawSession], Pools]:
        rng = random.Random(self.opts.seed ^ 0x5EED)
        victims: list[_Victim] = []
        for transport in ("shm", "tcp"):
            s = RawSession(endpoint, LAYOUT, tenant="victim", tenant_token=TOKENS["victim"],
                           model_id="fuzz", transport=transport)
            keys = [rng.randbytes(32) for _ in range(self.opts.victim_blocks)]
            victims.append(_Victim(s, keys, _put(s, rng, keys)))
        attackers: list[RawSession] = []
        own: list[Identity] = []
        regions: set[tuple[int, int]] = set()
        for transport in ("shm", "tcp", "tcp"):
            s = RawSession(endpoint, LAYOUT, tenant="attacker", tenant_token=TOKENS["attacker"],
                           model_id="fuzz", transport=transport)
            keys = [rng.randbytes(32) for _ in range(4)]
            _put(s, rng, keys, regions)
            attackers.append(s)
            own.append(Identity(s.session_id, s.token, s.handle, keys))
        pools = Pools(own, [Identity(v.session.session_id, b"", v.session.handle, v.keys)
                            for v in victims], regions=regions,
                      strings=["attacker", "victim", TOKENS["attacker"], "fuzz"])
        for v in victims:  # a live victim lease and allocation, named by the fuzzer
            pools.victim_ids.append(v.session.acquire(v.keys[:2]).id)
            pools.victim_ids.append(v.session.allocate([rng.randbytes(32)]).id)
        return victims, attackers, pools

    # -- checks ---------------------------------------------------------------------------
    def _crashed(self, svc: ServiceProcess, at: int) -> bool:
        """Whether the service process has exited (counted as a crash)."""
        if svc.proc is not None and svc.proc.poll() is None:
            return False
        self.crashes += 1
        code = None if svc.proc is None else svc.proc.returncode
        self.failures.append(f"crash: the service exited ({code}) by case {at}")
        return True

    def _check(self, svc: ServiceProcess, stub: pb_grpc.ContextMemoryStub,
               victims: list[_Victim], at: int) -> bool:
        """Alive, Health within the deadline, victims' blocks byte-exact; False: stop."""
        try:
            if self._crashed(svc, at):
                return False
            stub.Health(pb.HealthRequest(), timeout=self.opts.health_deadline_s)
        except grpc.RpcError as exc:
            time.sleep(1.0)  # a process that just died refuses before it is reaped
            if not self._crashed(svc, at):
                self.hangs += 1
                self.failures.append(f"hang: Health failed by case {at}: {exc.code().name}")
            return False
        for v in victims:
            try:
                lease = v.session.acquire(v.keys)
                got = v.session.read(lease) if lease.slots else []
                v.session.release(lease)
            except Exception as exc:
                self.readback_errors += 1
                self.failures.append(f"readback failed by case {at}: {exc!r}"[:300])
                continue
            self.readback_misses += len(v.keys) - len(got)
            for i, data in enumerate(got):
                if data != v.blocks[i]:
                    self.wrong_blocks += 1
                    self.failures.append(f"wrong bytes: victim block {i} by case {at}")
        return True

    # -- the run --------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        opts = self.opts
        workdir = opts.workdir or Path(tempfile.mkdtemp(prefix="ctxmem-fuzz-"))
        self.ctl = workdir / "fault-ctl.json"
        started = time.monotonic()
        svc = self._start(workdir)
        try:
            return self._run(svc, workdir, started)
        finally:
            svc.kill()  # no-op when it already stopped

    def _run(self, svc: ServiceProcess, workdir: Path, started: float) -> dict[str, Any]:
        opts = self.opts
        assert svc.proc is not None
        pid = svc.proc.pid
        channel = grpc.insecure_channel(svc.endpoint)
        stub = pb_grpc.ContextMemoryStub(channel)
        victims, attackers, pools = self._sessions(svc.endpoint)
        health = stub.Health(pb.HealthRequest(), timeout=10)
        fuzzer = MessageFuzzer(self.rng, pools, opts.max_repeated)
        rpc = RpcTarget(channel, self.rng, pools, fuzzer)
        host, port = split_hostport(health.data_endpoint, "data_endpoint")
        frames = {"tcp": FrameTarget("tcp", (host, port), self.rng, pools, fuzzer),
                  "shm": FrameTarget("shm", health.shm_socket, self.rng, pools, fuzzer)}
        unknown = set(opts.targets) - set(TARGET_WEIGHTS)
        if unknown:
            raise ValueError(f"fuzz: unknown target(s) {sorted(unknown)}; the targets are "
                             f"{', '.join(TARGET_WEIGHTS)}")
        names = [n for n in TARGET_WEIGHTS if n in opts.targets]
        peer = PeerFuzz(workdir / "pod", self.rng, opts.seed, self.failures.append) \
            if "peer" in names else None
        weights = [TARGET_WEIGHTS[n] for n in names]
        rss_before: dict[str, int] = {}
        warmup = self.warmup = max(opts.batch, min(20_000, opts.cases // 3))
        done = 0
        stopped = ""
        try:
            while done < opts.cases:
                if time.monotonic() - started > opts.max_seconds:
                    stopped = f"max_seconds ({opts.max_seconds}) reached"
                    break
                for _ in range(min(opts.batch, opts.cases - done)):
                    target = self.rng.choices(names, weights)[0]
                    if target == "rpc":
                        method, outcome = rpc.case()
                        self.per_target[f"rpc.{method}"][outcome] += 1
                    elif target == "peer":
                        assert peer is not None
                        self.per_target["peer"][peer.case(done)] += 1
                    else:
                        outcome = frames[target].case()
                        self.per_target[target][outcome] += 1
                    self.cases[target] += 1
                    done += 1
                if not self._check(svc, stub, victims, done) or (
                        peer is not None and not peer.check(done)):
                    stopped = self.failures[-1]
                    break
                if not rss_before and done >= warmup:  # once the heap has warmed up
                    rss_before = _settled_rss(pid, opts.settle_s, self.ctl, 1)
                if done % (opts.batch * 20) == 0:
                    rss = _rss_kib(pid)
                    self.rss_trace.append((done, rss["anon"]))
                    self.progress(f"fuzz: {done}/{opts.cases} cases, "
                                  f"{time.monotonic() - started:.0f} s, RSS "
                                  f"{rss['rss'] // 1024} MiB (anon {rss['anon'] // 1024})")
            rss_after: dict[str, int] = {}
            if not stopped:
                time.sleep(opts.settle_s)  # grants expire, stalled connections are reaped
                self._check(svc, stub, victims, done)
                if peer is not None:
                    peer.check(done)
                if svc.proc is not None and svc.proc.poll() is None:
                    rss_after = _settled_rss(pid, opts.settle_s, self.ctl, 2)
        finally:
            for t in frames.values():
                t.close()
            if peer is not None:
                peer.close()
        for s in [v.session for v in victims] + attackers:
            with contextlib.suppress(Exception):
                s.close()
        channel.close()
        if self.hangs or self.crashes:
            svc.kill()
        else:
            svc.stop()
        log_text = svc.log_path.read_text(errors="replace") if svc.log_path.exists() else ""
        tracebacks = len(re.findall(r"^Traceback \(most recent call last\)", log_text,
                                    flags=re.M))
        report = self._report(done, time.monotonic() - started, rss_before, rss_after,
                              tracebacks, log_text, stopped, frames, svc.log_path)
        if peer is not None:
            report["peer"] = self._peer_report(peer, report)
        if not opts.keep and opts.workdir is None and report["ok"]:
            shutil.rmtree(workdir, ignore_errors=True)
        return report

    def _peer_report(self, peer: PeerFuzz, report: dict[str, Any]) -> dict[str, Any]:
        """The peer target's figures; its failures fail the run (``ok``)."""
        tracebacks, samples = peer.tracebacks()
        if tracebacks:
            report["failures"].append(f"{tracebacks} Traceback(s) in the pod nodes' logs")
        got = {**peer.report(), "tracebacks": tracebacks, "traceback_samples": samples[:5],
               "pod": str(peer.pod.workdir)}
        if peer.failed or tracebacks:
            report["ok"] = False
        return got

    def _report(self, done: int, duration: float, rss_before: dict[str, int],
                rss_after: dict[str, int],
                tracebacks: int, log_text: str, stopped: str,
                frames: dict[str, FrameTarget], log_path: Path) -> dict[str, Any]:
        # The bound is on VmRSS, measured both times after the warm-up (by then the DRAM
        # tier's memfd pages, RssShmem, are all touched: a fixed, configured size). The
        # report also gives the parts; RssAnon alone swings more (native heap).
        before, after = rss_before.get("rss", 0), rss_after.get("rss", 0)
        growth = (after - before) / before if before and after else None
        rss_ok = growth is not None and growth <= self.opts.rss_tolerance
        if tracebacks:
            self.failures.append(f"{tracebacks} Traceback(s) in the service log")
        if growth is not None and not rss_ok:
            self.failures.append(f"RSS grew {growth:+.1%} (tolerance "
                                 f"{self.opts.rss_tolerance:.0%})")
        errors: Counter[str] = Counter()
        for counts in self.per_target.values():
            errors.update(counts)
        samples = [m.group(0)[-1500:] for m in re.finditer(
            r"^Traceback \(most recent call last\):\n(?:[ \t].*\n)+.*", log_text, flags=re.M)]
        ok = not (self.crashes or self.hangs or tracebacks or self.wrong_blocks
                  or self.readback_errors or stopped or not rss_ok)
        return {
            "seed": self.opts.seed, "cases": done, "cases_requested": self.opts.cases,
            "duration_s": round(duration, 1), "cases_per_target": dict(self.cases),
            "outcomes_by_target": {k: dict(v) for k, v in sorted(self.per_target.items())},
            "outcomes": dict(errors.most_common()),
            "crashes": self.crashes, "hangs": self.hangs, "tracebacks": tracebacks,
            "traceback_samples": samples[:5], "wrong_blocks": self.wrong_blocks,
            "readback_errors": self.readback_errors, "readback_misses": self.readback_misses,
            "rss_before_kib": rss_before, "rss_after_kib": rss_after,
            "rss_warmup_cases": self.warmup, "rss_anon_trace_kib": self.rss_trace,
            "rss_growth": None if growth is None else round(growth, 4),
            "fds_received": sum(t.fds_received for t in frames.values()),
            "stopped": stopped, "failures": self.failures[:50], "ok": ok,
            "service_log": str(log_path),
        }


def summary(report: dict[str, Any]) -> str:
    """One line: cases per target, duration, failures, RSS, PASS/FAIL."""
    per = ", ".join(f"{k} {v}" for k, v in sorted(report["cases_per_target"].items()))
    growth = report["rss_growth"]
    b, a = report["rss_before_kib"], report["rss_after_kib"]
    rss = (f"RSS {b['rss'] / 1024:.1f} -> {a['rss'] / 1024:.1f} MiB ({growth:+.1%}; anon "
           f"{b['anon'] / 1024:.1f} -> {a['anon'] / 1024:.1f})"
           if growth is not None else "RSS n/a")
    return (f"fuzz seed {report['seed']}: {report['cases']} cases ({per}) in "
            f"{report['duration_s']} s: crashes {report['crashes']}, hangs {report['hangs']}, "
            f"tracebacks {report['tracebacks']}, wrong blocks {report['wrong_blocks']}, "
            f"readback errors {report['readback_errors']}, misses "
            f"{report['readback_misses']}; {rss}{_peer_summary(report)}: "
            f"{'PASS' if report['ok'] else 'FAIL'}")


def _peer_summary(report: dict[str, Any]) -> str:
    peer = report.get("peer")
    if peer is None:
        return ""
    return (f"; peer: {peer['cross_node_gets']} cross-node gets, wrong blocks "
            f"{peer['cross_node_wrong_blocks']}, misses {peer['cross_node_misses']}, served "
            f"unproven {peer['served_unproven']}, node tracebacks {peer['tracebacks']}")
