"""``ctxmem chaos pod``: the fault campaign against a pod (issue 26 item 6).

Three real ``ctxmem serve`` nodes and one real ``redis-server`` on loopback, the nodes on
one shared flash file (``--flash shared``, the default: slab leases in Redis) or each on a
file of its own (``--flash local``), all with ``flash.write_policy: write_through`` and the
pod's one master key. Several tenants put blocks on one node and get them through the
others (peer fetch, or straight from the shared device). Keys are content hashes and a
block's bytes are a function of (key, generation): every served block is compared byte
for byte, and bytes of an older generation (a deleted key, or one put again with other
bytes) are told apart from bytes that were never stored.

Fault kinds (:data:`POD_KINDS`):

* index loss: ``index_flush`` (FLUSHALL), ``index_empty_restart`` (redis-server killed
  and started with nothing: it has no persistence), ``index_old_snapshot`` (a SAVE taken
  earlier restored: redis-server killed and started from that RDB);
* lease lapse (shared flash only): ``lease_lapse_delete`` (every slab lease key deleted),
  ``lease_lapse_expire`` (every one PEXPIREd to 1 ms);
* ``node_pause`` (SIGSTOP past ``pod.node_ttl_s`` and the slab lease while the other
  nodes keep writing, then SIGCONT), ``node_kill`` (SIGKILL, restart), ``clock_skew``
  (one node restarted with its wall clock 30 to 300 s ahead or behind, in its process
  only: ``clockskew/sitecustomize.py``; it stays so until its next restart);
* ``delete_reput``: a block put on node A and fetched through B and C, deleted on A (no
  node may serve it once the Delete returned), then put again on A with other bytes (no
  node may serve the first bytes);
* ``cancelled_connect``: raw gRPC Connects (asking for a Hold, as the shim does) whose
  deadline passes at once or that the caller cancels; every session they made is gone
  ``service.session_orphan_s`` later (those the service answered as the caller gave up,
  a race no deadline closes, are counted as ``connects_raced``).

Invariants, checked after every fault once the pod settled (every node up, answering),
and at the end: ``wrong_blocks`` (bytes that were never stored under the key) 0,
``stale_after_delete`` (bytes of a generation deleted or replaced before the read) 0,
``durable_blocks_lost`` (an acknowledged write-through put that no node serves, its
writer first) 0, ``sessions_leaked`` 0. ``violations_by_kind`` charges what a check finds
to the fault just injected.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import redis

from ctxmem.client import Client, Namespace
from ctxmem_common.flash_format import DATA_START, SECTOR, Superblock
from ctxmem_common.layout import KVLayout
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.proto import ctxmem_pb2_grpc as pb_grpc
from ctxmem_common.protoconv import transport_to_pb
from ctxmem_tools.chaos.driver import fresh_client
from ctxmem_tools.chaos.records import IO_ERRORS
from ctxmem_tools.launcher import ServiceProcess, local_config
from ctxmem_tools.pod_launcher import pod_section, write_key
from ctxmem_tools.redis_server import RedisServer

INDEX_LOSS = ("index_flush", "index_empty_restart", "index_old_snapshot")
LEASE_LAPSE = ("lease_lapse_delete", "lease_lapse_expire")
NODE = ("node_pause", "node_kill", "clock_skew")
POD_KINDS = INDEX_LOSS + LEASE_LAPSE + NODE + ("delete_reput", "cancelled_connect")
"""Every fault kind of the pod campaign."""
NOT_BUILT: dict[str, str] = {}
"""Kinds of issue 26 item 6 not built, with the reason (none now)."""
SKEW_DIR = Path(__file__).parent / "clockskew"
"""Its ``sitecustomize`` shifts the wall clock of a process started with it first on
``PYTHONPATH`` and ``CTXMEM_CHAOS_CLOCK_SKEW_S`` set (``clock_skew``)."""
INVARIANTS = ("wrong", "stale", "lost", "sessions")
WORKLOAD_DELETES = "workload_deletes"
"""Where ``violations_by_kind`` charges a key the workload deleted (trimming its working
set) and a node served again (the check after every fault reads the last 48 deleted keys
on every node). Stale blocks are charged to what deleted or re-put the key; wrong and lost
blocks and leaked sessions to the fault just injected (a lost block may be the work of an
earlier index or lease fault, found once another node wrote over the slab)."""
TENANTS = ("alice", "bob", "carol")
NODE_TTL_S = 2.0
SLAB_LEASE_S = 2.0
# service.session_orphan_s on the nodes: a session whose Connect asked for a Hold and got
# none ends this long after the Connect (the default, 5 s, would make every
# cancelled_connect fault wait that long for its check).
ORPHAN_S = 1.0
SHARED_SLAB = 1 << 20
SHARED_SLABS = 40
"""The shared device: 40 slabs of 1 MiB (64 blocks of 16 KiB each), so the nodes take,
fill and give back slabs often and a lapsed lease soon meets a node looking for one."""
CONNECTS = 16
"""Connects per ``cancelled_connect`` fault."""
FAULT_TIMEOUT_S = 60.0
"""A fault (injection, settling and its checks) that takes longer is reported."""


@dataclass
class PodKey:
    tenant: str
    writer: int
    gen: int
    acked: bool = False  # the put returned: with write_through, durable
    uncertain: bool = False  # an operation on it failed: its state is unknown


_MASKS = (
    (re.compile(r"'[^'\s]*'"), "'…'"),  # names: tenants, devices, paths
    (re.compile(r"\b[0-9a-f]{12,}\b"), "#"),  # ids and keys
    (re.compile(r"\d+(\.\d+)?"), "N"),  # figures
)


def refusal_reason(exc: BaseException) -> str:
    """What refused a put, as a class of errors: the exception's type and the first clause
    of its message with names, ids and figures masked, so that the same cause on other
    tenants, keys or nodes counts once (``refused_by_cause`` in the report)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    for pattern, repl in _MASKS:
        text = pattern.sub(repl, text)
    return f"{type(exc).__name__}: {text[:240]}"

