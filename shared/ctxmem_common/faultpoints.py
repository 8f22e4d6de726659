"""The fault-injection protocol between the service and whoever drives it.

The service's fault layer (``ctxmem_dpu.faults``) and its drivers (``ctxmem chaos``, the
reliability tests) must agree on the names of the fault points, the actions a point can be
armed with, the environment variables read at start, and the control file's wire format.
This module is that agreement, so neither side copies the other's names: the service
implements the behaviour, the drivers only speak the protocol.

Arming spec (``CTXMEM_FAULTS`` and the control file's ``points``)::

    "name:action[=arg][@N[+]],..."     e.g. "demote.after_payload:kill,commit.after_index:kill@3"

Control file (``CTXMEM_FAULT_CTL=/path/ctl.json``, applied whenever it changes)::

    {"gen": int, "points": "spec" | {name: action}, "journal": bool, "collect_garbage": bool,
     "devices": {name or "*": {"read"|"write"|"sync": "eio"|"enospc"|"ebade",
                               "prob": p, "count": n, "delay_s": s}}}

A key left out leaves that part as the service has it. The service answers in
``/path/ctl.json.ack``: ``{"gen": ..., "pid": ..., "injected": {...}, "hits": {...}}``;
``injected`` counts ``"<op>:<error>"`` (``op`` one of :data:`DEVICE_OPS`),
``"point:<action>"`` and ``"powercut_writes_dropped"``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "ACTIONS",
    "DEVICE_ERRORS",
    "DEVICE_FAULT_KEYS",
    "DEVICE_OPS",
    "ENV_CTL",
    "ENV_JOURNAL",
    "ENV_POINTS",
    "POINTS",
    "POWERCUT_DROPPED",
    "ack_path",
    "arm_spec",
    "points_spec",
    "read_ack",
    "write_control",
]

ENV_POINTS = "CTXMEM_FAULTS"
"""Points armed at start (an arming spec)."""
ENV_CTL = "CTXMEM_FAULT_CTL"
"""Path of the control file the service polls."""
ENV_JOURNAL = "CTXMEM_FAULT_JOURNAL"
"""Non-empty and not "0": keep the write journal a power cut needs, from the start."""

# Every named point, where it sits and what a crash there leaves behind.
POINTS: dict[str, str] = {
    "allocate.after_reserve": "put: DRAM slots reserved, allocation not yet returned",
    "commit.after_crc": "commit: CRC32C computed, blocks not yet in the index",
    "commit.after_index": "commit: blocks visible (DRAM only, not durable)",
    "commit.group_between_members": "group commit (write-through): some members durable "
                                    "on flash, the others not yet written, none visible",
    "demote.before_write": "demote: extents allocated, nothing written",
    "demote.after_payload": "demote: payloads written, not synced, no headers",
    "demote.after_payload_sync": "demote: payloads synced, headers not written",
    "demote.after_header": "demote: headers written, not synced",
    "demote.after_sync": "demote: records durable, index not yet updated",
    "evict.after_demote": "evict: blocks durable, DRAM copies not yet dropped",
    "flash_evict.after_zero": "flash eviction: victims' headers zeroed, not synced",
    "flash_evict.after_sync": "flash eviction: zeroed headers synced, extents not freed",
    "delete.after_index": "delete: keys out of the index, headers still valid on flash",
    "delete.after_zero": "delete: headers zeroed, not synced",
    "delete.after_sync": "delete: zeroed headers synced, extents not yet freed",
    "rebuild.after_scan": "restart: one device scanned, index half built",
    "promote.after_read": "get: flash block read and verified, not yet in DRAM",
    # Not crash points: armed with sleep, they stand for a busy service at Connect (the
    # caller's deadline passes before or after its session is made; tests/adversary).
    "connect.before_session": "connect: caller authenticated, no session made yet",
    "connect.after_session": "connect: session made, not yet answered",
    # Not a crash point: armed with eio, a pod node's heartbeat on a shared device is not
    # written (the node cannot show it lives; tests/dpu/pod/test_index_outage.py).
    "lease.before_beat": "pod: a heartbeat about to be written on a shared device",
}
ACTIONS = ("kill", "powercut", "crash", "eio", "sleep")

DEVICE_OPS = ("read", "write", "sync")
"""The file-layer calls a device fault can fail (also the prefix of ``injected`` counts)."""
DEVICE_ERRORS = ("", "eio", "enospc", "ebade")
"""What a failing device call raises ("": not failed; "ebade": what the block layer returns
for an NVMe Reservation Conflict, i.e. this host's reservation key was preempted)."""
DEVICE_FAULT_KEYS = frozenset({*DEVICE_OPS, "prob", "count", "delay_s"})
"""The keys one device's entry under ``devices`` may hold."""
POWERCUT_DROPPED = "powercut_writes_dropped"
"""The ``injected`` count of device writes a power cut reverted."""


def arm_spec(point: str, action: str) -> str:
    """The arming spec for one point, e.g. ``arm_spec("demote.after_sync", "kill")``.
    Raises ValueError for an unknown point or action (a typo would arm nothing)."""
    if point not in POINTS:
        raise ValueError(f"fault point {point!r} is unknown; known points: {sorted(POINTS)}")
    if action.partition("=")[0] not in ACTIONS:
        raise ValueError(f"fault action {action!r}: must be one of {ACTIONS}")
    return f"{point}:{action}"


def points_spec(raw: Any) -> str:
    """The arming spec of a control file's ``points`` value (a spec or ``{name: action}``)."""
    if not raw:
        return ""
    if isinstance(raw, str):
        return raw
    return ",".join(f"{k}:{v}" for k, v in dict(raw).items())


def ack_path(ctl: str | os.PathLike[str]) -> Path:
    """Where the service acknowledges the control file ``ctl``."""
    return Path(f"{os.fspath(ctl)}.ack")


def write_control(ctl: str | os.PathLike[str], gen: int, *, points: str | None = None,
                  devices: Mapping[str, Mapping[str, Any]] | None = None,
                  journal: bool | None = None, collect_garbage: bool = False) -> None:
    """Replace the control file atomically (the service must never read half of it).
    ``None`` leaves that part out, so the service keeps what it has. ``collect_garbage``:
    the service runs a full garbage collection before it acknowledges ``gen``."""
    body: dict[str, Any] = {"gen": gen}
    if collect_garbage:
        body["collect_garbage"] = True
    if journal is not None:
        body["journal"] = journal
    if points is not None:
        body["points"] = points
    if devices is not None:
        body["devices"] = {name: dict(spec) for name, spec in devices.items()}
    path = Path(ctl)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)


def read_ack(ctl: str | os.PathLike[str]) -> dict[str, Any]:
    """The service's last acknowledgement of ``ctl`` (``{}`` while there is none)."""
    try:
        return dict(json.loads(ack_path(ctl).read_text()))
    except (OSError, ValueError):
        return {}
