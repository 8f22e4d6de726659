"""The REAL service in DPU mode: its flash tier on SPDK-terminated NVMe-oF.

Inside the QEMU guest (tests/vm/run.sh) a real `spdk_tgt` (built from source by
deploy/ci/spdk-build.sh; the session fixture `spdk_target`) is the DPU's storage stack.
The service's flash device has backend `spdk`: it attaches the guest's kernel NVMe-oF
target (nvmet, a separate process, as a remote flash enclosure is) with
`bdev_nvme_attach_controller` over RDMA (Soft-RoCE) or TCP, optionally stacks SPDK's
AES-XTS crypto bdev on the namespace, and opens the bdev through nbd (every kernel) or
ublk (the backports 6.12 kernel). The tests drive the service through the shim only:

- put -> evict -> cold get, byte-exact; a clean restart (SPDK objects detached, then
  attached again, index rebuilt) and a killed one (the controller survives and is
  reused) serve the same bytes from flash;
- the namespace holds no plaintext payload either way: with the crypto bdev the service
  does not encrypt again (header: device-encrypted) and SPDK's ciphertext is on the
  namespace; without it the service encrypts in software (header: encrypted);
- target outage: flash-only gets become misses, DRAM is still served, Health degrades;
  SPDK reconnects (ctrlr_loss_timeout_sec -1, reconnect_delay_sec 1,
  fast_io_fail_timeout_sec 2) and flash is served again when the target returns;
- `spdk.export`: SPDK serves the device to a peer over NVMe/TCP; the peer (the guest's
  kernel initiator) reads the same bytes the service wrote.

Every wait is bounded; the guest is emulated (TCG), so no timing here is a performance
figure. Run: bash tests/vm/run.sh .venv/bin/pytest -m vm tests/vm/test_spdk_service.py
"""

from __future__ import annotations

import mmap
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
from ctxmem_common.flash_format import OWNER_OFFSET, PROBE_OFFSET, SECTOR, RecordHeader
from ctxmem_tools.launcher import ServiceProcess, local_config
from tests import kit

IN_VM = os.environ.get("CTXMEM_VM") == "1"
RUN = "bash tests/vm/run.sh .venv/bin/pytest -m vm tests/vm/test_spdk_service.py"
pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(not IN_VM, reason=f"needs the QEMU guest (kernel nvmet, Soft-RoCE, "
                                         f"nbd/ublk) and SPDK built from source; run: {RUN}"),
    pytest.mark.timeout(1200),
]

START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 120.0
OUTAGE_BOUND_S = 90.0
RECOVERY_BOUND_S = 180.0
DEVICE = "spdk0"
BDEV = "Nvmf0"
EXPORT_NQN = "nqn.2024-01.io.ctxmem:spdk-export"
EXPORT_PORT = "4430"
MIB = 1 << 20
SCAN_BYTES = 128 * MIB  # the first slabs: where a fresh device's records land
LAYOUT = kit.model_layout(num_layers=4)  # 32 KiB blocks
T = TypeVar("T")


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is not set: is this the ctxmem test guest (tests/vm/run.sh)?")
    return value


def wait_until(probe: Callable[[], T], timeout_s: float, what: str,
               interval_s: float = 0.5) -> T:
    """Call `probe` until it returns something truthy; fail after `timeout_s`
    (:func:`tests.kit.until`, polling every `interval_s`)."""
    return kit.until(probe, timeout_s, what, interval_s)


def nvmet_ctl(*args: str) -> None:
    subprocess.run(["bash", _env("CTXMEM_NVMET_CTL"), *args], check=True, capture_output=True,
                   text=True, timeout=60)


def device_entry(socket: str, transport: str, expose: str, crypto_key: Path | None,
                 export: bool) -> dict[str, Any]:
    port = _env("CTXMEM_NVMET_RDMA_PORT" if transport == "rdma" else "CTXMEM_NVMET_TCP_PORT")
    spdk: dict[str, Any] = {
        "rpc_socket": socket, "bdev_name": BDEV, "trtype": transport,
        "traddr": _env("CTXMEM_NVMET_ADDR"), "trsvcid": port, "subnqn": _env("CTXMEM_NVMET_NQN"),
        "expose": expose, "ctrlr_loss_timeout_sec": -1, "reconnect_delay_sec": 1,
        "fast_io_fail_timeout_sec": 2}
    if crypto_key is not None:
        spdk["crypto"] = {"enabled": True, "key_name": "ctxmem_spdk0",
                          "key_file": str(crypto_key)}
    if export:
        spdk["export"] = {"nqn": EXPORT_NQN, "trtype": "tcp", "traddr": _env("CTXMEM_NVMET_ADDR"),
                          "trsvcid": EXPORT_PORT, "allow_any_host": True}
    return {"name": DEVICE, "backend": "spdk", "spdk": spdk}


