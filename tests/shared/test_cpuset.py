"""``service.cpu_affinity``: the cpulist syntax, and CPUs refused at load when they do not
exist or lie outside the process's allowed set (ctxmem_common.cpuset)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ctxmem_common.config import parse_config
from ctxmem_common.cpuset import format_cpulist, online_cpus, parse_cpulist
from ctxmem_common.errors import ConfigError


@pytest.mark.parametrize(("value", "cpus"), [
    ([], []),
    ("", []),
    ([1], [1]),
    ([3, 1, 3], [1, 3]),
    ("1", [1]),
    ("2-3,6", [2, 3, 6]),
    (" 0 , 4-5 ", [0, 4, 5]),
    ("5-5,1", [1, 5]),
])
def test_cpulists_parse_sorted_and_distinct(value: object, cpus: list[int]) -> None:
    assert parse_cpulist(value, "k") == cpus


@pytest.mark.parametrize(("value", "message"), [
    ("3-1", r"k: '3-1' in '3-1' is not a range"),
    ("a", r"k: 'a' in 'a' is not a CPU id"),
    ("1,,2", r"k: '1,,2' has an empty item"),
    ("-1", r"k: '-1' in '-1' is not a CPU id"),
    ([1, -2], r"k\[1\]: -2 is not a CPU id"),
    ([True], r"k\[0\]: True is not a CPU id"),
    (["1"], r"k\[0\]: '1' is not a CPU id"),
    (3, r"k: expected a list of CPU ids or a cpulist string"),
])
def test_bad_cpulists_name_the_key_and_part(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_cpulist(value, "k")


def test_format_cpulist_round_trips() -> None:
    assert format_cpulist([6, 2, 3, 0]) == "0,2-3,6"
    assert format_cpulist([]) == ""
    assert parse_cpulist(format_cpulist([0, 1, 2, 7, 9, 10]), "k") == [0, 1, 2, 7, 9, 10]


def test_config_takes_a_list_or_a_cpulist_and_defaults_to_no_pinning() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert parse_config("{}").service.cpu_affinity == []
    first = allowed[0]
    assert parse_config(f"service: {{cpu_affinity: [{first}]}}").service.cpu_affinity == [first]
    text = format_cpulist(allowed)
    assert parse_config(f"service: {{cpu_affinity: '{text}'}}").service.cpu_affinity == allowed


def test_a_cpu_that_does_not_exist_is_refused_naming_it() -> None:
    missing = max(online_cpus()) + 1
    with pytest.raises(ConfigError, match=(
            rf"service\.cpu_affinity: CPU\(s\) {missing} do not exist or are offline.*"
            rf"this process may use {format_cpulist(os.sched_getaffinity(0))}")):
        parse_config(f"service: {{cpu_affinity: [0, {missing}]}}")
    with pytest.raises(ConfigError, match=r"service\.cpu_affinity: 'x'"):
        parse_config("service: {cpu_affinity: 'x'}")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two allowed CPUs")
def test_config_check_refuses_cpus_outside_the_allowed_set(tmp_path: Path) -> None:
    """`ctxmem config check` run under a narrower mask (as taskset would start it): the CPU
    it may not use is refused, naming it and the allowed set."""
    first, second = sorted(os.sched_getaffinity(0))[:2]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"service": {"cpu_affinity": [first, second],
                                                "insecure": True}}))
    code = (f"import os, sys; os.sched_setaffinity(0, {{{first}}}); "
            "from ctxmem_common.configcheck import config_command; "
            "sys.exit(config_command(['check', '--quiet', sys.argv[1]]))")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert (f"service.cpu_affinity: CPU(s) {second} are not in this process's allowed set "
            f"{first} ") in r.stderr
    ok = subprocess.run([sys.executable, "-m", "ctxmem_common.cli", "config", "check",
                         "--quiet", str(path)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr


def test_client_copy_threads_default_follows_the_cpus_it_may_run_on() -> None:
    """An engine pinned to one core gets one copy thread (nothing is connected: the
    Client connects on first use). sched_setaffinity(0) changes this thread only."""
    import ctxmem

    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        assert ctxmem.Client("127.0.0.1:1").copy_threads == 1
    finally:
        os.sched_setaffinity(0, before)
    assert ctxmem.Client("127.0.0.1:1").copy_threads == min(2, len(before))
