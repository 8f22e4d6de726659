"""Fault injection for reliability tests and the chaos campaign (off unless asked for).

Two mechanisms, both free when unused (one module-global check per call site):

**Named fault points.** The store and the flash tier call :func:`point` at the places where
a crash matters (see :data:`POINTS`: put, commit, demote, evict, delete, rebuild). A point
is armed with an action:

* ``kill`` — ``SIGKILL`` this process on the spot (what ``kill -9`` does);
* ``powercut`` — first drop (or tear) the device writes not yet flushed by ``fdatasync``,
  as a power loss would, then ``SIGKILL`` (needs the write journal, see below);
* ``crash`` — raise :class:`SimulatedCrash` (in-process tests: the store is abandoned);
* ``eio`` — raise ``OSError(EIO)`` at that point;
* ``sleep=S`` — stall S seconds.

Arm points with the environment at start, e.g.
``CTXMEM_FAULTS="demote.after_payload:kill,commit.after_index:kill@3"`` (``@N``: on the
N-th time the point is reached, once; ``@N+``: every time from the N-th on), in-process
with :func:`configure`, or at run time through the control file below.

**A fault-injecting file layer.** :class:`~ctxmem_dpu.tiers.flash.FlashDevice` passes each
``pread``/``pwrite``/``fdatasync`` through :func:`before_io` / :func:`after_sync` while
faults are active. Per device it can fail reads, writes or syncs with ``EIO``,
``ENOSPC`` or ``EBADE`` (what the block layer returns for an NVMe Reservation Conflict:
this host's key was preempted), with a probability or for the next N calls, and delay
them (a slow device).
With the journal on, it keeps the pre-image of every write since the device's last
successful ``fdatasync``; ``powercut`` reverts a random subset of those writes, some only
in part (512-byte pieces: a torn write), before killing the process.

**Control file.** With ``CTXMEM_FAULT_CTL=/path/ctl.json`` set, a thread polls the file
(every 10 ms) and applies it whenever it changes; it then writes ``/path/ctl.json.ack``
(``{"gen": ..., "pid": ..., "injected": {...}, "hits": {...}}``) so a driver knows the
change is in force. The file holds ``{"gen": int, "points": "spec" | {}, "devices":
{name or "*": {"read"|"write"|"sync": "eio"|"enospc"|"ebade", "prob": p, "count": n,
"delay_s": s}}, "journal": bool, "collect_garbage": bool}``; a key left out leaves that
part unchanged; ``collect_garbage`` runs a full ``gc.collect()`` before the ack (a driver
that measures the service's memory once settled: ``ctxmem fuzz``), then glibc's
``malloc_trim(0)``, so freed heap is given back to the kernel and RSS shows what is held.
``ctxmem chaos`` drives a live service this way.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import json
import logging
import mmap
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ctxmem_common.faultpoints import (
    ACTIONS,
    DEVICE_ERRORS,
    DEVICE_FAULT_KEYS,
    ENV_CTL,
    ENV_JOURNAL,
    ENV_POINTS,
    POINTS,
    POWERCUT_DROPPED,
    ack_path,
    points_spec,
)

log = logging.getLogger(__name__)

# The names (points, actions, environment) and the control file's format are the protocol
# shared with the drivers: ctxmem_common.faultpoints.


class SimulatedCrash(BaseException):
    """Raised by a point armed with ``crash``: a BaseException, so no ``except Exception``
    in the store swallows it; the test abandons the store as if the process had died."""


@dataclass
class _Arm:
    action: str
    at: int = 1
    repeat: bool = False
    arg: float = 0.0
    hits: int = 0


@dataclass
class DeviceFault:
    """Faults of one device in the file layer."""

    read: str = ""  # "", "eio", "enospc" or "ebade"
    write: str = ""
    sync: str = ""
    prob: float = 1.0
    count: int = -1  # fail this many calls, then stop; -1: until cleared
    delay_s: float = 0.0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DeviceFault:
        unknown = set(raw) - DEVICE_FAULT_KEYS
        if unknown:
            raise ValueError(f"device fault: unknown keys {sorted(unknown)}")
        f = cls(**raw)
        for op in (f.read, f.write, f.sync):
            if op not in DEVICE_ERRORS:
                raise ValueError(f"device fault: {op!r} is not one of {DEVICE_ERRORS}")
        return f


@dataclass
class _Journal:
    path: str
    entries: list[tuple[int, bytes]] = field(default_factory=list)


# -- state (guarded by _lock; read without it on the fast paths) --------------------------
_lock = threading.Lock()
_armed: dict[str, _Arm] = {}
_devices: dict[str, DeviceFault] = {}
_journal_on = False
_journals: dict[int, _Journal] = {}  # by fd
_injected: Counter[str] = Counter()
_hits: Counter[str] = Counter()
_poller: threading.Thread | None = None
active = False  # anything configured at all: FlashDevice checks this before calling in



def _settle_memory() -> None:
    """A full garbage collection, then ``malloc_trim(0)`` (glibc only): RSS then counts
    memory the service holds, not freed heap the allocator kept (what "RSS once settled"
    means to a driver measuring leaks)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)

