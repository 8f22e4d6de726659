"""The pod fault campaign in CI (issue 26 item 6): tiny ``ctxmem chaos pod`` runs, each
against its own pod of three real service processes and a real redis-server on one
shared flash file (and one run with a flash file per node), every pod fault kind injected
at least once. No run may serve a wrong byte; no group may leave a stale block after a
delete or re-put, lose an acknowledged write-through block, or leave a session of a
cancelled Connect (each fails on the code before issue 26's fixes: docs/reliability.md,
"The pod campaign", has the figures of both). The long campaign's command is there too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ctxmem_tools.chaos import chaos_command
from ctxmem_tools.chaos.pod import NOT_BUILT, POD_KINDS, WORKLOAD_DELETES, refusal_reason

GROUPS: dict[str, tuple[str, ...]] = {
    "index": ("index_flush", "index_empty_restart", "index_old_snapshot"),
    "lease": ("lease_lapse_delete", "lease_lapse_expire"),
    "node": ("node_pause", "node_kill"),
    "clock": ("clock_skew",),
    "delete": ("delete_reput",),
    "connect": ("cancelled_connect",),
}
LOCAL_KINDS = GROUPS["index"] + GROUPS["node"] + GROUPS["clock"]
"""The run with a flash file per node (no slab leases to lapse)."""
_reports: dict[str, dict[str, Any]] = {}


def _campaign(tmp: Path, group: str, *args: str) -> dict[str, Any]:
    if group not in _reports:
        out = tmp / f"{group}.json"
        kinds = GROUPS.get(group, LOCAL_KINDS)
        faults = 4 if group == "connect" else len(kinds) + 1  # connects are cheap
        rc = chaos_command(["pod", "--faults", str(faults), "--seed", "26",
                            "--kinds", ",".join(kinds), "--working-set", "120",
                            "--json", str(out), "--workdir", str(tmp / group), "-q", *args])
        report: dict[str, Any] = json.loads(out.read_text())
        assert rc == (0 if report["passed"] else 1)
        _reports[group] = report
    return _reports[group]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("podchaos")


def test_the_groups_cover_every_kind() -> None:
    assert sorted(k for g in GROUPS.values() for k in g) == sorted(POD_KINDS)
    assert NOT_BUILT == {}  # every kind of issue 26 item 6 is built


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_kind_runs_and_no_wrong_byte_is_served(tmp: Path, group: str) -> None:
    report = _campaign(tmp, group)
    assert set(report["faults_by_kind"]) == set(GROUPS[group]), report["faults_by_kind"]
    assert report["blocks_acked"] > 0 and report["blocks_served"] > 0
    assert report["wrong_blocks"] == 0, report["problems"]
    assert report["slow_faults"] == 0, report["problems"]  # each fault bounded in time
    assert report["kinds_not_built"] == NOT_BUILT


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_each_kind_keeps_its_invariants(tmp: Path, group: str) -> None:
    """No stale, lost or leaked: what each group's faults are charged with (the deletes of
    the workload are charged apart, below)."""
    report = _campaign(tmp, group)
    charged = {k: v for k, v in report["violations_by_kind"].items() if k != WORKLOAD_DELETES}
    assert charged == {}, report["problems"]
    assert report["durable_blocks_lost"] == 0 and report["sessions_leaked"] == 0


def test_deleted_blocks_are_served_by_no_node(tmp: Path) -> None:
    """The workload deletes keys on their writer to trim its working set; after every fault
    each node is asked for the last 48: none may serve one."""
    for group in sorted(GROUPS):
        report = _campaign(tmp, group)
        assert report["stale_after_delete"] == 0, report["problems"]


def test_local_flash_loses_no_durable_block(tmp: Path) -> None:
    """A pod whose nodes each have their own flash file: index loss, node pauses, kills
    and a node's clock shifted lose no acknowledged write-through block and serve no wrong
    byte."""
    report = _campaign(tmp, "local", "--flash", "local")
    assert report["flash"] == "local"
    assert set(report["faults_by_kind"]) == set(LOCAL_KINDS)
    assert report["wrong_blocks"] == 0, report["problems"]
    assert report["durable_blocks_lost"] == 0, report["problems"]


def test_every_refused_block_is_charged_to_a_cause(tmp: Path) -> None:
    """Availability is reported, not only safety: each refused put block is counted once
    under the fault kind going on and the class of error that refused it."""
    for group in sorted(GROUPS):
        report = _campaign(tmp, group)
        causes = report["refused_by_cause"]
        assert sum(n for by in causes.values() for n in by.values()) \
            == report["blocks_refused"], causes
        assert set(causes) <= {"start", "end", *GROUPS[group]}, causes


def test_refusal_reasons_mask_names_ids_and_figures() -> None:
    """The same cause on other tenants, keys, devices or timings is one class."""
    a = refusal_reason(OSError("Connect for tenant 'carol': the caller's deadline passed "
                               "after 2.5 s (session 0123456789abcdef0123)"))
    b = refusal_reason(OSError("Connect for tenant 'bob': the caller's deadline passed "
                               "after 10 s (session fedcba98765432100000)"))
    assert a == b == ("OSError: Connect for tenant '…': the caller's deadline passed "
                      "after N s (session #)")
    assert refusal_reason(TimeoutError("x")) != refusal_reason(OSError("x"))
