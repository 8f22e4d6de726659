"""Smoke tests of the QEMU guest: real Soft-RoCE (rxe0) and a real kernel NVMe-oF target.

They check the harness itself (tests/vm/run.sh) before any ctxmem code relies on it:
pyverbs sees and opens rxe0, an RC queue pair pair moves bytes with RDMA WRITE and READ,
and the kernel initiator reaches the guest's nvmet target over TCP and RDMA with an
O_DIRECT round trip. Outside the guest every test here is skipped.

Run: ``bash tests/vm/run.sh .venv/bin/pytest -m vm tests``
"""

from __future__ import annotations

import ipaddress
import mmap
import os
import random
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import kit

IN_VM = os.environ.get("CTXMEM_VM") == "1"

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(
        not IN_VM,
        reason="needs the QEMU guest (Soft-RoCE, nvmet): "
        "run `bash tests/vm/run.sh .venv/bin/pytest -m vm tests`",
    ),
]

IB_PORT = 1
POLL_TIMEOUT_S = 30.0  # the guest is emulated (TCG): generous, never a timing
MIB = 1 << 20


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is not set: is this the ctxmem test guest (tests/vm/run.sh)?")
    return value


# --------------------------------------------------------------------------------------
# RDMA (pyverbs on rxe0)
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def verbs() -> Any:
    return pytest.importorskip(
        "pyverbs.device", reason="pyverbs not installed: deploy/ci/pyverbs-wheel.sh"
    )


@pytest.fixture()
def ctx(verbs: Any) -> Iterator[Any]:
    context = verbs.Context(name=_env("CTXMEM_RDMA_DEV"))
    yield context
    context.close()


def _gid_index(ctx: Any, ip: str) -> int:
    """Index of the RoCE v2 GID that carries `ip` (an IPv4-mapped IPv6 address)."""
    from pyverbs.pyverbs_error import PyverbsError

    want = ipaddress.IPv4Address(ip)
    port_attr = ctx.query_port(IB_PORT)
    for idx in range(port_attr.gid_tbl_len):
        try:
            gid = ctx.query_gid(IB_PORT, idx)
        except PyverbsError:
            continue
        if ipaddress.IPv6Address(gid.gid).ipv4_mapped == want:
            return idx
    raise AssertionError(f"no GID for {ip} on port {IB_PORT}")


def test_rxe_device_listed(verbs: Any) -> None:
    dev = _env("CTXMEM_RDMA_DEV")
    names = [
        d.name.decode() if isinstance(d.name, bytes) else d.name for d in verbs.get_device_list()
    ]
    assert dev in names, f"{dev} not in {names}"


def test_port_active_and_gid(ctx: Any) -> None:
    from pyverbs.libibverbs_enums import ibv_port_state

    port_attr = ctx.query_port(IB_PORT)
    assert port_attr.state == ibv_port_state.IBV_PORT_ACTIVE
    idx = _gid_index(ctx, _env("CTXMEM_RDMA_IP"))
    gid = ctx.query_gid(IB_PORT, idx)
    assert str(ipaddress.IPv6Address(gid.gid).ipv4_mapped) == _env("CTXMEM_RDMA_IP")