def our_controllers(spdk: Any) -> list[dict[str, Any]]:
    return [c for c in spdk.rpc("bdev_nvme_get_controllers") if c.get("name") == BDEV]


@pytest.fixture
def make_service(spdk_target: Any, request: pytest.FixtureRequest
                 ) -> Iterator[Callable[..., ServiceProcess]]:
    started: list[ServiceProcess] = []
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)

    def make(transport: str, expose: str = "nbd", crypto: bool = False,
             export: bool = False) -> ServiceProcess:
        if expose == "ublk" and not os.path.exists("/dev/ublk-control"):
            msg = (f"kernel {os.uname().release} has no ublk (Debian 12's 6.1): runs in "
                   "the backports-kernel boot (CTXMEM_VM_KERNEL=backports)")
            if os.environ.get("CTXMEM_SPDK_REQUIRE_UBLK") == "1":
                pytest.fail(msg)
            pytest.skip(msg)
        workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"ctxmem-{name}-{uuid.uuid4().hex[:8]}"
        cfg = local_config(workdir, flash_size=None, dram_size="32MiB", dram_slab="4MiB",
                           flash_slab="16MiB", transports=["shm", "tcp"])
        key = None
        if crypto:
            key = workdir / "spdk-xts.key"
            key.write_text(os.urandom(64).hex())
            key.chmod(0o600)
        cfg["flash"]["devices"] = [device_entry(spdk_target.socket, transport, expose, key,
                                                export)]
        cfg["flash"]["o_direct"] = True
        cfg["mode"] = "dpu"  # reported by Health; SPDK is this "DPU"'s storage stack
        svc = ServiceProcess(workdir, cfg, start=False)
        started.append(svc)
        svc.start(timeout_s=START_TIMEOUT_S)
        return svc

    try:
        yield make
    finally:
        out = Path(os.environ.get("CTXMEM_VM_OUT", "/tmp")) / "spdk-service"
        out.mkdir(parents=True, exist_ok=True)
        for svc in started:
            try:
                svc.stop(STOP_TIMEOUT_S)
            finally:
                if svc.log_path.exists():
                    shutil.copy(svc.log_path, out / f"{name}.log")
        nvmet_ctl("enable", "all")
        # A failed test may leave SPDK objects behind: the next test starts clean.
        for disk in spdk_target.rpc("nbd_get_disks"):
            spdk_target.rpc("nbd_stop_disk", {"nbd_device": disk["nbd_device"]})
        if os.path.exists("/dev/ublk-control"):
            for disk in spdk_target.rpc("ublk_get_disks"):
                spdk_target.rpc("ublk_stop_disk", {"ublk_id": disk["id"]})
        for sub in spdk_target.rpc("nvmf_get_subsystems"):
            if sub["nqn"] == EXPORT_NQN:
                spdk_target.rpc("nvmf_delete_subsystem", {"nqn": EXPORT_NQN})
        for bdev in spdk_target.rpc("bdev_get_bdevs"):
            if bdev["name"].endswith("_crypto"):
                spdk_target.rpc("bdev_crypto_delete", {"name": bdev["name"]})
        if our_controllers(spdk_target):
            spdk_target.rpc("bdev_nvme_detach_controller", {"name": BDEV})


def make_blocks(n: int, tag: str) -> tuple[list[bytes], list[bytearray]]:
    keys = kit.keys(f"{uuid.uuid4().hex}:{tag}", n)
    return keys, [bytearray(os.urandom(LAYOUT.block_nbytes)) for _ in range(n)]


def get(ns: ctxmem.Namespace, keys: list[bytes]) -> tuple[int, list[bytearray]]:
    out = [bytearray(LAYOUT.block_nbytes) for _ in keys]
    return ns.get(keys, out), out


