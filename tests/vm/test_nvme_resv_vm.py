"""NVMe persistent reservations fencing shared flash, for real (issue 26 item 1).

Inside the QEMU guest (tests/vm/run.sh):

- SPDK's NVMe-oF target (`spdk_tgt`, the session fixture `spdk_target`) exports one
  malloc namespace over NVMe/TCP on the guest's loopback; the guest's kernel initiator
  connects to it twice, as two hosts (two host NQNs and host ids: two controllers, one
  block device each; native multipath, which would merge both paths under one block
  device and send either node's I/O down either host's controller, is switched off for
  the test by reloading nvme_core with multipath=N, and switched back after);
- the reservation commands through the passthrough ioctl (ctxmem_dpu.storage.nvme_resv):
  register, acquire Write Exclusive - All Registrants, report (both hosts registered and
  holders), preempt-and-abort: the preempted host's O_DIRECT write fails with EBADE
  (Reservation Conflict) while the other's lands, and it writes again once registered;
- two pod nodes (BlockStores with their slab leases in a real redis-server in the guest,
  write-through) on the namespace, one per host: both register, both acknowledge durable
  puts; node b fences node a out exactly as its keeper does before taking a dead node's
  slab (FlashDevice.fence_out: preempt-and-abort a's key): node a's next durable put is
  refused (UNAVAILABLE naming the preemption), never acknowledged, and what it
  acknowledged before is still served, from its own DRAM and to node b from the device;
- kernel nvmet (the guest's 6.1 / 6.12 kernels; reservations came to nvmet in Linux 6.13):
  Identify Controller clears ONCS bit 5, so a shared device there is fenced by the slab
  epochs alone, and says so.

Run: CTXMEM_VM_PASSENV=PYTHONPATH bash tests/vm/run.sh .venv/bin/pytest -m vm \
    tests/vm/test_nvme_resv_vm.py
"""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import subprocess
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from ctxmem_common.errors import Unavailable
from ctxmem_dpu.pod.entries import RemoteEntry
from ctxmem_dpu.pod.shared_flash import SharedFlashSource
from ctxmem_dpu.storage import nvme_resv as nr
from ctxmem_dpu.storage import parse_device_spec
from ctxmem_dpu.storage.kernel import KernelBackend
from ctxmem_dpu.tiers.flash import FlashDevice
from ctxmem_dpu.tiers.flash_fence import SlabFence
from ctxmem_tools.redis_server import RedisServer
from tests import kit
from tests.dpu.pod import podkit
from tests.dpu.pod.podkit import MASTER, block_bytes, format_shared, node, session
from tests.dpu.storekit import get, put

IN_VM = os.environ.get("CTXMEM_VM") == "1"
RUN = ("CTXMEM_VM_PASSENV=PYTHONPATH bash tests/vm/run.sh .venv/bin/pytest -m vm "
       "tests/vm/test_nvme_resv_vm.py")
pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(not IN_VM, reason=f"needs the QEMU guest (spdk_tgt, the kernel NVMe/TCP "
                                         f"initiator, kernel nvmet); run: {RUN}"),
    pytest.mark.timeout(1200),
]

NQN = "nqn.2024-01.io.ctxmem:resv"
PORT = "4440"
ADDR = "127.0.0.1"
BDEV = "ResvMalloc0"
MIB = 1 << 20
SLAB = 8 * MIB
LEASE_S = 20.0  # the guest CPU is emulated (TCG): renewals of two in-process nodes
# stay in time (at 5 s the first put found its lease not renewed: the first run here)
KMOD = "/run/kmod"
MULTIPATH = Path("/sys/module/nvme_core/parameters/multipath")
T = TypeVar("T")


def wait_until(probe: Callable[[], T], timeout_s: float, what: str) -> T:
    """:func:`tests.kit.until`, polling every 0.2 s."""
    return kit.until(probe, timeout_s, what, 0.2)


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=120,
                          check=check)


def _reload_nvme_core(multipath: str) -> str:
    """Reload the kernel initiator with nvme_core's ``multipath`` set; "" or why not."""
    for mods in (["nvme-tcp", "nvme-rdma"], ["nvme-fabrics", "nvme-core"]):
        r = _run("modprobe", "-d", KMOD, "-r", *mods, check=False)
        if r.returncode:
            return f"modprobe -r {' '.join(mods)}: {r.stderr.strip()}"
    for args in (["nvme-core", f"multipath={multipath}"], ["nvme-tcp"], ["nvme-rdma"]):
        r = _run("modprobe", "-d", KMOD, *args, check=False)
        if r.returncode:
            return f"modprobe {' '.join(args)}: {r.stderr.strip()}"
    return ""


