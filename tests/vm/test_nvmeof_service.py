"""The REAL ctxmem service with its flash tier on a REAL NVMe-oF namespace.

Inside the QEMU guest (tests/vm/run.sh) the kernel's NVMe-oF target (nvmet) exports a
512 MiB namespace over RDMA (Soft-RoCE, port 4420) and TCP (port 4421). Each test starts
the service (`python -m ctxmem_dpu serve`, through `ctxmem_tools.launcher.ServiceProcess`) with
one flash device of backend `kernel`: the service runs `nvme connect` itself, opens the
namespace's block device with O_DIRECT, and the tests drive it through the shim only:

- put -> evict -> cold get, byte-compared (the block went to the remote namespace and
  came back: read, AES-XTS decrypt, CRC32C);
- restarts: a clean stop disconnects the controller and the next start connects again
  (exactly one controller each time) and rebuilds the index from the namespace; a
  killed service leaves the controller connected and the next start reuses it;
- the target disappears mid-run (`nvmet-ctl.sh disable`): gets of flash-only blocks
  become misses within a bound, DRAM-resident blocks are still served, Health answers
  `degraded: ...`, puts still work; after `nvmet-ctl.sh enable` the controller
  reconnects (ctrl_loss_tmo -1), the service marks the device healthy again and serves
  the flash blocks again.

Every wait is bounded. The guest CPU is emulated (TCG), so the times written to
$CTXMEM_VM_OUT/nvmeof_service_timings.jsonl are observations, never performance figures.

Run: bash tests/vm/run.sh .venv/bin/pytest -m vm tests/vm/test_nvmeof_service.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

import ctxmem
from ctxmem.client import TransportName
from ctxmem_tools.launcher import ServiceProcess, local_config
from tests import kit

IN_VM = os.environ.get("CTXMEM_VM") == "1"
RUN = "bash tests/vm/run.sh .venv/bin/pytest -m vm tests/vm/test_nvmeof_service.py"

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(not IN_VM, reason=f"needs the QEMU guest with kernel nvmet and "
                                         f"Soft-RoCE; run: {RUN}"),
    pytest.mark.timeout(1200),
]

# Bounds, not timings: the guest is emulated and the machine is shared.
START_TIMEOUT_S = 300.0  # Python start-up alone is ~7 s in the guest; plus nvme connect
STOP_TIMEOUT_S = 120.0  # flush, close, nvme disconnect
CTL_TIMEOUT_S = 60.0
OUTAGE_BOUND_S = 90.0  # a get of a flash-only block is a miss within this after the loss
RECOVERY_BOUND_S = 180.0  # flash blocks are served again within this after the target is back
# What the service is configured with (and what the bounds above allow for).
FAST_IO_FAIL_TMO = 2
RECONNECT_DELAY = 1

DEVICE = "nvmf0"
LAYOUT = kit.model_layout(num_layers=4)  # 32 KiB blocks
# The shim's data path (host <-> service), unrelated to NVMe-oF's: both get exercised.
SHIM_TRANSPORT: dict[str, TransportName] = {"rdma": "shm", "tcp": "tcp"}

T = TypeVar("T")


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is not set: is this the ctxmem test guest (tests/vm/run.sh)?")
    return value


# -- the target and the initiator, seen through sysfs ------------------------------------


def controllers(transport: str) -> list[str]:
    """Controllers of the test subsystem over `transport`, from /sys/class/nvme."""
    nqn = _env("CTXMEM_NVMET_NQN")
    found = []
    for ctrl in sorted(Path("/sys/class/nvme").glob("nvme*")):
        try:
            if ((ctrl / "subsysnqn").read_text().strip() == nqn
                    and (ctrl / "transport").read_text().strip() == transport):
                found.append(ctrl.name)
        except OSError:
            continue  # a controller going away
    return found


def ctrl_attr(ctrl: str, attr: str) -> str:
    try:
        return (Path("/sys/class/nvme") / ctrl / attr).read_text().strip()
    except OSError:
        return ""


def nvmet_ctl(*args: str) -> None:
    subprocess.run(["bash", _env("CTXMEM_NVMET_CTL"), *args], check=True, capture_output=True,
                   text=True, timeout=CTL_TIMEOUT_S)


def disconnect_leftovers() -> None:
    """Drop any controller of the test subsystem a failed test may have left."""
    nqn = _env("CTXMEM_NVMET_NQN")
    if not controllers("rdma") + controllers("tcp"):
        return
    subprocess.run(["nvme", "disconnect", "-n", nqn], capture_output=True, text=True,
                   timeout=CTL_TIMEOUT_S, check=False)
    wait_until(lambda: not controllers("rdma") + controllers("tcp"), 60.0,
               "the test subsystem's controllers to go away after nvme disconnect")


def wait_until(probe: Callable[[], T], timeout_s: float, what: str,
               interval_s: float = 0.5) -> T:
    """Call `probe` until it returns something truthy; fail after `timeout_s`
    (:func:`tests.kit.until`, polling every `interval_s`)."""
    return kit.until(probe, timeout_s, what, interval_s)


def record(request: pytest.FixtureRequest, phase: str, seconds: float) -> None:
    """Append one observed duration to $CTXMEM_VM_OUT/nvmeof_service_timings.jsonl."""
    line = {"test": request.node.name, "phase": phase, "seconds": round(seconds, 3)}
    out = Path(os.environ.get("CTXMEM_VM_OUT", "/tmp"))
    with open(out / "nvmeof_service_timings.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


# -- fixtures ----------------------------------------------------------------------------


@pytest.fixture(params=["rdma", "tcp"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def device_entry(transport: str) -> dict[str, Any]:
    port = _env("CTXMEM_NVMET_RDMA_PORT" if transport == "rdma" else "CTXMEM_NVMET_TCP_PORT")
    return {"name": DEVICE, "backend": "kernel",
            "kernel": {"transport": transport, "traddr": _env("CTXMEM_NVMET_ADDR"),
                       "trsvcid": port, "subnqn": _env("CTXMEM_NVMET_NQN"),
                       "ctrl_loss_tmo": -1, "reconnect_delay": RECONNECT_DELAY,
                       "fast_io_fail_tmo": FAST_IO_FAIL_TMO}}


@pytest.fixture
def service(transport: str, request: pytest.FixtureRequest) -> Iterator[ServiceProcess]:
    """The real service, flash = the guest's NVMe-oF namespace over `transport`."""
    assert not controllers("rdma") + controllers("tcp"), "a previous test left a controller"
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)
    # Config, key file and the shm socket on tmpfs (a Unix socket cannot live on 9p).
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"ctxmem-{name}-{uuid.uuid4().hex[:8]}"
    cfg = local_config(workdir, flash_size=None, dram_size="32MiB", dram_slab="4MiB",
                       flash_slab="16MiB", transports=["shm", "tcp"])
    cfg["flash"]["devices"] = [device_entry(transport)]
    cfg["flash"]["o_direct"] = True
    svc = ServiceProcess(workdir, cfg, start=False)
    t0 = time.monotonic()
    try:
        svc.start(timeout_s=START_TIMEOUT_S)
        record(request, "first start (nvme connect, format or rebuild)", time.monotonic() - t0)
        yield svc
    finally:
        try:
            svc.stop(STOP_TIMEOUT_S)
        finally:
            out = Path(os.environ.get("CTXMEM_VM_OUT", "/tmp")) / "nvmeof-service"
            out.mkdir(parents=True, exist_ok=True)
            if svc.log_path.exists():
                shutil.copy(svc.log_path, out / f"{name}.log")
            try:
                nvmet_ctl("enable", "all")
                nvmet_ctl("ns-enable")
            finally:
                disconnect_leftovers()


