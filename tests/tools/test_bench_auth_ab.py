"""``--auth-ab`` of ``ctxmem bench`` and ``ctxmem bench pod`` (bench/auth_ab.py): each
selected row measured with block authenticators on and off, on real service processes,
the "off" arm through the benchmark harness (bench/authoff/sitecustomize.py) alone.

Checked here: both arms in the printout and the JSON; the "off" services (and only they)
logged the harness's WARNING, and at exit how many tags and checks they skipped (so the
off arm really ran the patched code); a run whose "off" arm did not load the harness, or
whose "on" arm did, fails instead of printing a ratio; the harness is inert unless its
variable is ``1``, and nothing without the harness on the path reads that variable."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import ctxmem_common
from ctxmem_common.codecs.blockauth import TAG_BYTES, BlockAuthenticator
from ctxmem_tools.bench import auth_ab, datapath, pod
from ctxmem_tools.bench.authoff.sitecustomize import ENV, EXIT_LINE, PATCHED, WARNING


def _ab(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in doc["auth_ab"]}


def _check_ab_row(row: dict[str, Any], cpu: bool = True) -> None:
    assert row["on"] > 0 and row["off"] > 0, row
    assert row["ratio"] == pytest.approx(row["on"] / row["off"])
    assert row["limit"] > 0, row
    if cpu:
        assert row["service_cpu_s_per_gb_on"] is not None
        assert row["service_cpu_s_per_gb_off"] is not None
        assert row["service_cpu_s_per_gb_delta"] == pytest.approx(
            row["service_cpu_s_per_gb_on"] - row["service_cpu_s_per_gb_off"])


def test_bench_auth_ab_prints_both_arms_and_the_off_services_ran_off(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ab.json"
    work = tmp_path / "work"
    assert datapath.run(["--auth-ab", "--rounds", "2", "--batch-mib", "8", "--workdir",
                         str(work), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["params"]["auth_ab"] is True
    rows = _ab(doc)
    for crypt in ("_xts", ""):
        for size in ("2MiB", "64KiB"):
            for row in ("dram_put", "dram_get", "flash_demote", "flash_get"):
                _check_ab_row(rows[f"{row}_{size}{crypt}"])
    results = {r["name"]: r for r in doc["results"]}
    assert results["flash_get_2MiB_xts"]["value"] == rows["flash_get_2MiB_xts"]["on"]
    assert results["flash_get_2MiB_xts_authoff"]["value"] == rows["flash_get_2MiB_xts"]["off"]
    # Only the rows an authenticator could touch: no Lookup, verify or staged rows.
    assert not [n for n in results if n.startswith(("lookup_", "dram_put_staged"))
                or n.endswith("_verify")]
    printed = capsys.readouterr().out
    assert "block authenticators on vs off" in printed
    assert "flash_demote_2MiB_xts" in printed and "flash_get_64KiB_authoff" in printed
    # The "off" services logged the harness at start and their skipped work at exit; the
    # "on" ones neither.
    for tag in ("xts", "plain"):
        off = (work / tag / "off" / "service.log").read_text()
        on = (work / tag / "on" / "service.log").read_text()
        assert WARNING in off and "authenticators OFF" not in on
        counts = doc["auth_off_counts"][tag]
        assert counts == dict(zip(("tags", "verifies"), auth_ab.exit_counts(
            work / tag / "off" / "service.log") or (), strict=True))
        # Every demoted record would have had a tag, every promoted one a check.
        assert counts["tags"] > 0 and counts["verifies"] > 0, (tag, counts)


def test_bench_auth_ab_fails_when_an_arm_is_not_what_it_says(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An "off" arm without the harness (it would measure on against on), or an "on" arm
    with it: the run stops before measuring, naming the service and its log."""
    real = auth_ab.arm_env
    monkeypatch.setattr(auth_ab, "arm_env", lambda on: real(True))
    with pytest.raises(RuntimeError, match=r"should run with authenticators OFF.*"
                                           r"lacks 'authenticators OFF"):
        datapath.run(["--auth-ab", "--rounds", "1", "--batch-mib", "8", "--dram-only",
                      "--workdir", str(tmp_path / "a")])
    monkeypatch.setattr(auth_ab, "arm_env", lambda on: real(False))
    with pytest.raises(RuntimeError, match=r"should run with authenticators ON"):
        datapath.run(["--auth-ab", "--rounds", "1", "--batch-mib", "8", "--dram-only",
                      "--workdir", str(tmp_path / "b")])


def test_bench_auth_ab_refuses_a_peer_or_a_shared_device(tmp_path: Path) -> None:
    for argv in (["--peer", "lmcache"], ["--flash-device", str(tmp_path / "d.json")]):
        with pytest.raises(SystemExit) as ex:
            datapath.run(["--auth-ab", *argv, "--workdir", str(tmp_path)])
        assert ex.value.code == 2
    with pytest.raises(SystemExit) as ex:
        pod.run(["--auth-ab", "--peer", "mooncake", "--workdir", str(tmp_path)])
    assert ex.value.code == 2