@pytest.fixture
def one_device_per_controller() -> Iterator[None]:
    """Native multipath off while the test runs (one block device per controller)."""
    if not MULTIPATH.exists() or MULTIPATH.read_text().strip() == "N":
        yield
        return
    busy = sorted(p.name for p in Path("/sys/class/nvme").glob("nvme*"))
    if busy:
        pytest.skip(f"native multipath is on (nvme_core.multipath=Y) and controllers "
                    f"{busy} are connected, so nvme_core cannot be reloaded with "
                    f"multipath=N; two hosts' controllers would share one block device")
    why = _reload_nvme_core("N")
    if why:
        _reload_nvme_core("Y")
        pytest.skip(f"cannot reload nvme_core with multipath=N: {why}")
    try:
        assert MULTIPATH.read_text().strip() == "N"
        yield
    finally:
        why = _reload_nvme_core("Y")
        assert not why, f"restoring nvme_core multipath=Y failed: {why}"


@pytest.fixture
def spdk_namespace(spdk_target: Any) -> Iterator[None]:
    """One 64 MiB malloc namespace exported over NVMe/TCP on 127.0.0.1:4440."""
    if not any(t.get("trtype", "").upper() == "TCP"
               for t in spdk_target.rpc("nvmf_get_transports")):
        spdk_target.rpc("nvmf_create_transport", {"trtype": "TCP"})
    spdk_target.rpc("bdev_malloc_create", {"name": BDEV, "num_blocks": 64 * MIB // 512,
                                           "block_size": 512})
    try:
        spdk_target.rpc("nvmf_create_subsystem", {"nqn": NQN, "allow_any_host": True,
                                                  "serial_number": "CTXRESV0001"})
        spdk_target.rpc("nvmf_subsystem_add_ns", {"nqn": NQN,
                                                  "namespace": {"bdev_name": BDEV}})
        spdk_target.rpc("nvmf_subsystem_add_listener", {
            "nqn": NQN, "listen_address": {"trtype": "tcp", "adrfam": "ipv4",
                                           "traddr": ADDR, "trsvcid": PORT}})
        yield
    finally:
        if any(s["nqn"] == NQN for s in spdk_target.rpc("nvmf_get_subsystems")):
            spdk_target.rpc("nvmf_delete_subsystem", {"nqn": NQN})
        spdk_target.rpc("bdev_malloc_delete", {"name": BDEV})


def _diag() -> str:
    """What the kernel says (a failed connect's reason is in its log)."""
    out = []
    for cmd in (["dmesg"], ["lsmod"]):
        r = _run(*cmd, check=False)
        lines = r.stdout.splitlines()
        out.append("\n".join(lines[-25:] if cmd == ["dmesg"] else
                             [ln for ln in lines if "nvme" in ln]))
    mp = MULTIPATH.read_text().strip() if MULTIPATH.exists() else "(no nvme_core)"
    return f"nvme_core.multipath={mp}\n" + "\n".join(out)


def _save_diag(name: str) -> str:
    text = _diag()
    out = os.environ.get("CTXMEM_VM_OUT")
    if out:
        Path(out, name).write_text(text)
    return text


def _connect(hostnqn: str, hostid: str) -> str:
    """Connect the kernel initiator to the SPDK namespace as host ``hostnqn``/``hostid``
    (the options string nvme-cli writes to /dev/nvme-fabrics); the controller's name."""
    opts = (f"nqn={NQN},transport=tcp,traddr={ADDR},trsvcid={PORT},hostnqn={hostnqn},"
            f"hostid={hostid},ctrl_loss_tmo=5")
    wait_until(lambda: os.path.exists("/dev/nvme-fabrics"), 30, "/dev/nvme-fabrics")
    fd = os.open("/dev/nvme-fabrics", os.O_RDWR)
    try:
        try:
            os.write(fd, opts.encode())
        except OSError as exc:
            raise AssertionError(f"connecting {opts}: {exc}\n{_save_diag('resv-connect.txt')}"
                                 ) from None
        reply = os.read(fd, 4096).decode().strip()  # "instance=N,cntlid=M"
    finally:
        os.close(fd)
    fields = dict(kv.split("=", 1) for kv in reply.split(",") if "=" in kv)
    assert "instance" in fields, f"/dev/nvme-fabrics answered {reply!r}"
    return f"nvme{fields['instance']}"


