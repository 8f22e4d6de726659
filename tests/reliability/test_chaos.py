"""The fault campaign in CI: a short ``ctxmem chaos`` run against a live service. Every
default fault kind is injected at least once (the schedule's first pass, retried until
each applies); no wrong block may be served, no durable block lost, no deleted block
resurrected, no space leaked; ``ctxmem check --repair`` then ``ctxmem check`` must leave
the devices clean. Each scenario kind (issue 13) runs once in a test of its own. The long
campaign's figures are in docs/reliability.md."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from ctxmem_tools.chaos import DEFAULT_KINDS, KINDS, SCENARIO, chaos_command, select_kinds


def _campaign(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "chaos.json"
    rc = chaos_command([*args, "--json", str(out), "--workdir", str(tmp_path / "work"), "-q"])
    return rc, json.loads(out.read_text())


def test_short_campaign(tmp_path: Path) -> None:
    rc, report = _campaign(tmp_path, "--faults", "300", "--seed", "6",
                           "--png", str(tmp_path / "chaos.png"))
    assert report["wrong_blocks"] == 0, report["problems"]
    assert report["durable_blocks_lost"] == 0, report["problems"]
    assert report["resurrected_blocks"] == 0, report["problems"]
    assert report["space_leak_bytes"] == 0, report["problems"]
    assert report["check_after_repair_clean"], report["check"]
    assert rc == 0 and report["passed"]
    assert report["faults_injected"] >= 300
    assert set(report["faults_by_kind"]) == set(DEFAULT_KINDS)  # every kind at least once
    assert report["blocks_committed"] > 0 and report["blocks_served"] > 0
    for field in ("faults_injected", "blocks_committed", "blocks_served", "wrong_blocks",
                  "blocks_lost", "lost_fraction"):
        assert field in report
    # The timeline --png draws: from 0 to the end, a point every ~1.5 faults (300 / 200).
    timeline = report["timeline"]
    assert timeline[0]["faults"] == 0 and timeline[-1]["faults"] == report["faults_injected"]
    assert 100 <= len(timeline) <= 302
    assert [p["faults"] for p in timeline] == sorted(p["faults"] for p in timeline)
    assert all(p["wrong_blocks"] == 0 for p in timeline)
    assert (tmp_path / "chaos.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kind_selection() -> None:
    assert select_kinds("corruption,device,crash")[0] == DEFAULT_KINDS
    kinds, _ = select_kinds("-scenario,-zero_header")
    assert "zero_header" not in kinds and not set(SCENARIO) & set(kinds)
    assert set(select_kinds("stalled_client,eio_read")[0]) == {"stalled_client", "eio_read"}
    if os.geteuid() != 0:
        kinds, skipped = select_kinds("all")
        assert "full_filesystem" not in kinds and skipped
    else:
        assert select_kinds("all")[0] == KINDS
    with pytest.raises(ValueError):
        select_kinds("no_such_kind")


# Each issue-13 fault kind once: the campaign's result must be clean (before the fixes,
# each of these found wrong blocks, a lost durable write, a silent reformat or a grown
# live device).
@pytest.mark.parametrize("kind,extra", [
    ("stalled_client", ()),
    ("full_filesystem", ("--write-policy", "write_through")),
    ("full_filesystem", ()),
    ("superblock_both", ()),
    ("alias_service", ()),
])
def test_scenario_kind(tmp_path: Path, kind: str, extra: tuple[str, ...]) -> None:
    if kind == "full_filesystem" and os.geteuid() != 0:
        pytest.skip("full_filesystem mounts a tmpfs: needs root")
    rc, report = _campaign(tmp_path, "--faults", "1", "--seed", "13", "--kinds", kind, *extra)
    assert report["faults_by_kind"].get(kind) == 1, report["problems"]
    assert report["kinds"] == [kind]
    assert report["kind_failures"] == {kind: 0}, report["problems"]
    assert report["wrong_blocks"] == 0 and report["durable_blocks_lost"] == 0
    assert rc == 0 and report["passed"], report["problems"]


def test_progress_bar_on_a_terminal_only() -> None:
    """``ctxmem chaos`` on a terminal: a bar with the faults done, percent, ETA and the
    wrong-block count; with CI set (or on a pipe): no bar, the plain lines."""
    import fcntl
    import pty
    import select
    import struct
    import subprocess
    import sys
    import termios

    root = Path(__file__).resolve().parents[2]
    base = {k: v for k, v in os.environ.items() if k not in ("CI", "CTXMEM_PROGRESS")}
    base["PYTHONPATH"] = os.pathsep.join(str(root / d) for d in ("shared", "dpu", "host",
                                                                  "tools"))
    cmd = [sys.executable, "-m", "ctxmem_common.cli", "chaos", "--faults", "12", "--kinds",
           "corruption", "--seed", "3"]
    outputs = {}
    for ci in (False, True):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
        env = {**base, "CI": "true"} if ci else base
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=slave, env=env,
                                  timeout=240)
            err = b""
            while select.select([master], [], [], 0.2)[0]:
                chunk = os.read(master, 65536)
                if not chunk:
                    break
                err += chunk
        finally:
            os.close(slave)
            os.close(master)
        assert proc.returncode == 0, err.decode()
        outputs[ci] = err.decode("utf-8", "replace")
    assert "ctxmem chaos: 100%" in outputs[False], outputs[False]
    assert "ETA" in outputs[False] and "wrong=0" in outputs[False], outputs[False]
    assert "ETA" not in outputs[True] and "%|" not in outputs[True], outputs[True]