def _refresh_active() -> None:
    global active
    active = bool(_armed or _devices or _journal_on)


def parse_points(spec: str) -> dict[str, _Arm]:
    """``"name:action[=arg][@N[+]],..."`` → armed points. Raises ValueError on a typo."""
    out: dict[str, _Arm] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, rest = part.partition(":")
        if not sep:
            raise ValueError(f"fault {part!r}: expected POINT:ACTION")
        if name not in POINTS:
            raise ValueError(f"fault point {name!r} is unknown; known points: {sorted(POINTS)}")
        action, _, when = rest.partition("@")
        action, _, arg = action.partition("=")
        if action not in ACTIONS:
            raise ValueError(f"fault {part!r}: action must be one of {ACTIONS}")
        repeat = when.endswith("+")
        at = int(when.rstrip("+") or 1)
        out[name] = _Arm(action, at, repeat, float(arg or 0.0))
    return out


def configure(points: str | None = None, devices: dict[str, Any] | None = None,
              journal: bool | None = None) -> None:
    """Arm points (replacing the armed set), set device faults (replacing them), turn the
    write journal on or off. ``None`` leaves that part as it is."""
    global _journal_on
    with _lock:
        if points is not None:
            _armed.clear()
            _armed.update(parse_points(points))
        if devices is not None:
            _devices.clear()
            _devices.update({k: v if isinstance(v, DeviceFault) else DeviceFault.from_dict(v)
                             for k, v in devices.items()})
        if journal is not None:
            _journal_on = journal
            if not journal:
                _journals.clear()
        _refresh_active()


def reset() -> None:
    """Everything off, counters cleared (tests)."""
    configure(points="", devices={}, journal=False)
    with _lock:
        _injected.clear()
        _hits.clear()


def injected() -> dict[str, int]:
    with _lock:
        return dict(_injected)


def hits() -> dict[str, int]:
    with _lock:
        return dict(_hits)


# -- named points -------------------------------------------------------------------------
def point(name: str) -> None:
    """A named fault point; does nothing unless armed."""
    if not _armed:
        return
    with _lock:
        arm = _armed.get(name)
        if arm is None:
            return
        arm.hits += 1
        _hits[name] += 1
        if arm.hits < arm.at or (arm.hits > arm.at and not arm.repeat):
            return
        if not arm.repeat:
            del _armed[name]
            _refresh_active()
        _injected[f"point:{arm.action}"] += 1
    _fire(name, arm)


def _fire(name: str, arm: _Arm) -> None:
    if arm.action == "sleep":
        time.sleep(arm.arg)
        return
    log.warning("fault point %s: %s", name, arm.action)
    if arm.action == "eio":
        raise OSError(errno.EIO, f"injected EIO at fault point {name}")
    if arm.action == "crash":
        raise SimulatedCrash(name)
    _write_ack()  # best effort, so a driver sees the hit counted
    if arm.action == "powercut":
        power_cut(then_kill=True)
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(10)  # pragma: no cover - the signal is delivered before this returns


# -- the file layer -----------------------------------------------------------------------
def before_io(device: str, op: str, fd: int, path: str, offset: int, nbytes: int) -> None:
    """Called by the flash tier before a device ``read``/``write``/``sync``: may stall,
    raise ``OSError`` (EIO/ENOSPC), and journals a write's pre-image for power cuts."""
    f = _devices.get(device) or _devices.get("*")
    if f is not None:
        if f.delay_s:
            time.sleep(f.delay_s)
        kind = getattr(f, op, "")
        if kind and (f.prob >= 1.0 or random.random() < f.prob):
            with _lock:
                fire = f.count != 0
                if f.count > 0:
                    f.count -= 1
                if fire:
                    _injected[f"{op}:{kind}"] += 1
            if fire:
                code = {"enospc": errno.ENOSPC, "ebade": errno.EBADE}.get(kind, errno.EIO)
                raise OSError(code, f"injected {kind.upper()} on {op} ({device})")
    if op == "write" and _journal_on and nbytes > 0:
        pre = _read_preimage(fd, offset, nbytes)
        with _lock:
            _journals.setdefault(fd, _Journal(path)).entries.append((offset, pre))