def _block_device(ctrl: str) -> str:
    names = sorted(p.name for p in Path("/sys/class/nvme", ctrl).glob(f"{ctrl}n*")
                   if Path("/dev", p.name).exists())
    return f"/dev/{names[0]}" if names else ""


@pytest.fixture
def two_hosts(one_device_per_controller: None, spdk_namespace: None
              ) -> Iterator[tuple[str, str]]:
    """The namespace connected twice, as host a and host b: (a's block device, b's)."""
    ctrls: list[str] = []
    _save_diag("resv-before-connect.txt")
    try:
        devs = []
        for _name in ("a", "b"):
            hostid = str(uuid.uuid4())
            ctrl = _connect(f"nqn.2014-08.org.nvmexpress:uuid:{hostid}", hostid)
            ctrls.append(ctrl)
            devs.append(wait_until(lambda c=ctrl: _block_device(c), 60,
                                   f"the block device of {ctrl}"))
        assert devs[0] != devs[1], f"both controllers share {devs[0]} (multipath merged them)"
        yield devs[0], devs[1]
    finally:
        for c in ctrls:
            try:
                Path("/sys/class/nvme", c, "delete_controller").write_text("1")
            except OSError as exc:
                print(f"disconnecting {c}: {exc}")


def _write_sector(path: str, offset: int, fill: int) -> None:
    buf = mmap.mmap(-1, 4096)
    buf.write(bytes([fill]) * 4096)
    fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    try:
        os.pwritev(fd, [buf], offset)
    finally:
        os.close(fd)
        buf.close()


def _zero(path: str, nbytes: int) -> None:
    zeros = mmap.mmap(-1, MIB)
    fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    try:
        for off in range(0, nbytes, MIB):
            os.pwritev(fd, [zeros], off)
        os.fsync(fd)
    finally:
        os.close(fd)
        zeros.close()


def test_register_acquire_report_and_preempt_on_spdk(two_hosts: tuple[str, str]) -> None:
    dev_a, dev_b = two_hosts
    with nr.NvmeReservation.open(dev_a, "a") as a, nr.NvmeReservation.open(dev_b, "b") as b:
        for r in (a, b):
            support = r.probe()
            assert support.ok, f"{r.device}: SPDK's target should offer reservations: " \
                               f"{support.reason}"
        try:
            a.register()
            a.acquire()
            st = a.report()
            assert st.rtype == nr.RESV_TYPE and st.registered_keys() == {a.key}, st
            b.register()
            b.acquire()  # All Registrants: every registrant holds it (a no-op success)
            st = b.report()
            assert st.rtype == nr.RESV_TYPE, st
            assert st.registered_keys() == {a.key, b.key}, st
            # Every registrant holds an All Registrants reservation; SPDK's Report marks
            # one of them (RCSTS bit 0), the first to acquire.
            assert [reg.holder for reg in st.registrants] == [True, False], st
            assert len({reg.hostid for reg in st.registrants}) == 2, st
            _write_sector(dev_a, 60 * MIB, 0xA1)  # both registered: both write
            _write_sector(dev_b, 60 * MIB, 0xB1)
            # b takes over from a: preempt and abort a's key.
            b.preempt(a.key, victim="a")
            assert b.report().registered_keys() == {b.key}
            with pytest.raises(OSError) as err:
                _write_sector(dev_a, 60 * MIB, 0xA2)
            assert err.value.errno == errno.EBADE, err.value  # Reservation Conflict
            _write_sector(dev_b, 60 * MIB, 0xB2)
            with pytest.raises(nr.ReservationConflict) as conflict:
                a.acquire()  # a's key is no longer registered
            assert "0x83 Reservation Conflict" in str(conflict.value), conflict.value
            # A restarted a registers again and writes again.
            a.register()
            _write_sector(dev_a, 60 * MIB, 0xA3)
        finally:
            for r in (a, b):
                try:
                    r.unregister()
                except OSError as exc:
                    print(f"unregister {r.device}: {exc}")
        st = a.report()
        assert st.registrants == () and st.rtype == 0, st  # the last one out released it


async def _step(aw: Awaitable[T], what: str, timeout_s: float = 180.0) -> T:
    """One step of the preempted-node test, bounded and named: a run in a loaded guest once
    hung in this test past pytest's timeout without saying where."""
    try:
        return await asyncio.wait_for(aw, timeout_s)
    except TimeoutError:
        raise AssertionError(f"{what} did not finish within {timeout_s:.0f} s") from None


