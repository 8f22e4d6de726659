"""``ctxmem bench --flash-device``: the service's flash tier comes from a configured device
entry (in the guest, an ``spdk`` device: tests/vm/bench_spdk.sh); here a ``local`` one, so
the option's plumbing runs on every host run. The bench itself checks every byte it gets
back; this checks that the service really used the given device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ctxmem_tools.bench.datapath import run


def rows_of(doc: dict) -> dict[str, dict]:
    return {r["name"]: r for r in doc["results"]}


def test_bench_uses_the_configured_flash_device(tmp_path: Path) -> None:
    device = tmp_path / "dev.img"
    entry = {"name": "benchdev", "backend": "local", "path": str(device), "size": "1GiB",
             "create": True}
    (tmp_path / "dev.json").write_text(json.dumps(entry))
    out = tmp_path / "bench.json"
    assert run(["--quick", "--rounds", "1", "--batch-mib", "16", "--workdir",
                str(tmp_path / "work"), "--flash-device", str(tmp_path / "dev.json"),
                "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["params"]["flash_device"] == entry
    names = {r["name"] for r in doc["results"]}
    assert {"flash_get_2MiB_xts", "flash_demote_2MiB", "limit_odirect_read"} <= names
    # The memcpy limit is the best the machine offers: one thread or every CPU.
    lim = {r["name"]: r["value"] for r in doc["results"]}
    assert lim["limit_memcpy"] == max(lim["limit_memcpy_numpy"], lim["limit_memcpy_threads"]) > 0
    # The device limits are the better of one and two threads; every flash row is also
    # held against a probe of the device beside each of its rounds (*_paired).
    assert lim["limit_odirect_read"] == max(lim["limit_odirect_read_threads"],
                                            lim["limit_odirect_read"]) > 0
    for name in ("flash_get_2MiB_xts", "flash_demote_64KiB_xts", "flash_get_64KiB"):
        main, paired = rows_of(doc)[name], rows_of(doc)[f"{name}_paired"]
        assert paired["value"] == main["value"] > 0
        assert paired["limit"] > 0 and paired["fraction_of_limit"] > 0
        assert paired["service_cpu_s_per_gb"] == main["service_cpu_s_per_gb"]
    # The 10k Lookup: its target figure taken once the write-back demotion of the
    # blocks it finds is done; the calls made meanwhile reported apart, with no target.
    assert rows_of(doc)["lookup_10k_p99"]["limit"] == 2.0
    assert "lookup_10k_busy_p99" in rows_of(doc)
    busy = rows_of(doc)["lookup_10k_busy_p99"]
    assert busy["limit"] != busy["limit"]  # NaN: reported, no target
    # Each put row again against the two passes a verified put makes (fused copy + CRC,
    # then the service's CRC), measured in one process: same figure, that limit.
    rows = {r["name"]: r for r in doc["results"]}
    for size in ("2MiB", "64KiB"):
        put, again = rows[f"dram_put_{size}_xts"], rows[f"dram_put_{size}_xts_of_two_pass"]
        assert again["value"] == put["value"] > 0
        assert again["limit"] == max(lim["limit_put_two_pass"], lim["limit_put_two_pass_after"])
        assert again["fraction_of_limit"] == pytest.approx(put["value"] / again["limit"])
    # AES-XTS: the active implementation, and each one by name (both load here).
    assert lim["limit_aes_xts"] > 0 and doc["machine"]["aes_xts"]
    assert lim["limit_aes_xts_openssl"] > 0 and lim["limit_aes_xts_cryptography"] > 0
    # Every throughput of the data path carries the CPU per GB the service (its Stats) and
    # the bench process spent in that phase. A demotion may have run in the background
    # (write-back) before its evict, and the client only sends one Evict, so that phase
    # can cost next to nothing: >= 0 there, > 0 everywhere else.
    moved = [r for r in doc["results"] if r["unit"] == "GB/s" and not r["name"].startswith(
        "limit_")]
    assert moved
    for r in moved:
        cpu = (r["service_cpu_s_per_gb"], r["client_cpu_s_per_gb"])
        assert min(cpu) >= 0 if r["name"].startswith("flash_demote") else min(cpu) > 0, r
    assert device.stat().st_size == 1 << 30  # the service created and used it
    assert not (tmp_path / "work" / "xts" / "flash0.img").exists()  # not the default file


def test_bench_odirect_path_must_be_a_block_device(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as ex:
        run(["--odirect-path", str(tmp_path), "--workdir", str(tmp_path / "w")])
    assert ex.value.code == 2


def test_bench_dram_only_runs_the_dram_rows_without_a_flash_tier(tmp_path: Path) -> None:
    """``--dram-only``: an unencrypted service with no flash tier (nothing demoted in the
    background while puts are timed); the put, get and Lookup rows, no flash rows."""
    out = tmp_path / "bench.json"
    assert run(["--quick", "--rounds", "1", "--batch-mib", "8", "--dram-only", "--workdir",
                str(tmp_path / "work"), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["params"]["dram_only"] is True
    names = {r["name"] for r in doc["results"]}
    assert {"dram_put_2MiB", "dram_get_2MiB_verify", "dram_put_64KiB", "dram_get_64KiB",
            "lookup_10k_p99"} <= names
    # The staged put (issue 27 item 1) beside each put row, against the same memcpy limit
    # (and again against the two passes of a verified put).
    rows = rows_of(doc)
    for size in ("2MiB", "64KiB"):
        staged, put = rows[f"dram_put_staged_{size}"], rows[f"dram_put_{size}"]
        assert staged["value"] > 0 and staged["unit"] == "GB/s"
        assert staged["limit"] == put["limit"] > 0
        assert staged["service_cpu_s_per_gb"] is not None
        assert {f"dram_put_staged_{size}_p99", f"dram_put_staged_{size}_of_two_pass"} <= names
    assert not {n for n in names if n.startswith(("flash_", "dram_")) and "_xts" in n}
    assert not {n for n in names if n.startswith("flash_")}
    assert not (tmp_path / "work" / "plain" / "flash0.img").exists()


def test_bench_dram_only_refuses_a_flash_option(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        run(["--dram-only", "--peer", "lmcache", "--workdir", str(tmp_path)])
    assert exc.value.code == 2


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two allowed CPUs")
def test_bench_pins_the_service_and_itself(tmp_path: Path) -> None:
    """``--service-cpus`` / ``--client-cpus`` (run as a subprocess: it pins the process
    it runs in): the service gets cpu_affinity (its log says so), the bench pins itself
    and measures its limits there, and the header and JSON say both."""
    first, second = sorted(os.sched_getaffinity(0))[:2]
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, "-m", "ctxmem_common.cli", "bench", "--quick", "--rounds", "1",
         "--batch-mib", "8", "--dram-only", "--workdir", str(tmp_path / "work"),
         "--service-cpus", str(second), "--client-cpus", str(first), "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert (f"pinning: service CPUs {second}, client (this process) CPUs {first}; limits "
            f"measured on the client's CPUs {first} ") in r.stdout
    params = json.loads(out.read_text())["params"]
    assert (params["service_cpus"], params["client_cpus"], params["limit_cpus"]) == (
        [second], [first], [first])
    log = (tmp_path / "work" / "plain" / "service.log").read_text()
    assert f"pinned to CPUs {second} (service.cpu_affinity" in log


def test_bench_refuses_cpus_it_may_not_use(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        run(["--client-cpus", "4096", "--workdir", str(tmp_path)])
    assert exc.value.code == 2