# -- helpers -----------------------------------------------------------------------------


def make_blocks(n: int, tag: str) -> tuple[list[bytes], list[bytearray]]:
    """`n` unique keys and random payloads (keys never repeat across tests or runs)."""
    keys = kit.keys(f"{uuid.uuid4().hex}:{tag}", n)
    return keys, [bytearray(os.urandom(LAYOUT.block_nbytes)) for _ in range(n)]


def get(ns: ctxmem.Namespace, keys: list[bytes]) -> tuple[int, list[bytearray]]:
    out = [bytearray(LAYOUT.block_nbytes) for _ in keys]
    return ns.get(keys, out), out


def client(svc: ServiceProcess, transport: str) -> ctxmem.Client:
    return ctxmem.Client(svc.endpoint, transport=SHIM_TRANSPORT[transport])


def open_ns(c: ctxmem.Client, model_id: str) -> ctxmem.Namespace:
    return c.open_namespace(LAYOUT, model_id=model_id)


def service_fds_on(svc: ServiceProcess, dev_prefix: str) -> list[str]:
    """Device nodes under `dev_prefix` that the service process holds open."""
    assert svc.proc is not None
    found = []
    for fd in Path(f"/proc/{svc.proc.pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(dev_prefix):
            found.append(target)
    return found


def restart(svc: ServiceProcess, request: pytest.FixtureRequest, kill: bool) -> None:
    t0 = time.monotonic()
    if kill:
        svc.kill()
    else:
        svc.stop(STOP_TIMEOUT_S)
    record(request, "kill" if kill else "clean stop (flush, nvme disconnect)",
           time.monotonic() - t0)


def start(svc: ServiceProcess, request: pytest.FixtureRequest, what: str) -> None:
    t0 = time.monotonic()
    svc.start(timeout_s=START_TIMEOUT_S)
    record(request, what, time.monotonic() - t0)


# -- tests -------------------------------------------------------------------------------


def test_put_evict_cold_get_round_trip(service: ServiceProcess, transport: str,
                                       request: pytest.FixtureRequest) -> None:
    ctrls = controllers(transport)
    assert len(ctrls) == 1, ctrls
    ctrl = ctrls[0]
    assert ctrl_attr(ctrl, "state") == "live"
    # The backend applied the timeouts (fast_io_fail_tmo through sysfs).
    assert ctrl_attr(ctrl, "fast_io_fail_tmo") == str(FAST_IO_FAIL_TMO)
    assert ctrl_attr(ctrl, "ctrl_loss_tmo") == "off"
    assert ctrl_attr(ctrl, "reconnect_delay") == str(RECONNECT_DELAY)
    # The flash tier is the remote namespace: the service holds /dev/nvme* open.
    assert service_fds_on(service, "/dev/nvme"), "service has no NVMe block device open"
    with client(service, transport) as c:
        ns = open_ns(c, f"roundtrip-{uuid.uuid4().hex}")
        keys, data = make_blocks(16, "a")
        assert ns.put(keys, data) == ctxmem.PutResult(stored=16, existing=0)
        t0 = time.monotonic()
        assert ns.evict(keys) == 16
        record(request, "evict 16 blocks (demote + fdatasync over NVMe-oF)",
               time.monotonic() - t0)
        assert ns.lookup(keys) == ctxmem.LookupResult(16, ["flash"] * 16)
        t0 = time.monotonic()
        n, out = get(ns, keys)
        record(request, "cold get 16 blocks (read + decrypt + CRC)", time.monotonic() - t0)
        assert n == 16
        assert out == data, "bytes read back from the NVMe-oF namespace differ"
        st = c.stats()
        assert st["hits_flash"] == 16 and st["integrity_failures"] == 0, st
        assert st["flash_read_errors"] == 0 and st["flash_write_errors"] == 0, st
        assert st["flash_capacity_bytes"] >= 256 << 20, st  # the 512 MiB namespace
        assert c.health().status == "serving"


def test_restart_reattaches_and_serves_from_flash(service: ServiceProcess, transport: str,
                                                  request: pytest.FixtureRequest) -> None:
    model = f"restart-{uuid.uuid4().hex}"
    keys, data = make_blocks(12, "durable")
    with client(service, transport) as c:
        ns = open_ns(c, model)
        assert ns.put(keys, data).stored == 12
        assert ns.evict(keys) == 12  # durable on the namespace

    # Clean restart: stop detaches (nvme disconnect), start connects again.
    restart(service, request, kill=False)
    assert controllers(transport) == [], "a clean stop must disconnect the controller"
    start(service, request, "start after clean stop (connect + rebuild)")
    ctrls = controllers(transport)
    assert len(ctrls) == 1, f"exactly one controller after re-attach, got {ctrls}"
    more_keys, more = make_blocks(4, "after-restart")
    with client(service, transport) as c:
        ns = open_ns(c, model)
        assert c.stats()["recovered_blocks"] >= 12  # index rebuilt from the device
        assert ns.lookup(keys) == ctxmem.LookupResult(12, ["flash"] * 12)
        n, out = get(ns, keys)
        assert n == 12 and out == data, "data not served from flash after a clean restart"
        assert ns.put(more_keys, more).stored == 4
        assert ns.evict(more_keys) == 4

    # Killed service: the controller stays connected, and the next start reuses it.
    restart(service, request, kill=True)
    assert controllers(transport) == ctrls, "the controller should survive a killed service"
    start(service, request, "start after kill (reuse controller + rebuild)")
    assert controllers(transport) == ctrls, "the backend must reuse the connected controller"
    with client(service, transport) as c:
        ns = open_ns(c, model)
        assert ns.lookup(keys + more_keys).tiers == ["flash"] * 16
        n, out = get(ns, keys + more_keys)
        assert n == 16 and out == data + more, "data not served from flash after a kill"
        assert c.stats()["integrity_failures"] == 0


def test_target_outage_degrades_to_misses_and_recovers(
        service: ServiceProcess, transport: str, request: pytest.FixtureRequest) -> None:
    ctrl = controllers(transport)[0]
    with client(service, transport) as c:
        ns = open_ns(c, f"outage-{uuid.uuid4().hex}")
        cold_keys, cold = make_blocks(8, "cold")
        hot_keys, hot = make_blocks(4, "hot")
        assert ns.put(cold_keys, cold).stored == 8
        assert ns.evict(cold_keys) == 8
        assert ns.put(hot_keys, hot).stored == 4
        # Let write-back settle so the outage does not land in the middle of a demotion.
        wait_until(lambda: c.stats()["dirty_blocks"] == 0, 60.0, "write-back to settle")
        assert ns.lookup(cold_keys).tiers == ["flash"] * 8
        assert ns.lookup(hot_keys).tiers == ["dram"] * 4

        # The target goes away.
        t_loss = time.monotonic()
        nvmet_ctl("disable", "all")
        state = wait_until(lambda: (s := ctrl_attr(ctrl, "state")) != "live" and s, 60.0,
                           f"controller {ctrl} to notice the target is gone")
        record(request, f"controller leaves live (now {state})", time.monotonic() - t_loss)

        t0 = time.monotonic()
        n, _ = get(ns, cold_keys)
        first_miss_s = time.monotonic() - t0
        record(request, "first get of flash-only blocks during the outage (miss)",
               first_miss_s)
        assert n == 0, "flash-only blocks cannot be served while the target is gone"
        assert first_miss_s < OUTAGE_BOUND_S
        status = c.health().status
        assert status.startswith("degraded") and DEVICE in status, status
        t0 = time.monotonic()
        assert get(ns, cold_keys)[0] == 0  # the device is marked failed: immediate miss
        record(request, "second get during the outage (device marked failed)",
               time.monotonic() - t0)
        n, out = get(ns, hot_keys)
        assert n == 4 and out == hot, "DRAM-resident blocks must still be served"
        new_keys, new = make_blocks(4, "during-outage")
        assert ns.put(new_keys, new).stored == 4  # puts still land in DRAM
        n, out = get(ns, new_keys)
        assert n == 4 and out == new
        # The flash blocks stay indexed: they come back with the target.
        assert ns.lookup(cold_keys) == ctxmem.LookupResult(8, ["flash"] * 8)
        assert c.stats()["flash_device_failures"] >= 1

        # The target comes back: the controller reconnects (ctrl_loss_tmo -1), the
        # service's probe finds the device healthy, and flash blocks are served again.
        t_back = time.monotonic()
        nvmet_ctl("enable", "all")

        def served_again() -> bool:
            if c.health().status != "serving":
                return False
            n, out = get(ns, cold_keys)
            return n == 8 and out == cold

        wait_until(served_again, RECOVERY_BOUND_S, "flash blocks to be served again",
                   interval_s=1.0)
        record(request, "target back -> flash blocks served again", time.monotonic() - t_back)
        assert controllers(transport) == [ctrl] and ctrl_attr(ctrl, "state") == "live"
        # Blocks put during the outage reach flash once it is back.
        assert ns.evict(new_keys) == 4
        assert ns.lookup(new_keys).tiers == ["flash"] * 4
        n, out = get(ns, new_keys)
        assert n == 4 and out == new
        st = c.stats()
        assert st["integrity_failures"] == 0, st


def _block_device_of(svc: ServiceProcess) -> str:
    held = service_fds_on(svc, "/dev/nvme")
    assert len(held) == 1, f"expected the service to hold one NVMe block device, got {held}"
    return held[0]


@pytest.mark.parametrize("transport", ["tcp"])
def test_namespace_removed_degrades_then_recovers_in_place(
        service: ServiceProcess, transport: str, request: pytest.FixtureRequest) -> None:
    """`nvmet-ctl.sh ns-disable` takes the namespace itself away: the controller stays
    live, the host removes the block device, and `ns-enable` brings the namespace back
    under a NEW node (/dev/nvme0n2: the old one is still held open by the service).

    Degradation works as with a lost target. Recovery needs no restart: the probe of
    the old, dead descriptor fails, the service asks the backend where the device is now
    (its attach() finds the new node), checks the superblock there is this device's,
    reopens it and serves the flash blocks again (docs/nvmeof.md). A restart afterwards
    finds the device at its new node too.
    """
    old_node = _block_device_of(service)
    with client(service, transport) as c:
        ns = open_ns(c, f"ns-removal-{uuid.uuid4().hex}")
        cold_keys, cold = make_blocks(8, "cold")
        hot_keys, hot = make_blocks(4, "hot")
        assert ns.put(cold_keys, cold).stored == 8
        assert ns.evict(cold_keys) == 8
        assert ns.put(hot_keys, hot).stored == 4
        wait_until(lambda: c.stats()["dirty_blocks"] == 0, 60.0, "write-back to settle")

        t_loss = time.monotonic()
        nvmet_ctl("ns-disable")
        wait_until(lambda: not os.path.exists(old_node), 60.0,
                   f"the host to remove {old_node} after ns-disable")
        record(request, "namespace node removed on the host", time.monotonic() - t_loss)
        t0 = time.monotonic()
        assert get(ns, cold_keys)[0] == 0
        record(request, "first get during namespace removal (miss)", time.monotonic() - t0)
        status = c.health().status
        assert status.startswith("degraded") and DEVICE in status, status
        n, out = get(ns, hot_keys)
        assert n == 4 and out == hot
        new_keys, new = make_blocks(2, "during-removal")
        assert ns.put(new_keys, new).stored == 2
        assert ns.lookup(cold_keys).tiers == ["flash"] * 8

        nvmet_ctl("ns-enable")
        wait_until(lambda: [d for d in Path("/dev").glob("nvme*n*") if str(d) != old_node],
                   60.0, "the namespace to come back on the host")

        def served_again() -> bool:
            n, out = get(ns, cold_keys)
            return n == 8 and out == cold

        t_back = time.monotonic()
        wait_until(served_again, 30.0, "flash blocks to be served again in place",
                   interval_s=1.0)
        record(request, "namespace back -> flash blocks served in place",
               time.monotonic() - t_back)
        assert c.health().status == "serving"
        st = c.stats()
        assert st["flash_device_reopened"] == 1 and st["integrity_failures"] == 0, st
        # The service now does I/O on the new node; the dead one stays open (retired, not
        # closed: an I/O thread might still have been blocked on it) until it stops.
        held = service_fds_on(service, "/dev/nvme")
        live = [h for h in held if not h.endswith("(deleted)")]
        assert len(live) == 1 and live[0] != old_node, held
        # Blocks put during the removal reach the device at its new node.
        assert ns.evict(new_keys) == 2
        n, out = get(ns, new_keys)
        assert n == 2 and out == new

    # A restart finds the device at its new node as well.
    restart(service, request, kill=False)
    start(service, request, "start after namespace came back")
    assert os.path.exists(_block_device_of(service))
    with client(service, transport) as c:
        ns = open_ns(c, ns.model_id)
        n, out = get(ns, cold_keys)
        assert n == 8 and out == cold, "flash blocks not served after the restart"
        assert c.health().status == "serving"