async def test_a_preempted_node_refuses_durable_writes_on_spdk(
        two_hosts: tuple[str, str], tmp_path: Path, monkeypatch: Any) -> None:
    dev_a, dev_b = two_hosts
    format_shared(dev_a, SLAB, slabs=4)
    monkeypatch.setattr(podkit, "NODE_START_TIMEOUT_S", 300.0)
    with RedisServer(tmp_path / "redis") as redis:
        try:
            async with node(redis.url, "a", dev_a, SLAB, LEASE_S,
                            write_policy="write_through") as a, \
                    node(redis.url, "b", dev_b, SLAB, LEASE_S,
                         write_policy="write_through") as b:
                da, db = a.flash.devices[0], b.flash.devices[0]
                assert (da.fencing, db.fencing) == ("reservation", "reservation"), \
                    (da.resv_absent, db.resv_absent)
                assert da.resv is not None
                assert da.resv.report().registered_keys() == {nr.node_key("a"),
                                                              nr.node_key("b")}
                sa, nsa = session(a, 64)
                first = block_bytes(b"first", 64 << 10)
                assert await _step(put(a, sa, nsa, {b"first": first}), "a's first put") == 1
                sb, nsb = session(b, 64)
                b1 = {b"b1": block_bytes(b"b1", 64 << 10)}
                assert await _step(put(b, sb, nsb, b1), "b's first put") == 1
                blk = a.index[nsa.digest][b"first"]
                loc = a.shared_location(blk)
                assert loc is not None
                # Node b fences a out as its keeper does before taking a dead node's slab.
                done = db.fence_out("a")
                assert done.startswith("preempted and aborted node 'a'"), done
                with pytest.raises(Unavailable) as err:
                    await _step(put(a, sa, nsa, {b"second": block_bytes(b"second", 64 << 10)}),
                                "a's put after the preemption")
                text = str(err.value)
                assert "preempted" in text and "restart the service" in text, text
                assert b"second" not in a.index[nsa.digest], "a refused put was indexed"
                assert da.fencing == "preempted" and db.fencing == "reservation"
                assert da.healthy  # not a failed device: this node may not write it
                # b writes on; a's acknowledged block is still served, by a and from
                # the device to b.
                b2 = {b"b2": block_bytes(b"b2", 64 << 10)}
                assert await _step(put(b, sb, nsb, b2), "b's second put") == 1
                assert await _step(get(a, sa, nsa, [b"first"]), "a's get") == [first]
                entry = RemoteEntry("a", "flash", blk.seq, blk.length, blk.crc, loc)
                with SharedFlashSource([dev_b], MASTER, timeout_s=60.0) as src:
                    got = await _step(src.fetch(nsa.digest, [entry], [b"first"]), "b's device read")
                assert got[0] is not None and bytes(got[0]) == first
        finally:
            _zero(dev_a, MIB + 4 * SLAB)  # the next test finds no slab of ours


def _nvmet_backend() -> KernelBackend:
    env = os.environ
    spec = parse_device_spec(
        {"name": "resv-nvmet", "backend": "kernel",
         "kernel": {"transport": "tcp", "traddr": env["CTXMEM_NVMET_ADDR"],
                    "trsvcid": env["CTXMEM_NVMET_TCP_PORT"], "subnqn": env["CTXMEM_NVMET_NQN"],
                    "ctrl_loss_tmo": 5}}, "resv[nvmet]")
    return KernelBackend(spec, command_timeout_s=60)


def test_kernel_nvmet_has_no_reservations_so_the_epoch_alone_fences() -> None:
    kver = os.uname().release
    backend = _nvmet_backend()
    path = backend.attach(timeout_s=120.0)
    try:
        with nr.NvmeReservation.open(path, "a") as r:
            support = r.probe()
        assert not support.ok, f"kernel nvmet on {kver} offers reservations: update the docs"
        assert "ONCS" in support.reason and "bit 5 clear" in support.reason, support.reason
        format_shared(path, SLAB, slabs=2)
        try:
            with FlashDevice(0, "resv-nvmet", path, SLAB, True, True,
                             SlabFence("resv-nvmet", "a")) as dev:
                assert dev.fencing == "epoch_only" and dev.resv is None
                assert "ONCS" in dev.resv_absent
                assert dev.fence_out("b") == ""  # nothing to preempt: the epoch fences
        finally:
            _zero(path, MIB + 2 * SLAB)
    finally:
        backend.detach()
