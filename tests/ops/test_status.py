"""`ctxmem status` against a real service (issue 18, item 2): the JSON document parsed,
the rich screen rendered to text, `--watch` bounded, rates between refreshes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

import ctxmem
from ctxmem_dpu.status.command import status_command
from ctxmem_dpu.status.render import render_text, status_renderable
from ctxmem_dpu.status.scrape import scrape, status_document
from tests.conftest import ServiceHandle
from tests.kit import model_layout, until

LAYOUT = model_layout(dtype="float16")
N = 8


def _traffic(svc: ServiceHandle) -> ctxmem.Client:
    """Tenant "alpha" puts N blocks and reads them back; "beta" puts 2; one miss. Returns
    the client with its two sessions still open (closing it ends them)."""
    rng = np.random.default_rng(7)
    c = ctxmem.Client(svc.endpoint)
    for tenant, n in (("alpha", N), ("beta", 2)):
        ns = c.open_namespace(LAYOUT, model_id="m", tenant=tenant)
        keys = [f"{tenant}-{i}".encode() for i in range(n)]
        data = [rng.integers(0, 255, LAYOUT.block_nbytes, dtype=np.uint8) for _ in keys]
        ns.put(keys, data)
        out = [np.empty(LAYOUT.block_nbytes, np.uint8) for _ in keys]
        assert ns.get(keys, out) == n
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
        assert ns.get([b"never-stored"], [np.empty(LAYOUT.block_nbytes, np.uint8)]) == 0
    return c


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = status_command(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def busy(service_factory: Callable[..., ServiceHandle]) -> Iterator[ServiceHandle]:
    svc = service_factory(quotas={"tenants": {"beta": {"dram_max": 0.5}}})
    client = _traffic(svc)  # its sessions stay open: both tenants active
    yield svc
    client.close()


def test_status_json(busy: ServiceHandle) -> None:
    rc, out, err = _run(["--url", busy.metrics_listen, "--json"])
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["schema"] == 1
    assert doc["health"] == {"ready": True, "status": "serving"}
    block = LAYOUT.block_nbytes
    dram = doc["tiers"]["dram"]
    assert dram["blocks"] == N + 2
    assert dram["used_bytes"] >= (N + 2) * block
    assert dram["capacity_bytes"] == 128 << 20
    assert dram["occupancy"] == dram["used_bytes"] / dram["capacity_bytes"]
    # N + 2 hits from DRAM, 2 misses: hit rate 10/12.
    assert dram["hits"] == N + 2 and doc["misses"] == 2
    assert doc["hit_rate"] == pytest.approx((N + 2) / (N + 4))
    assert doc["rates"] == {"put_bytes_per_s": None, "get_bytes_per_s": None,
                            "demote_bytes_per_s": None}, "one sample: no rate yet"
    names = {t["name"]: t for t in doc["tenants"]}
    assert set(names) == {"alpha", "beta"}
    assert names["alpha"]["dram_bytes"] >= N * block
    assert names["alpha"]["dram_share"] > names["beta"]["dram_share"] > 0
    assert names["beta"]["dram_quota_bytes"] == (128 << 20) / 2
    assert names["alpha"]["dram_quota_bytes"] == 128 << 20
    # One session per tenant (the client is still open), no lease left open.
    assert doc["sessions"] == 2 and doc["leases"] == 0 and doc["allocations"] == 0
    assert doc["devices"] == [{"name": "flash0", "state": "healthy"}]
    assert doc["device_events"] == {"failed": 0, "recovered": 0, "reattached": 0}
    assert doc["integrity"]["integrity_failures"] == 0


def test_status_rates_between_refreshes(busy: ServiceHandle) -> None:
    first = scrape(f"http://{busy.metrics_listen}")
    _traffic_more(busy)
    second = scrape(f"http://{busy.metrics_listen}")
    doc = status_document(second, first)
    moved = 3 * LAYOUT.block_nbytes
    dt = second.at - first.at
    assert doc["interval_s"] == pytest.approx(dt)
    assert doc["rates"]["put_bytes_per_s"] == pytest.approx(moved / dt)
    assert doc["rates"]["get_bytes_per_s"] == 0


def _traffic_more(svc: ServiceHandle) -> None:
    with ctxmem.Client(svc.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id="m", tenant="gamma")
        ns.put([b"g0", b"g1", b"g2"], [np.ones(LAYOUT.block_nbytes, np.uint8)] * 3)


def test_status_screen(busy: ServiceHandle) -> None:
    doc = status_document(scrape(f"http://{busy.metrics_listen}"))
    text = render_text(doc, width=110)
    lines = text.splitlines()
    assert lines[0].startswith("ctxmem serving")
    row = next(ln for ln in lines if ln.strip("│ ").startswith("dram"))
    assert f"{N + 2}" in row.split("│")[5], row  # the blocks column
    assert "128.0 MiB" in row
    assert "83.3%" in next(ln for ln in lines if ln.strip("│ ").startswith("all"))
    tenants = [ln.split("│")[1].strip() for ln in lines if ln.count("│") >= 9]
    assert {"alpha", "beta"} <= set(tenants)
    assert any("flash0" in ln and "healthy" in ln for ln in lines)
    assert "device events: 0 failed, 0 recovered, 0 reattached" in text
    integ = lines[lines.index(next(ln for ln in lines if "failed checks" in ln)) + 2]
    assert integ.replace("│", " ").split()[-5:] == ["0"] * 5, integ


def test_status_watch_bounded(busy: ServiceHandle) -> None:
    rc, out, err = _run(["--url", busy.metrics_listen, "--json", "--watch", "--count", "3",
                         "--interval", "0.2"])
    assert rc == 0, err
    docs = [json.loads(ln) for ln in out.splitlines()]
    assert len(docs) == 3
    assert docs[0]["rates"]["put_bytes_per_s"] is None
    for d in docs[1:]:
        assert d["rates"]["put_bytes_per_s"] == 0.0  # nothing moved between refreshes
        assert d["interval_s"] >= 0.2
    rc, out, err = _run(["--url", busy.metrics_listen, "--watch", "--count", "2",
                         "--interval", "0.1", "--width", "100"])
    assert rc == 0, err
    assert out.count("ctxmem serving") == 2


def test_status_reads_config_and_says_when_down(busy: ServiceHandle) -> None:
    rc, out, _ = _run(["--config", str(busy.config_path), "--json"])
    assert rc == 0
    assert json.loads(out)["endpoint"] == f"http://{busy.metrics_listen}"
    busy.stop()
    rc, out, err = _run(["--url", busy.metrics_listen, "--timeout", "2"])
    assert rc == 1 and out == ""
    assert f"cannot read http://{busy.metrics_listen}/metrics" in err
    assert "is the service running" in err


def test_status_failed_then_recovered_device(service_factory: Callable[..., ServiceHandle]
                                             ) -> None:
    """A flash file cut short: the screen says degraded, the device failed, the read
    errors; made whole again, the device is back and counted as recovered."""
    svc = service_factory(write_policy="write_through")
    assert svc.flash_path is not None
    keys = [b"k%d" % i for i in range(4)]
    with ctxmem.Client(svc.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id="m", tenant="a")
        ns.put(keys, [np.full(LAYOUT.block_nbytes, i, np.uint8) for i in range(4)])
        ns.evict(keys)  # only on flash now
        size = svc.flash_path.stat().st_size
        os.truncate(svc.flash_path, 1 << 20)
        assert ns.get(keys, [np.empty(LAYOUT.block_nbytes, np.uint8) for _ in keys]) == 0
    rc, out, err = _run(["--url", svc.metrics_listen, "--json"])
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["health"] == {"ready": True, "status": "degraded: flash device flash0 failed"}
    assert doc["devices"] == [{"name": "flash0", "state": "failed"}]
    assert doc["device_events"]["failed"] == 1
    assert doc["integrity"]["flash_read_errors"] >= 1
    text = render_text(doc, width=100)
    assert text.startswith("ctxmem degraded: flash device flash0 failed")
    assert any("flash0" in ln and "failed" in ln for ln in text.splitlines())
    os.truncate(svc.flash_path, size)

    def recovered() -> dict[str, object] | None:
        doc = json.loads(_run(["--url", svc.metrics_listen, "--json"])[1])
        return doc if doc["devices"][0]["state"] == "healthy" else None

    # The service probes failed devices on its own schedule.
    doc = until(recovered, 30, "flash0 to be back (healthy)", 0.2)
    assert doc["devices"] == [{"name": "flash0", "state": "healthy"}]
    assert doc["device_events"] == {"failed": 1, "recovered": 1, "reattached": 0}
    assert doc["health"]["status"] == "serving"


def test_status_shows_how_a_shared_device_is_fenced(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod node on a shared flash file (no NVMe reservations: the slab epochs alone
    fence it) with a real redis-server: the status document and the screen say "shared:
    epoch only" (`ctxmem_flash_shared_fencing{mode}`). Its writes then fail as a
    Reservation Conflict does (the fault layer's `ebade`: another node preempted its key):
    the mode turns to "preempted", the health to degraded naming the device, in red."""
    from ctxmem_common.faultpoints import read_ack, write_control
    from ctxmem_tools.launcher import ServiceProcess, local_config
    from ctxmem_tools.pod_launcher import pod_section
    from ctxmem_tools.redis_server import RedisServer
    from tests.dpu.pod.podkit import format_shared

    shared = tmp_path / "shared0.img"
    format_shared(str(shared), 16 << 20, size=256 << 20)
    ctl = tmp_path / "faults.json"
    write_control(ctl, 0, points="", devices={})
    monkeypatch.setenv("CTXMEM_FAULT_CTL", str(ctl))  # the service's fault layer, idle
    with RedisServer(tmp_path / "redis") as redis:
        cfg = local_config(tmp_path / "node1", flash_path=str(shared), flash_slab="16MiB",
                           write_policy="write_through")
        cfg["flash"]["devices"][0].update(name="shared0", shared=True, create=False)
        cfg["pod"] = pod_section(redis.url, "node1", secrets.token_hex(16), slab_lease_s=2.0,
                                 shared_spare_slabs=1)
        svc = ServiceProcess(tmp_path / "node1", cfg)
        try:
            with ctxmem.Client(svc.endpoint) as c:
                ns = c.open_namespace(LAYOUT, model_id="m", tenant="a")
                ns.put([b"k0"], [np.zeros(LAYOUT.block_nbytes, np.uint8)])
                rc, out, err = _run(["--url", svc.metrics_listen, "--json"])
                assert rc == 0, err
                doc = json.loads(out)
                assert doc["devices"] == [{"name": "shared0", "state": "healthy",
                                           "fencing": "epoch_only"}]
                assert doc["health"]["status"] == "serving"
                row = next(ln for ln in render_text(doc, width=110).splitlines()
                           if "shared0" in ln)
                assert "healthy (shared: epoch only)" in row, row

                write_control(ctl, 1, devices={"shared0": {"write": "ebade"}})
                until(lambda: (read_ack(ctl) or {}).get("gen") == 1, 10,
                      "the service to arm the fault", 0.05)
                with pytest.raises(ctxmem.Unavailable, match="preempted"):
                    ns.put([b"k1"], [np.ones(LAYOUT.block_nbytes, np.uint8)])
            rc, out, err = _run(["--url", svc.metrics_listen, "--json"])
            assert rc == 0, err
            doc = json.loads(out)
            assert doc["devices"] == [{"name": "shared0", "state": "healthy",
                                       "fencing": "preempted"}]
            assert doc["health"]["status"] == (
                "degraded: flash device shared0: this node's reservation was preempted (it "
                "writes nothing more there; restart it)")
            text = render_text(doc, width=160)
            assert text.startswith("ctxmem degraded: flash device shared0: this node's "
                                   "reservation was preempted"), text
            row = next(ln for ln in text.splitlines() if ln.strip("│ ").startswith("shared0"))
            assert "healthy (shared: preempted)" in row, row
            # In colour the device's state is red (green while it may write).
            console = Console(record=True, width=160, force_terminal=True,
                              color_system="standard", file=io.StringIO())
            console.print(status_renderable(doc))
            coloured = next(ln for ln in console.export_text(styles=True).splitlines()
                            if "shared0" in ln and "preempted)" in ln)
            assert "\x1b[31m" in coloured and "\x1b[32m" not in coloured, repr(coloured)
        finally:
            svc.stop()
