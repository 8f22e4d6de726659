"""The fault campaign in CI: a short ``ctxmem chaos`` run against a live service. Every
fault kind is injected at least once; no wrong block may be served, no durable block
lost, no deleted block resurrected, no space leaked; ``ctxmem check --repair`` then
``ctxmem check`` must leave the devices clean. The long campaign's figures are in
docs/reliability.md."""

from __future__ import annotations

import json
from pathlib import Path

from ctxmem_tools.chaos import KINDS, chaos_command


def test_short_campaign(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    rc = chaos_command(["--faults", "300", "--seed", "6", "--json", str(out),
                        "--workdir", str(tmp_path / "work"), "-q"])
    report = json.loads(out.read_text())
    assert report["wrong_blocks"] == 0, report["problems"]
    assert report["durable_blocks_lost"] == 0, report["problems"]
    assert report["resurrected_blocks"] == 0, report["problems"]
    assert report["space_leak_bytes"] == 0, report["problems"]
    assert report["check_after_repair_clean"], report["check"]
    assert rc == 0 and report["passed"]
    assert report["faults_injected"] >= 300
    assert set(report["faults_by_kind"]) == set(KINDS)  # every kind at least once
    assert report["blocks_committed"] > 0 and report["blocks_served"] > 0
    for field in ("faults_injected", "blocks_committed", "blocks_served", "wrong_blocks",
                  "blocks_lost", "lost_fraction"):
        assert field in report