def test_bench_pod_auth_ab_prints_both_arms_and_the_off_nodes_ran_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    kept: list[Path] = []
    # A short base (the nodes' Unix sockets live under it; pytest's tmp_path is too long).
    base = Path(tempfile.mkdtemp(prefix="ctxab-"))

    @contextmanager
    def keep(*_args: Any, **kwargs: Any) -> Iterator[str]:
        # The bench's temporary directories, kept until the test ends: the nodes' logs stay.
        d = Path(tempfile.mkdtemp(prefix=kwargs.get("prefix", "t"), dir=base))
        kept.append(d)
        yield str(d)

    monkeypatch.setattr(pod.tempfile, "TemporaryDirectory", keep)
    out = tmp_path / "pod.json"
    try:
        assert pod.run(["--auth-ab", "--total-mib", "4", "--repeat", "2", "--flash-blocks",
                        "8", "--workdir", str(tmp_path), "--json", str(out)]) == 0
        _check_pod_ab(json.loads(out.read_text()), capsys.readouterr().out, kept)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _check_pod_ab(doc: dict[str, Any], printed: str, kept: list[Path]) -> None:
    rows = _ab(doc)
    socket_gbs = doc["results"][0]["value"]
    for label in ("plaintext", "mTLS 1.3 between nodes"):
        for name in (f"cross-node get, peer fetch ({label})", f"local get, TCP ({label})"):
            _check_ab_row(rows[name])
            assert rows[name]["limit"] == socket_gbs
    flash = [n for n in rows if "shared flash" in n]
    assert flash, "no shared-flash rows"
    for name in flash:
        _check_ab_row(rows[name], cpu=False)
    assert not [r for r in doc["results"] if "Lookup" in r["name"]]
    assert "block authenticators on vs off" in printed
    assert "cross-node get, peer fetch (plaintext) [authenticators off]" in printed
    # Both nodes of each "off" pod ran the harness (the holder skipped its tags, the
    # fetching node its checks); no node of an "on" pod did.
    root = next(d for d in kept if d.name.startswith("ctxmem-bench-pod-"))
    for kind in ("plain", "tls"):
        for node in ("node1", "node2"):
            assert WARNING in (root / f"{kind}-off" / node / "service.log").read_text()
            assert "authenticators OFF" not in (
                root / f"{kind}-on" / node / "service.log").read_text()
        counts = doc["auth_off_counts"][kind]
        assert counts["tags"] > 0 and counts["verifies"] > 0, (kind, counts)


def _child(env: dict[str, str | None], harness: bool = True) -> subprocess.CompletedProcess[str]:
    """A Python process as a service would start (the harness first on its path or not,
    the variable as given) that makes a tag and checks it, right and wrong."""
    code = (
        "import sys\n"
        "from ctxmem_common.codecs.blockauth import BlockAuthenticator\n"
        "a = BlockAuthenticator.for_namespace(bytes(32), b'ns')\n"
        "t = a.tag(b'k', b'data')\n"
        "print(t.hex(), a.verify(b'k', b'data', t), a.verify(b'k', b'datA', t), "
        "'sitecustomize' in sys.modules)\n")
    shared = str(Path(ctxmem_common.__file__).resolve().parents[1])  # this tree's
    path = [shared, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    full = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(auth_ab.HARNESS_DIR), *path] if harness else path)}
    for k, v in env.items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full, timeout=60, check=True)


@pytest.mark.parametrize("value", [None, "0", "", "true", "yes"])
def test_the_harness_is_inert_unless_its_variable_is_1(value: str | None) -> None:
    done = _child({ENV: value})
    tag, right, wrong, loaded = done.stdout.split()
    assert loaded == "True"  # the harness's sitecustomize was imported...
    assert (right, wrong) == ("True", "False")  # ...and changed nothing
    assert bytes.fromhex(tag) != bytes(TAG_BYTES)
    assert "authenticators OFF" not in done.stderr


def test_the_variable_alone_does_nothing_in_a_normal_service_process() -> None:
    done = _child({ENV: "1"}, harness=False)
    tag, right, wrong, _ = done.stdout.split()
    assert (right, wrong) == ("True", "False")
    assert bytes.fromhex(tag) != bytes(TAG_BYTES)
    assert "authenticators OFF" not in done.stderr


def test_the_harness_with_its_variable_turns_authenticators_off_and_says_so() -> None:
    done = _child({ENV: "1"})
    tag, right, wrong, _ = done.stdout.split()
    assert bytes.fromhex(tag) == bytes(TAG_BYTES)
    assert (right, wrong) == ("True", "True")
    assert WARNING in done.stderr
    assert EXIT_LINE.format(tags=1, verifies=2) in done.stderr


def test_the_harness_replaces_every_method_that_makes_or_checks_a_tag() -> None:
    """A new way to make or check a tag (a batch method, say) would run for real in the
    "off" arm: the harness must learn it first."""
    methods = {name for name, v in vars(BlockAuthenticator).items()
               if isinstance(v, types.FunctionType) and not name.startswith("__")}
    assert methods - {"_mac"} == set(PATCHED)