def _read_preimage(fd: int, offset: int, nbytes: int) -> bytes:
    buf = mmap.mmap(-1, max(nbytes, 4096))
    try:
        n = os.preadv(fd, [memoryview(buf)[:nbytes]], offset)
    except OSError:
        n = 0
    data = bytes(buf[:max(n, 0)]) + bytes(nbytes - max(n, 0))
    buf.close()
    return data


def after_sync(fd: int) -> None:
    """The device's ``fdatasync`` returned: its journaled writes are now stable."""
    if _journal_on:
        with _lock:
            j = _journals.get(fd)
            if j is not None:
                j.entries.clear()


def forget_fd(fd: int) -> None:
    with _lock:
        _journals.pop(fd, None)


def power_cut(rng: random.Random | None = None, then_kill: bool = False) -> int:
    """Drop or tear writes not yet synced, as a power loss would; returns how many writes
    were touched. Each journaled write (newest first) is reverted (1/2), torn — reverted
    in some 512-byte pieces only — (1/4), or kept (1/4).

    Holds the state lock throughout (and, with ``then_kill``, until the process is gone):
    a concurrent ``fdatasync`` cannot mark writes stable meanwhile, so nothing the store
    could have acknowledged as durable is ever reverted."""
    rng = rng or random.Random()
    touched = 0
    with _lock:
        journals = [(j.path, list(j.entries)) for j in _journals.values()]
        _journals.clear()
        for path, entries in journals:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                for offset, pre in reversed(entries):
                    r = rng.random()
                    if r < 0.5:
                        os.pwrite(fd, pre, offset)
                    elif r < 0.75:
                        for piece in range(0, len(pre), 512):
                            if rng.random() < 0.5:
                                os.pwrite(fd, pre[piece:piece + 512], offset + piece)
                    else:
                        continue
                    touched += 1
                os.fsync(fd)
            finally:
                os.close(fd)
        _injected[POWERCUT_DROPPED] += touched
        if then_kill:
            _write_ack(locked=True)
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(10)  # pragma: no cover
    return touched


# -- control file -------------------------------------------------------------------------
def install_from_env() -> None:
    """Apply ``CTXMEM_FAULTS`` / ``CTXMEM_FAULT_JOURNAL`` and start the control-file poller
    when ``CTXMEM_FAULT_CTL`` is set. Called once by the store at start."""
    global _poller
    spec = os.environ.get(ENV_POINTS, "")
    journal = os.environ.get(ENV_JOURNAL, "") not in ("", "0")
    if spec or journal:
        configure(points=spec or None, journal=journal or None)
        log.warning("fault injection on: points %r, write journal %s", spec, journal)
    ctl = os.environ.get(ENV_CTL, "")
    if ctl and _poller is None:
        _poller = threading.Thread(target=_poll, args=(ctl,), name="ctxmem-faults", daemon=True)
        _poller.start()
        log.warning("fault injection control file: %s", ctl)


_ctl_path = ""
_gen = -1


def _write_ack(locked: bool = False) -> None:
    if not _ctl_path:
        return
    with contextlib.nullcontext() if locked else _lock:
        body = {"gen": _gen, "pid": os.getpid(), "injected": dict(_injected),
                "hits": dict(_hits)}
    tmp = f"{_ctl_path}.ack.{os.getpid()}.tmp"
    with contextlib.suppress(OSError):
        with open(tmp, "w") as f:
            json.dump(body, f)
        os.replace(tmp, ack_path(_ctl_path))


def _poll(path: str) -> None:
    global _ctl_path, _gen
    _ctl_path = path
    seen: tuple[int, int, int] | None = None
    last_counts: tuple[Any, ...] = ()
    _write_ack()
    while True:
        try:
            st = os.stat(path)
            sig = (st.st_mtime_ns, st.st_size, st.st_ino)
            if sig != seen:
                seen = sig
                with open(path) as f:
                    raw = json.load(f)
                # A key left out leaves that part as it is (e.g. points armed by the
                # environment at start, before the first poll).
                configure(points=points_spec(raw["points"]) if "points" in raw else None,
                          devices=(raw["devices"] or {}) if "devices" in raw else None,
                          journal=bool(raw["journal"]) if "journal" in raw else None)
                if raw.get("collect_garbage"):
                    _settle_memory()
                _gen = int(raw.get("gen", 0))
                _write_ack()
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            log.error("fault control file %s: %s", path, exc)
        with _lock:
            counts = (tuple(sorted(_injected.items())), tuple(sorted(_hits.items())))
        if counts != last_counts:
            last_counts = counts
            _write_ack()
        time.sleep(0.01)
