"""The fault-point protocol (``ctxmem_common.faultpoints``) and the service's use of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ctxmem_common import faultpoints as fp
from ctxmem_dpu import faults


def test_service_uses_the_shared_names() -> None:
    assert faults.POINTS is fp.POINTS and faults.ACTIONS is fp.ACTIONS
    assert (faults.ENV_POINTS, faults.ENV_CTL, faults.ENV_JOURNAL) == (
        "CTXMEM_FAULTS", "CTXMEM_FAULT_CTL", "CTXMEM_FAULT_JOURNAL")


def test_arm_spec_is_what_the_service_parses() -> None:
    spec = ",".join(fp.arm_spec(p, "kill") for p in fp.POINTS)
    armed = faults.parse_points(spec)
    assert set(armed) == set(fp.POINTS) and {a.action for a in armed.values()} == {"kill"}
    assert faults.parse_points(fp.arm_spec("demote.after_sync", "sleep=0.5"))
    with pytest.raises(ValueError, match="unknown"):
        fp.arm_spec("demote.after_typo", "kill")
    with pytest.raises(ValueError, match="action"):
        fp.arm_spec("demote.after_sync", "explode")


def test_points_spec_accepts_both_forms() -> None:
    assert fp.points_spec("") == "" and fp.points_spec({}) == ""
    assert fp.points_spec("a:kill") == "a:kill"
    assert fp.points_spec({"a": "kill", "b": "eio"}) == "a:kill,b:eio"


def test_control_file_and_ack_round_trip(tmp_path: Path) -> None:
    ctl = tmp_path / "ctl.json"
    assert fp.read_ack(ctl) == {}  # no ack yet
    fp.write_control(ctl, 3, points="a:kill", devices={"*": {"read": "eio"}}, journal=True)
    assert json.loads(ctl.read_text()) == {
        "gen": 3, "journal": True, "points": "a:kill", "devices": {"*": {"read": "eio"}}}
    fp.write_control(ctl, 4)  # parts left out are left as they are
    assert json.loads(ctl.read_text()) == {"gen": 4}
    fp.ack_path(ctl).write_text('{"gen": 4, "injected": {"read:eio": 2}}')
    assert fp.read_ack(ctl)["injected"] == {"read:eio": 2}
    assert set(fp.DEVICE_FAULT_KEYS) >= set(fp.DEVICE_OPS)
    faults.DeviceFault.from_dict({"read": "eio", "prob": 0.5})  # the keys the service takes
    with pytest.raises(ValueError):
        faults.DeviceFault.from_dict({"read": "boom"})