def held_device(svc: ServiceProcess) -> str:
    """The nbd/ublk block device the service holds open (its flash tier)."""
    assert svc.proc is not None
    held = set()
    for fd in Path(f"/proc/{svc.proc.pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(("/dev/nbd", "/dev/ublkb")):
            held.add(target)
    assert len(held) == 1, f"expected one nbd/ublk device open in the service, got {held}"
    return held.pop()


def read_start(path: str, nbytes: int) -> mmap.mmap:
    """The first `nbytes` of a file or block device (O_DIRECT for devices: no stale cache)."""
    buf = mmap.mmap(-1, nbytes)
    flags = os.O_RDONLY | (os.O_DIRECT if path.startswith("/dev/") else 0)
    fd = os.open(path, flags)
    try:
        got = os.preadv(fd, [buf], 0)
    finally:
        os.close(fd)
    assert got == nbytes, f"short read of {path}: {got} of {nbytes}"
    return buf


def header_of(view: mmap.mmap, key: bytes) -> RecordHeader:
    """The record header that carries `key`, found in a plaintext view of the device."""
    at = view.find(key)
    assert at >= 0, "record header not found in the device's first slabs"
    hdr = RecordHeader.unpack(view[at - at % SECTOR:at - at % SECTOR + SECTOR])
    assert hdr is not None and hdr.key == key
    return hdr


@pytest.mark.parametrize(("transport", "expose", "crypto"), [
    ("rdma", "nbd", True), ("tcp", "nbd", False), ("tcp", "ublk", True)])
def test_flash_on_spdk_round_trip_restart_no_plaintext(
        make_service: Callable[..., ServiceProcess], spdk_target: Any, transport: str,
        expose: str, crypto: bool) -> None:
    svc = make_service(transport, expose, crypto)
    assert "(dpu mode)" in svc.log(), svc.log()
    dev_path = held_device(svc)
    assert dev_path.startswith("/dev/ublkb" if expose == "ublk" else "/dev/nbd"), dev_path
    ctrls = our_controllers(spdk_target)
    assert len(ctrls) == 1 and ctrls[0]["ctrlrs"][0]["trid"]["trtype"].lower() == transport
    model = f"spdk-{uuid.uuid4().hex}"
    keys, data = make_blocks(16, "a")
    with ctxmem.Client(svc.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id=model)
        assert ns.put(keys, data).stored == 16
        assert ns.evict(keys) == 16
        assert ns.lookup(keys) == ctxmem.LookupResult(16, ["flash"] * 16)
        n, out = get(ns, keys)
        assert n == 16 and out == data, "bytes read back from flash on SPDK differ"
        st = c.stats()
        assert st["hits_flash"] == 16 and st["integrity_failures"] == 0, st
        assert st["flash_capacity_bytes"] >= 256 * MIB, st

    # Which layer encrypted, and what is on the namespace (nvmet's backing file).
    hdr = header_of(read_start(dev_path, SCAN_BYTES), keys[0])
    assert (hdr.device_encrypted, hdr.encrypted) == (crypto, not crypto), hdr
    raw = read_start(_env("CTXMEM_NVMET_BACKING"), SCAN_BYTES)
    for block in data[:4]:
        assert raw.find(bytes(block[:256])) < 0, "plaintext payload on the namespace"
    if crypto:  # the crypto bdev encrypted the headers as well
        assert raw.find(keys[0]) < 0

    # Clean restart: detach from SPDK, attach again, rebuild the index from flash.
    svc.stop(STOP_TIMEOUT_S)
    assert not our_controllers(spdk_target), "a clean stop must detach the controller"
    svc.start(timeout_s=START_TIMEOUT_S)
    with ctxmem.Client(svc.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id=model)
        assert c.stats()["recovered_blocks"] >= 16
        n, out = get(ns, keys)
        assert n == 16 and out == data, "not served from flash after a clean restart"
    # Killed: SPDK keeps the controller and the exposed disk; the next start reuses them.
    svc.kill()
    assert len(our_controllers(spdk_target)) == 1
    svc.start(timeout_s=START_TIMEOUT_S)
    assert len(our_controllers(spdk_target)) == 1, "the backend must reuse the controller"
    with ctxmem.Client(svc.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id=model)
        n, out = get(ns, keys)
        assert n == 16 and out == data, "not served from flash after a kill"
        assert c.stats()["integrity_failures"] == 0


def test_target_outage_misses_then_spdk_reconnects(
        make_service: Callable[..., ServiceProcess], spdk_target: Any) -> None:
    svc = make_service("tcp", crypto=True)
    with ctxmem.Client(svc.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id=f"outage-{uuid.uuid4().hex}")
        cold_keys, cold = make_blocks(8, "cold")
        hot_keys, hot = make_blocks(4, "hot")
        assert ns.put(cold_keys, cold).stored == 8
        assert ns.evict(cold_keys) == 8
        assert ns.put(hot_keys, hot).stored == 4
        wait_until(lambda: c.stats()["dirty_blocks"] == 0, 60.0, "write-back to settle")

        nvmet_ctl("disable", "all")  # the remote flash goes away
        t0 = time.monotonic()
        n, _ = get(ns, cold_keys)
        assert n == 0, "flash-only blocks cannot be served while the target is gone"
        assert time.monotonic() - t0 < OUTAGE_BOUND_S
        wait_until(lambda: c.health().status.startswith("degraded"), OUTAGE_BOUND_S,
                   "Health to report the device degraded")
        assert DEVICE in c.health().status
        n, out = get(ns, hot_keys)
        assert n == 4 and out == hot, "DRAM-resident blocks must still be served"
        assert ns.lookup(cold_keys).tiers == ["flash"] * 8  # still indexed
        assert c.stats()["flash_device_failures"] >= 1
        assert len(our_controllers(spdk_target)) == 1  # ctrlr_loss_timeout_sec -1: kept

        nvmet_ctl("enable", "all")

        def served_again() -> bool:
            if c.health().status != "serving":
                return False
            n, out = get(ns, cold_keys)
            return n == 8 and out == cold

        wait_until(served_again, RECOVERY_BOUND_S, "flash blocks to be served again",
                   interval_s=1.0)
        assert c.stats()["integrity_failures"] == 0


def test_export_serves_the_device_to_a_peer(
        make_service: Callable[..., ServiceProcess], spdk_target: Any) -> None:
    svc = make_service("tcp", crypto=True, export=True)
    with ctxmem.Client(svc.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id=f"export-{uuid.uuid4().hex}")
        keys, data = make_blocks(8, "x")
        assert ns.put(keys, data).stored == 8
        assert ns.evict(keys) == 8
    subs = {s["nqn"]: s for s in spdk_target.rpc("nvmf_get_subsystems")}
    assert [n["bdev_name"] for n in subs[EXPORT_NQN]["namespaces"]] == [f"{BDEV}n1_crypto"]
    # The peer: the guest's kernel NVMe/TCP initiator, as another node would connect.
    subprocess.run(["nvme", "connect", "-t", "tcp", "-a", _env("CTXMEM_NVMET_ADDR"),
                    "-s", EXPORT_PORT, "-n", EXPORT_NQN], check=True, capture_output=True,
                   text=True, timeout=60)
    try:
        def peer_node() -> str:
            # Native multipath (Debian's default) puts the namespace under the subsystem,
            # without it under the controller.
            for parent in [*Path("/sys/class/nvme-subsystem").glob("nvme-subsys*"),
                           *Path("/sys/class/nvme").glob("nvme*")]:
                try:
                    if (parent / "subsysnqn").read_text().strip() != EXPORT_NQN:
                        continue
                except OSError:
                    continue  # going away
                nodes = sorted(p.name for p in parent.glob("nvme*n*")
                               if Path("/dev", p.name).exists())
                if nodes:
                    return f"/dev/{nodes[0]}"
            return ""

        node = wait_until(peer_node, 60.0, "the peer's block device for the export")
        # What the peer reads is what the service's own device holds: records included.
        # Except the sectors the live service rewrites while it runs: the owner sector
        # (each owner-lease refresh) and the health probe's before it. The two reads
        # below are a moment apart and can straddle a refresh (CI saw byte 12,324, in the
        # owner sector, differ); everything else in the scan is still once the blocks are
        # durable, so that is compared, byte for byte.
        mine = read_start(held_device(svc), SCAN_BYTES)
        theirs = read_start(node, SCAN_BYTES)
        live_lo, live_hi = PROBE_OFFSET, OWNER_OFFSET + SECTOR
        assert theirs[:live_lo] == mine[:live_lo], \
            "the peer reads another superblock than the service wrote"
        assert theirs[live_hi:] == mine[live_hi:], \
            "the peer reads other bytes than the service wrote"
        assert header_of(theirs, keys[0]).device_encrypted
    finally:
        subprocess.run(["nvme", "disconnect", "-n", EXPORT_NQN], capture_output=True,
                       text=True, timeout=60, check=False)