class _RCEnd:
    """One side of an RC connection: a QP, its own CQ and a registered buffer."""

    def __init__(self, ctx: Any, pd: Any, size: int) -> None:
        from pyverbs.cq import CQ
        from pyverbs.libibverbs_enums import ibv_access_flags as acc
        from pyverbs.libibverbs_enums import ibv_qp_type
        from pyverbs.mr import MR
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        self.access = (
            acc.IBV_ACCESS_LOCAL_WRITE | acc.IBV_ACCESS_REMOTE_WRITE | acc.IBV_ACCESS_REMOTE_READ
        )
        self.cq = CQ(ctx, 16)
        self.mr = MR(pd, size, self.access)
        cap = QPCap(max_send_wr=8, max_recv_wr=8, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(
            qp_type=ibv_qp_type.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=1
        )
        attr = QPAttr(port_num=IB_PORT)
        attr.qp_access_flags = self.access
        self.qp = QP(pd, init, attr)  # RESET -> INIT
        self.rq_psn = random.getrandbits(24)

    def connect(self, ctx: Any, peer: _RCEnd, gid_index: int) -> None:
        """INIT -> RTR -> RTS towards `peer` (attributes exchanged in-process)."""
        from pyverbs.addr import AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        port_attr = ctx.query_port(IB_PORT)
        attr = QPAttr(port_num=IB_PORT)
        attr.path_mtu = port_attr.active_mtu
        attr.qp_access_flags = self.access
        attr.dest_qp_num = peer.qp.qp_num
        attr.rq_psn = self.rq_psn
        attr.sq_psn = peer.rq_psn
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        # RoCE needs a GRH; the peer is on the same device, so its GID is ours.
        gr = GlobalRoute(dgid=ctx.query_gid(IB_PORT, gid_index), sgid_index=gid_index)
        attr.ah_attr = AHAttr(port_num=IB_PORT, is_global=1, gr=gr, dlid=port_attr.lid)
        self.qp.to_rts(attr)

    def rdma(self, opcode: Any, peer: _RCEnd, length: int) -> None:
        """Post one RDMA op between our MR and `peer`'s MR and wait for its completion."""
        from pyverbs.libibverbs_enums import ibv_wc_status
        from pyverbs.wr import SGE, SendWR

        wr = SendWR(
            wr_id=opcode, opcode=opcode, num_sge=1, sg=[SGE(self.mr.buf, length, self.mr.lkey)]
        )
        wr.set_wr_rdma(peer.mr.rkey, peer.mr.buf)
        self.qp.post_send(wr)
        def completions() -> Any:
            n, wcs = self.cq.poll()
            return wcs if n else None
        wcs = kit.until(completions, POLL_TIMEOUT_S, f"the completion of RDMA op {opcode}",
                        0.001)
        assert wcs[0].status == ibv_wc_status.IBV_WC_SUCCESS, (
            f"completion status {wcs[0].status}"
        )

    def close(self) -> None:
        self.qp.close()
        self.mr.close()
        self.cq.close()


def test_rc_loopback_rdma_write_read(ctx: Any) -> None:
    from pyverbs.libibverbs_enums import ibv_wr_opcode
    from pyverbs.pd import PD

    size = 256 * 1024  # several MTU-sized packets, one message
    gid_index = _gid_index(ctx, _env("CTXMEM_RDMA_IP"))
    pd = PD(ctx)
    a, b = _RCEnd(ctx, pd, size), _RCEnd(ctx, pd, size)
    try:
        a.connect(ctx, b, gid_index)
        b.connect(ctx, a, gid_index)

        # WRITE: a's buffer lands in b's.
        payload = os.urandom(size)
        a.mr.write(payload, size)
        b.mr.write(bytes(size), size)
        a.rdma(ibv_wr_opcode.IBV_WR_RDMA_WRITE, b, size)
        assert b.mr.read(size, 0) == payload

        # READ: b's (new) buffer comes back into a's.
        payload2 = os.urandom(size)
        b.mr.write(payload2, size)
        a.mr.write(bytes(size), size)
        a.rdma(ibv_wr_opcode.IBV_WR_RDMA_READ, b, size)
        assert a.mr.read(size, 0) == payload2
    finally:
        a.close()
        b.close()
        pd.close()


# --------------------------------------------------------------------------------------
# NVMe-oF (kernel initiator -> kernel nvmet target in the same guest)
# --------------------------------------------------------------------------------------

_NS_NAME = re.compile(r"nvme\d+n\d+$")


def _run(*cmd: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=timeout)


def _namespaces(nqn: str) -> list[Path]:
    """Block devices of subsystem `nqn`, found through sysfs (multipath on or off)."""
    found: set[str] = set()
    for cls in ("nvme-subsystem", "nvme"):
        for d in Path("/sys/class", cls).glob("*"):
            try:
                if (d / "subsysnqn").read_text().strip() != nqn:
                    continue
            except OSError:
                continue
            found.update(c.name for c in d.iterdir() if _NS_NAME.match(c.name))
    return sorted(Path("/dev", n) for n in found)


def _disconnect(nqn: str, check: bool = False) -> None:
    """`nvme disconnect -n NQN`, then wait until its block devices are gone."""
    r = subprocess.run(
        ["nvme", "disconnect", "-n", nqn], capture_output=True, text=True, timeout=120
    )
    if check:
        assert r.returncode == 0, f"nvme disconnect failed: {r.stderr}"
    kit.read_until(lambda: _namespaces(nqn), lambda left: not left, 30, 0.2)
    if check:
        assert not _namespaces(nqn), f"{nqn} still has namespaces after nvme disconnect"


@pytest.fixture()
def nvmet() -> Iterator[dict[str, str]]:
    if not Path("/sys/kernel/config/nvmet").is_dir():
        pytest.fail("no nvmet configfs: is this the ctxmem test guest (tests/vm/run.sh)?")
    t = {
        "nqn": _env("CTXMEM_NVMET_NQN"),
        "addr": _env("CTXMEM_NVMET_ADDR"),
        "rdma": _env("CTXMEM_NVMET_RDMA_PORT"),
        "tcp": _env("CTXMEM_NVMET_TCP_PORT"),
    }
    assert not _namespaces(t["nqn"]), "a previous test left the subsystem connected"
    yield t
    _disconnect(t["nqn"])


def _connect(t: dict[str, str], transport: str) -> Path:
    _run("nvme", "connect", "-t", transport, "-a", t["addr"], "-s", t[transport], "-n", t["nqn"])
    devs = kit.until(lambda: [d for d in _namespaces(t["nqn"]) if d.exists()], 60,
                     f"a namespace of {t['nqn']} after nvme connect -t {transport}", 0.2)
    return devs[0]


def _aligned(data: bytes) -> mmap.mmap:
    buf = mmap.mmap(-1, len(data))  # page-aligned, as O_DIRECT wants
    buf[:] = data
    return buf


def _direct_write(dev: Path, offset: int, data: bytes) -> None:
    buf = _aligned(data)
    fd = os.open(dev, os.O_RDWR | os.O_DIRECT)
    try:
        assert os.pwritev(fd, [buf], offset) == len(data)
    finally:
        os.close(fd)
        buf.close()


def _direct_read(dev: Path, offset: int, length: int) -> bytes:
    buf = mmap.mmap(-1, length)
    fd = os.open(dev, os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.preadv(fd, [buf], offset) == length
        return bytes(buf)
    finally:
        os.close(fd)
        buf.close()


@pytest.mark.parametrize("transport", ["tcp", "rdma"])
def test_nvmeof_direct_io_round_trip(nvmet: dict[str, str], transport: str) -> None:
    dev = _connect(nvmet, transport)
    offset = (4 if transport == "rdma" else 2) * MIB
    payload = os.urandom(MIB)
    _direct_write(dev, offset, payload)
    assert _direct_read(dev, offset, MIB) == payload
    _disconnect(nvmet["nqn"], check=True)


def test_nvmeof_both_transports_reach_one_namespace(nvmet: dict[str, str]) -> None:
    payload = os.urandom(MIB)
    dev = _connect(nvmet, "tcp")
    _direct_write(dev, 8 * MIB, payload)
    _disconnect(nvmet["nqn"], check=True)
    dev = _connect(nvmet, "rdma")
    assert _direct_read(dev, 8 * MIB, MIB) == payload


def _discovered(t: dict[str, str], transport: str) -> bool:
    """Whether the port's discovery log lists the subsystem. A port left with no
    subsystem stops listening (connection refused): that counts as not listed."""
    r = subprocess.run(
        ["nvme", "discover", "-t", transport, "-a", t["addr"], "-s", t[transport]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return r.returncode == 0 and t["nqn"] in r.stdout


def test_nvmet_ctl_disable_enable(nvmet: dict[str, str]) -> None:
    ctl = _env("CTXMEM_NVMET_CTL")
    assert _discovered(nvmet, "tcp")
    try:
        _run("bash", ctl, "disable", "tcp")
        assert not _discovered(nvmet, "tcp")
        assert _discovered(nvmet, "rdma")  # only the TCP port lost it
        _run("bash", ctl, "enable", "tcp")
        assert _discovered(nvmet, "tcp")
    finally:
        _run("bash", ctl, "enable", "all")