@dataclass
class PodStats:
    faults_injected: int = 0
    faults_by_kind: Counter[str] = field(default_factory=Counter)
    not_applied: Counter[str] = field(default_factory=Counter)
    blocks_put: int = 0
    blocks_acked: int = 0
    blocks_refused: int = 0  # puts that raised (write-through commits refused)
    # The refused blocks by what was going on (the last fault kind) and why (the error,
    # its ids and figures masked: :func:`refusal_reason`).
    refused_by_cause: dict[str, Counter[str]] = field(default_factory=dict)
    blocks_served: int = 0
    blocks_deleted: int = 0
    wrong_blocks: int = 0
    stale_after_delete: int = 0
    durable_blocks_lost: int = 0
    sessions_leaked: int = 0
    # Sessions made by Connects whose callers gave up just as the answer left (the race a
    # deadline cannot close: the service had answered): not leaks while they end within
    # service.session_orphan_s like every Connect no Hold followed.
    connects_raced: int = 0
    op_errors: int = 0
    node_restarts: int = 0
    index_restarts: int = 0
    slow_faults: int = 0
    violations: dict[str, Counter[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def note(self, line: str) -> None:
        if len(self.problems) < 200:
            self.problems.append(line)


def format_shared_file(path: Path, slab_size: int, slabs: int) -> None:
    """A blank shared device: a file of ``slabs`` slabs with a superblock pair (what
    ``tests/dpu/pod/podkit.format_shared(slabs=...)`` writes), formatted once before any
    node attaches it."""
    with open(path, "wb") as f:
        f.truncate(DATA_START + slabs * slab_size)
    sb = Superblock(slab_size, slabs, uuid.uuid4().bytes)
    pair = sb.pack_pair()
    assert len(pair) <= 2 * SECTOR
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, pair, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


class PodCampaign:
    """A pod of ``nodes`` services and its index under faults (module docstring)."""

    def __init__(self, workdir: Path, seed: int, *, nodes: int = 3, shared: bool = True,
                 block: int = 16384, working_set: int = 300, verbose: bool = False) -> None:
        self.workdir = workdir
        self.seed = seed
        self.rng = random.Random(seed)
        self.block = block
        self.shared = shared
        self.working_set = working_set
        self.verbose = verbose
        self.layout = KVLayout(dtype="uint8", num_layers=1, num_kv_heads=1,
                               head_dim=block // 2, tokens_per_block=1)
        self.st = PodStats()
        self.keys: dict[bytes, PodKey] = {}
        self.gone: dict[bytes, PodKey] = {}  # deleted (acknowledged): no gen may be served
        self.old_gens: dict[bytes, set[int]] = {}  # generations no node may serve any more
        self.next_key = 0
        self.source = "start"  # what a violation found now is charged to
        # Which deleted or re-put a key (a fault kind or WORKLOAD_DELETES): a stale block
        # is charged to it.
        self.changed_by: dict[bytes, str] = {}
        self.op_errors: list[str] = []  # the first failed operations (not violations)
        self.kinds: tuple[str, ...] = tuple(k for k in POD_KINDS
                                            if shared or k not in LEASE_LAPSE)
        self.redis = RedisServer(workdir / "redis")
        self.snapshot = workdir / "redis" / "snapshot.rdb"
        try:
            self._configure(nodes)
        except BaseException:
            self.redis.stop()
            raise

    def _configure(self, nodes: int) -> None:
        """The nodes' configs (not started yet)."""
        shared = self.shared
        token = os.urandom(16).hex()
        master = os.urandom(32).hex()
        self.nodes: list[ServiceProcess] = []
        self.clients: list[Client | None] = []
        self.ns: dict[tuple[int, str], Namespace] = {}
        shared_path = self.workdir / "shared0.img"
        if shared:
            format_shared_file(shared_path, SHARED_SLAB, SHARED_SLABS)
        level = os.environ.get("CTXMEM_CHAOS_LOG", "warning")
        for i in range(nodes):
            d = self.workdir / f"node{i + 1}"
            write_key(d / "master.key", master)
            cfg = local_config(d, dram_size="16MiB", dram_slab="1MiB", flash_size="32MiB",
                               flash_slab="1MiB", write_policy="write_through",
                               flash_path=str(shared_path) if shared else None,
                               transports=["shm"], logging={"level": level})
            if shared:
                cfg["flash"]["devices"][0].update(name="shared0", shared=True, create=False,
                                                  size=DATA_START + SHARED_SLABS * SHARED_SLAB)
            cfg["metrics"]["listen"] = ""
            cfg["service"]["session_orphan_s"] = ORPHAN_S
            extra: dict[str, Any] = {"slab_lease_s": SLAB_LEASE_S,
                                     "shared_spare_slabs": 1} if shared else {}
            cfg["pod"] = pod_section(self.redis.url, f"node{i + 1}", token,
                                     node_ttl_s=NODE_TTL_S, **extra)
            self.nodes.append(ServiceProcess(d, cfg, start=False))
            self.clients.append(None)

    # -- processes ----------------------------------------------------------------------
    def start_node(self, i: int, env: dict[str, str] | None = None) -> None:
        """Start node ``i`` (``env``: set for this process only)."""
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            self.nodes[i].start(timeout_s=120)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        old = self.clients[i]
        if old is not None:
            with contextlib.suppress(*IO_ERRORS):
                old.close()
        self.clients[i] = fresh_client(self.nodes[i].endpoint, timeout_s=10.0)
        for t in TENANTS:
            self.ns.pop((i, t), None)

    def namespace(self, i: int, tenant: str) -> Namespace:
        ns = self.ns.get((i, tenant))
        if ns is None:
            c = self.clients[i]
            assert c is not None
            ns = self.ns[(i, tenant)] = c.open_namespace(self.layout, model_id="podchaos",
                                                         tenant=tenant)
        return ns

    def alive(self, i: int) -> bool:
        p = self.nodes[i].proc
        return p is not None and p.poll() is None

    def ensure_up(self) -> None:
        """Every node running (a node that died outside a kill is a problem) and Redis up."""
        if self.redis.proc is None or self.redis.proc.poll() is not None:
            self.st.note("redis-server died outside a fault")
            self.redis.start()
        for i in range(len(self.nodes)):
            if not self.alive(i):
                self.st.note(f"node{i + 1} died outside a fault; log:\n"
                             f"{self.nodes[i].log()[-1500:]}")
                self.nodes[i].kill()
                self.start_node(i)
                self.st.node_restarts += 1

    def close(self) -> None:
        for c in self.clients:
            if c is not None:
                with contextlib.suppress(*IO_ERRORS):
                    c.close()
        for n in self.nodes:
            n.stop()
        self.redis.stop()

    # -- the key model ------------------------------------------------------------------
    def content(self, key: bytes, gen: int) -> bytes:
        return hashlib.shake_256(key + gen.to_bytes(4, "little")).digest(self.block)

    def fresh_keys(self, tenant: str, n: int) -> list[bytes]:
        out = []
        for _ in range(n):
            self.next_key += 1
            out.append(hashlib.sha256(f"{self.seed}/{tenant}/{self.next_key}".encode())
                       .digest())
        return out

    def _check(self, key: bytes, data: bytearray, where: str) -> None:
        """A block served for ``key``: the current generation, else stale or wrong."""
        self.st.blocks_served += 1
        k = self.keys.get(key)
        if k is not None and data == self.content(key, k.gen):
            return
        old = set(self.old_gens.get(key, ()))
        g = self.gone.get(key)
        if g is not None:
            old.add(g.gen)
        for gen in sorted(old):
            if data == self.content(key, gen):
                if (k is not None and k.uncertain) or (g is not None and g.uncertain):
                    return  # an operation on it is unfinished: the older one may be there
                self.st.stale_after_delete += 1
                self.charge("stale", source=self.changed_by.get(key))
                self.st.note(f"STALE: {where} served generation {gen} of key "
                             f"{key.hex()[:16]} ({'deleted' if g else f'now {k}'})")
                return
        self.st.wrong_blocks += 1
        self.charge("wrong")
        self.st.note(f"WRONG BLOCK: {where} served bytes never stored under "
                     f"{key.hex()[:16]} ({k or g})")

    # -- operations ---------------------------------------------------------------------
    def put(self, i: int, tenant: str, keys: list[bytes], gen: int = 0) -> bool:
        for key in keys:
            prev = self.keys.get(key) or self.gone.get(key)
            if prev is not None and prev.gen != gen:
                self.old_gens.setdefault(key, set()).add(prev.gen)
                self.changed_by[key] = self.source
            self.gone.pop(key, None)
            self.keys[key] = PodKey(tenant, i, gen, uncertain=True)
        self.st.blocks_put += len(keys)
        try:
            r = self.namespace(i, tenant).put(keys, [self.content(k, gen) for k in keys])
        except IO_ERRORS as exc:
            self.st.op_errors += 1
            self.st.blocks_refused += len(keys)
            self.st.refused_by_cause.setdefault(self.source, Counter())[
                refusal_reason(exc)] += len(keys)
            if len(self.op_errors) < 20:
                self.op_errors.append(f"put on node{i + 1}: {exc}")
            self._forget(keys)
            return False
        if r.stored + r.existing == len(keys):
            for key in keys:
                self.keys[key].uncertain = False
                self.keys[key].acked = True
            self.st.blocks_acked += len(keys)
            return True
        self._forget(keys)
        return False

    def _forget(self, keys: list[bytes]) -> None:
        """Keys whose put or delete failed: stored or not, nobody knows; the campaign
        reads them no more (they would grow the model without bound)."""
        for key in keys:
            self.keys.pop(key, None)

    def get(self, i: int, tenant: str, keys: list[bytes], where: str = "") -> list[bytes]:
        """Get ``keys`` through node ``i`` (each key on its own after a miss); every
        served block is checked. Returns the keys served."""
        served: list[bytes] = []
        if not keys:
            return served
        bufs = [bytearray(self.block) for _ in keys]
        at = where or f"node{i + 1}"
        pos = 0
        while pos < len(keys):
            try:
                n = self.namespace(i, tenant).get(keys[pos:], bufs[pos:])
            except IO_ERRORS:
                n = 0
            for j in range(pos, pos + n):
                self._check(keys[j], bufs[j], at)
                served.append(keys[j])
            pos += n
            if n and pos < len(keys):  # the run stopped at a miss: that key alone
                try:
                    n = self.namespace(i, tenant).get(keys[pos:pos + 1], bufs[pos:pos + 1])
                except IO_ERRORS:
                    n = 0
                if n:
                    self._check(keys[pos], bufs[pos], at)
                    served.append(keys[pos])
            pos += 1
        return served

    def delete(self, i: int, tenant: str, keys: list[bytes], by: str) -> bool:
        for k in keys:
            self.keys[k].uncertain = True
            self.changed_by[k] = by
        try:
            self.namespace(i, tenant).delete(keys)
        except IO_ERRORS:
            self.st.op_errors += 1
            self._forget(keys)
            return False
        for k in keys:
            state = self.keys.pop(k)
            state.uncertain = False
            self.gone[k] = state
        self.st.blocks_deleted += len(keys)
        return True

    def others(self, i: int) -> list[int]:
        return [j for j in range(len(self.nodes)) if j != i]

    def workload_round(self, skip: int | None = None) -> None:
        """A put on one node, gets of a sample through the others, trimming by delete."""
        up = [i for i in range(len(self.nodes)) if i != skip]
        tenant = self.rng.choice(TENANTS)
        writer = self.rng.choice(up)
        keys = self.fresh_keys(tenant, self.rng.randint(4, 24))
        self.put(writer, tenant, keys)
        live = [k for k, s in self.keys.items() if not s.uncertain]
        sample = self.rng.sample(live, min(16, len(live)))
        for t in TENANTS:
            mine = [k for k in sample if self.keys[k].tenant == t]
            if mine:
                self.get(self.rng.choice(up), t, mine)
        if len(self.keys) > self.working_set:
            self.trim(up)

    def trim(self, up: list[int]) -> None:
        over = len(self.keys) - self.working_set + 8
        victims = [k for k, s in self.keys.items() if not s.uncertain and s.writer in up][:over]
        by: dict[tuple[int, str], list[bytes]] = {}
        for k in victims:
            s = self.keys[k]
            by.setdefault((s.writer, s.tenant), []).append(k)
        for (w, t), ks in by.items():
            self.delete(w, t, ks, WORKLOAD_DELETES)
        if len(self.gone) > 4 * self.working_set:  # keep the model bounded
            for k in list(self.gone)[: len(self.gone) - 2 * self.working_set]:
                del self.gone[k]
                self.changed_by.pop(k, None)

    # -- checks -------------------------------------------------------------------------
    def verify(self) -> None:
        """The invariants once the pod settled: every acknowledged live block served by
        its writer or another node (a miss is tried again for a few seconds), no deleted
        block served by any node."""
        self.ensure_up()
        self.drop_dram_copies()
        missing = self._missing()
        deadline = time.monotonic() + 5.0
        while missing and time.monotonic() < deadline:
            time.sleep(0.5)
            missing = self._missing(missing)
        for key in missing:
            s = self.keys[key]
            self.st.durable_blocks_lost += 1
            self.charge("lost")
            self.st.note(f"LOST: acknowledged durable key {key.hex()[:16]} of {s.tenant} "
                         f"written on node{s.writer + 1}: served by no node")
            del self.keys[key]
        recent = list(self.gone)[-48:]
        for i in range(len(self.nodes)):
            for t in TENANTS:
                self.get(i, t, [k for k in recent if self.gone[k].tenant == t],
                         f"node{i + 1} (a deleted key)")

    def drop_dram_copies(self) -> None:
        """Evict every acknowledged block's DRAM copy on its writer: the check then reads
        what the flash holds (a DRAM copy would hide a record lost on the device)."""
        by: dict[tuple[int, str], list[bytes]] = {}
        for k, s in self.keys.items():
            if s.acked and not s.uncertain:
                by.setdefault((s.writer, s.tenant), []).append(k)
        for (w, t), ks in by.items():
            try:
                self.namespace(w, t).evict(ks, "dram")
            except IO_ERRORS as exc:
                self.st.op_errors += 1
                if len(self.op_errors) < 20:
                    self.op_errors.append(f"evict on node{w + 1}: {exc}")

    def _missing(self, only: list[bytes] | None = None) -> list[bytes]:
        want = only if only is not None else [k for k, s in self.keys.items()
                                              if s.acked and not s.uncertain]
        left = list(want)
        order = list(range(len(self.nodes)))
        for step in range(len(self.nodes)):
            if not left:
                break
            groups: dict[tuple[int, str], list[bytes]] = {}
            for k in left:
                s = self.keys[k]
                node = (s.writer + step) % len(order)  # the writer first, then the others
                groups.setdefault((node, s.tenant), []).append(k)
            got: set[bytes] = set()
            for (node, t), ks in groups.items():
                got.update(self.get(node, t, ks))
            left = [k for k in left if k not in got]
        return left

    # -- faults -------------------------------------------------------------------------
    def _redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis.url, socket_timeout=5)

    def take_snapshot(self) -> None:
        """SAVE the index now; ``index_old_snapshot`` restores it later."""
        with self._redis() as r:
            r.save()
        dump = self.redis.workdir / "dump.rdb"
        shutil.move(str(dump), str(self.snapshot))

    def restart_index(self, rdb: Path | None) -> None:
        self.redis.kill()
        dump = self.redis.workdir / "dump.rdb"
        dump.unlink(missing_ok=True)
        if rdb is not None:
            shutil.copy(rdb, dump)
        self.redis.start()
        dump.unlink(missing_ok=True)
        self.st.index_restarts += 1

    def lease_keys(self) -> list[bytes]:
        with self._redis() as r:
            return list(r.scan_iter(match="ctxmem:slab:*:lease", count=1000))

    def inject(self, kind: str) -> bool:
        if kind == "index_flush":
            with self._redis() as r:
                r.flushall()
        elif kind == "index_empty_restart":
            self.restart_index(None)
        elif kind == "index_old_snapshot":
            if not self.snapshot.exists():
                self.take_snapshot()
                return False
            self.restart_index(self.snapshot)
            self.snapshot.unlink()
        elif kind in LEASE_LAPSE:
            keys = self.lease_keys()
            if not keys:
                return False
            with self._redis() as r:
                for k in keys:
                    if kind == "lease_lapse_delete":
                        r.delete(k)
                    else:
                        r.pexpire(k, 1)
        elif kind == "node_pause":
            i = self.rng.randrange(len(self.nodes))
            proc = self.nodes[i].proc
            assert proc is not None
            os.kill(proc.pid, signal.SIGSTOP)
            try:  # past node_ttl_s and the slab lease, the others writing meanwhile
                until = time.monotonic() + max(NODE_TTL_S, SLAB_LEASE_S) + 1.5
                while time.monotonic() < until:
                    self.workload_round(skip=i)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
        elif kind == "clock_skew":  # one node restarted with its wall clock shifted
            i = self.rng.randrange(len(self.nodes))
            skew = self.rng.choice((-1, 1)) * self.rng.uniform(30.0, 300.0)
            self.nodes[i].stop()
            path = os.pathsep.join(p for p in (str(SKEW_DIR), os.environ.get("PYTHONPATH"))
                                   if p)
            self.start_node(i, {"PYTHONPATH": path, "CTXMEM_CHAOS_CLOCK_SKEW_S": f"{skew:.3f}"})
            self.st.node_restarts += 1
            until = time.monotonic() + max(NODE_TTL_S, SLAB_LEASE_S) + 1.0
            while time.monotonic() < until:  # past the leases, every node writing
                self.workload_round()
        elif kind == "node_kill":
            i = self.rng.randrange(len(self.nodes))
            self.nodes[i].kill()
            self.start_node(i)
            self.st.node_restarts += 1
        elif kind == "delete_reput":
            return self.delete_reput()
        elif kind == "cancelled_connect":
            return self.cancelled_connects()
        else:
            raise ValueError(f"unknown pod fault kind {kind!r}")
        return True

    def delete_reput(self) -> bool:
        a = self.rng.randrange(len(self.nodes))
        tenant = self.rng.choice(TENANTS)
        keys = self.fresh_keys(tenant, 4)
        if not self.put(a, tenant, keys):
            return False
        for j in self.others(a):  # fetched copies on every other node (once published)
            deadline = time.monotonic() + 3.0
            while (len(self.get(j, tenant, keys)) < len(keys)
                   and time.monotonic() < deadline):
                time.sleep(0.1)
        if not self.delete(a, tenant, keys, "delete_reput"):
            return False
        for j in range(len(self.nodes)):  # the Delete returned: nobody serves them
            self.get(j, tenant, keys, f"node{j + 1} after a delete on node{a + 1}")
        if not self.put(a, tenant, keys, gen=1):  # other bytes under the same keys
            return True
        for j in range(len(self.nodes)):
            self.get(j, tenant, keys, f"node{j + 1} after a re-put on node{a + 1}")
        return True

    def cancelled_connects(self) -> bool:
        """Connects given up by their callers (deadlines and cancels of 0.5 to 32 ms), as
        the shim sends them (asking for a Hold it then never opens). What must hold: every
        session they made, answered or not, is gone ``ORPHAN_S`` (the nodes'
        ``service.session_orphan_s``) later; more than those answered right after the burst
        are counted as ``connects_raced`` (the service answered as its caller gave up)."""
        i = self.rng.randrange(len(self.nodes))
        c = self.clients[i]
        assert c is not None
        tenant = self.rng.choice(TENANTS)
        try:  # the tenant has its session already (a busy node may refuse it: not applied)
            self.namespace(i, tenant)
            base = int(c.stats().get("sessions", 0))
        except IO_ERRORS:
            return False
        answered = 0
        channel = grpc.insecure_channel(self.nodes[i].endpoint)
        try:
            stub = pb_grpc.ContextMemoryStub(channel)
            req = pb.ConnectRequest(client_name="podchaos", transport=transport_to_pb("shm"),
                                    tenant=tenant, hold=True)
            with contextlib.suppress(grpc.RpcError):
                stub.Health(pb.HealthRequest(), timeout=5)  # the channel is up
            for n in range(CONNECTS):  # deadlines and cancels from 0.5 to 32 ms
                wait = 0.0005 * (1 << self.rng.randrange(7))
                try:
                    if n % 2:
                        fut = stub.Connect.future(req, timeout=5)
                        time.sleep(wait)
                        if not fut.cancel():  # it had answered: a session, rightly
                            fut.result()
                            answered += 1
                    else:
                        stub.Connect(req, timeout=wait)
                        answered += 1  # it answered within the deadline: rightly made
                except grpc.RpcError:
                    pass
        finally:
            channel.close()
        try:
            time.sleep(0.2)
            now = int(c.stats().get("sessions", 0))
            self.st.connects_raced += max(0, now - base - answered)
            deadline = time.monotonic() + ORPHAN_S + 5.0  # the reaper's tick and load
            while now > base and time.monotonic() < deadline:
                time.sleep(0.2)
                now = int(c.stats().get("sessions", 0))
        except IO_ERRORS as exc:  # the node stopped answering: the count is unknown
            self.st.note(f"node{i + 1}: sessions not counted after the cancelled Connects "
                         f"({exc})")
            return True
        if now > base:
            self.st.sessions_leaked += now - base
            self.charge("sessions", now - base)
            self.st.note(f"SESSIONS: node{i + 1} holds {now - base} more sessions "
                         f"{ORPHAN_S + 5.0:g} s after {CONNECTS} Connects no Hold followed "
                         f"({answered} answered; {base} -> {now})")
        return True

    # -- the campaign -------------------------------------------------------------------
    def schedule(self, n: int) -> list[str]:
        first = list(self.kinds)
        self.rng.shuffle(first)
        return (first + [self.rng.choice(self.kinds) for _ in range(max(0, n - len(first)))]
                )[:max(n, len(first))]

    def charge(self, invariant: str, n: int = 1, source: str | None = None) -> None:
        """Count a violation against ``source``, by default what is going on
        (:attr:`source`)."""
        self.st.violations.setdefault(source or self.source, Counter())[invariant] += n

    def run(self, n: int, progress: bool = False) -> None:
        for i in range(len(self.nodes)):
            self.start_node(i)
        t0 = time.monotonic()
        for _ in range(6):
            self.workload_round()
        self.take_snapshot()
        planned = self.schedule(n)
        tries: Counter[str] = Counter()
        stuck = 0
        while planned or self.st.faults_injected < n:
            if not planned:  # some faults could not be applied: draw more
                planned.append(self.rng.choice(self.kinds))
            kind = planned.pop(0)
            self.source = kind
            start = time.monotonic()
            self.workload_round()
            if self.rng.random() < 0.1 and not self.snapshot.exists():
                self.take_snapshot()
            applied = self.inject(kind)
            if applied and kind in INDEX_LOSS + LEASE_LAPSE:
                # The pod runs on for a lease period (renewals, slabs taken to write into)
                # before the check: what the index lost shows in what the nodes do next.
                until = time.monotonic() + max(NODE_TTL_S, SLAB_LEASE_S) + 0.5
                while time.monotonic() < until:
                    self.workload_round()
            if applied:
                self.st.faults_injected += 1
                self.st.faults_by_kind[kind] += 1
                stuck = 0
            else:  # not applicable now (no lease held, no snapshot, a put refused)
                stuck += 1
                self.st.not_applied[kind] += 1
                if not self.st.faults_by_kind[kind] and tries[kind] < 20:
                    tries[kind] += 1  # every kind runs once: again, a little later
                    planned.insert(min(2, len(planned)), kind)
            self.workload_round()
            self.verify()
            took = time.monotonic() - start
            if took > FAULT_TIMEOUT_S:
                self.st.slow_faults += 1
                self.st.note(f"{kind}: took {took:.0f} s (bound {FAULT_TIMEOUT_S:.0f} s)")
            if stuck > 100:
                self.st.note(f"no fault could be applied in 100 tries (last: {kind}): "
                             "stopped early; see the nodes' logs")
                break
            done = self.st.faults_injected
            if progress and applied and (done % 10 == 0 or done == n):
                after = {k: sum(v[k] for v in self.st.violations.values())
                         for k in INVARIANTS}
                print(f"  {done}/{n} faults ({kind}), {self.st.blocks_served} served, "
                      f"{after}, {time.monotonic() - t0:.0f} s", flush=True)
        self.source = "end"
        self.verify()  # the end: once more, every node

    def report(self, duration: float) -> dict[str, Any]:
        st = self.st
        out: dict[str, Any] = {
            "mode": "pod", "nodes": len(self.nodes),
            "flash": "shared" if self.shared else "local", "write_policy": "write_through",
            "faults_injected": st.faults_injected,
            "faults_by_kind": dict(sorted(st.faults_by_kind.items())),
            "faults_not_applied": dict(sorted(st.not_applied.items())),
            "blocks_put": st.blocks_put, "blocks_acked": st.blocks_acked,
            "blocks_refused": st.blocks_refused,
            "refused_by_cause": {k: dict(v.most_common())
                                 for k, v in sorted(st.refused_by_cause.items())},
            "blocks_served": st.blocks_served, "blocks_deleted": st.blocks_deleted,
            "wrong_blocks": st.wrong_blocks, "stale_after_delete": st.stale_after_delete,
            "durable_blocks_lost": st.durable_blocks_lost,
            "sessions_leaked": st.sessions_leaked, "connects_raced": st.connects_raced,
            "violations_by_kind": {k: dict(v) for k, v in sorted(st.violations.items())},
            "op_errors": st.op_errors, "node_restarts": st.node_restarts,
            "index_restarts": st.index_restarts, "slow_faults": st.slow_faults,
            "kinds": list(self.kinds), "kinds_not_built": dict(NOT_BUILT),
            "duration_s": round(duration, 1), "seed": self.seed,
            "problems": st.problems[:50],
            "op_errors_first": self.op_errors,
        }
        out["passed"] = not (st.wrong_blocks or st.stale_after_delete
                             or st.durable_blocks_lost or st.sessions_leaked)
        return out


def run_pod_campaign(faults: int, seed: int, workdir: Path | None = None, *,
                     shared: bool = True, kinds: str = "", progress: bool = False,
                     keep: bool = False, working_set: int = 300) -> dict[str, Any]:
    """Run a pod campaign; returns the report (what ``--json`` writes). ``kinds``:
    comma-separated kinds of :data:`POD_KINDS` (default: all that the flash mode runs)."""
    base = workdir or Path(tempfile.mkdtemp(prefix="ctxmem-podchaos-", dir="/var/tmp"))
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    camp = PodCampaign(base, seed, shared=shared, verbose=progress, working_set=working_set)
    if kinds:
        chosen = [k.strip() for k in kinds.split(",") if k.strip()]
        bad = [k for k in chosen if k not in camp.kinds]
        if bad:
            camp.close()
            raise ValueError(f"unknown or unrunnable pod fault kind(s) {bad} (this mode "
                             f"runs: {', '.join(camp.kinds)}; not built: "
                             f"{', '.join(NOT_BUILT)})")
        camp.kinds = tuple(k for k in camp.kinds if k in chosen)
    t0 = time.monotonic()
    try:
        camp.run(faults, progress)
        report = camp.report(time.monotonic() - t0)
    except BaseException:
        for i, node in enumerate(camp.nodes):
            print(f"ctxmem chaos pod: failed; node{i + 1} log:\n{node.log()[-3000:]}",
                  file=sys.stderr)
        raise
    finally:
        camp.close()
        if not keep and workdir is None:
            shutil.rmtree(base, ignore_errors=True)
    report["workdir"] = str(base) if keep or workdir is not None else ""
    return report


def _parser() -> argparse.ArgumentParser:
    """The command's argument parser (also what tests/deploy/test_doc_shell_blocks.py
    checks the documented command lines with)."""
    p = argparse.ArgumentParser(
        prog="ctxmem chaos pod",
        description="Inject index loss, lease lapses, node pauses and kills, deletes and "
                    "re-puts across nodes and cancelled Connects into a pod of three real "
                    "nodes and a real redis-server; check no wrong or stale block is served, "
                    "no acknowledged write-through block is lost, no session leaks.")
    p.add_argument("--faults", type=int, default=200, help="faults to inject (200)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument("--flash", choices=("shared", "local"), default="shared",
                   help="one shared flash file with slab leases (default), or one per node")
    p.add_argument("--kinds", default="", help="comma-separated kinds (default: all): "
                   + ", ".join(POD_KINDS))
    p.add_argument("--working-set", type=int, default=300, help="live keys kept (300)")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--workdir", help="keep the pod's files here (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    p.add_argument("-q", "--quiet", action="store_true")
    return p


def pod_command(argv: list[str]) -> int:
    """``ctxmem chaos pod`` (also ``ctxmem chaos --pod``)."""
    p = _parser()
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    if not args.quiet:
        print(f"ctxmem chaos pod: {args.faults} faults, seed {seed}, {args.flash} flash",
              flush=True)
        for kind, why in NOT_BUILT.items():
            print(f"ctxmem chaos pod: {kind}: {why}", flush=True)
    shim_log = logging.getLogger("ctxmem")
    level = shim_log.level
    shim_log.setLevel(logging.ERROR)  # a paused or killed node answers misses: expected
    try:
        report = run_pod_campaign(args.faults, seed,
                                  Path(args.workdir) if args.workdir else None,
                                  shared=args.flash == "shared", kinds=args.kinds,
                                  progress=not args.quiet, keep=args.keep,
                                  working_set=args.working_set)
    except ValueError as exc:
        p.error(str(exc))
    finally:
        shim_log.setLevel(level)
    summary = {k: report[k] for k in (
        "faults_injected", "faults_by_kind", "blocks_acked", "blocks_served", "wrong_blocks",
        "stale_after_delete", "durable_blocks_lost", "sessions_leaked", "violations_by_kind",
        "duration_s", "passed")}
    print(json.dumps(summary, indent=2))
    for line in report["problems"][:20]:
        print(f"problem: {line}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1
