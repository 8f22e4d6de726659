"""`kernel` backend against a REAL Linux NVMe-oF target (kernel nvmet) in the QEMU guest.

Runs only inside the guest built by tests/vm/run.sh, which loads nvmet, nvmet-rdma,
nvmet-tcp, nvme-rdma, nvme-tcp and rdma_rxe (Soft-RoCE), exports one subsystem on an
RDMA port and a TCP port, and sets:

    CTXMEM_VM=1  CTXMEM_NVMET_NQN  CTXMEM_NVMET_ADDR
    CTXMEM_NVMET_RDMA_PORT (4420)  CTXMEM_NVMET_TCP_PORT (4421)

Each test uses the real nvme-cli and sysfs: connect, 1 MiB O_DIRECT write/read/compare,
idempotent second attach (same path, one controller), disconnect.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ctxmem_dpu.storage import parse_device_spec
from ctxmem_dpu.storage.kernel import KernelBackend

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(
        os.environ.get("CTXMEM_VM") != "1",
        reason="needs the QEMU guest with kernel nvmet and Soft-RoCE; run: "
        "bash tests/vm/run.sh .venv/bin/pytest -m vm tests",
    ),
]

ATTACH_TIMEOUT_S = 60.0  # the guest runs under TCG emulation: slow, never time it
MIB = 1 << 20


def _env(name: str, default: str | None = None) -> str:
    value = os.environ.get(name, default)
    assert value, f"{name} is not set; tests/vm/run.sh must export it inside the guest"
    return value


def make_backend(transport: str) -> KernelBackend:
    port = _env("CTXMEM_NVMET_RDMA_PORT", "4420") if transport == "rdma" else _env(
        "CTXMEM_NVMET_TCP_PORT", "4421")
    spec = parse_device_spec(
        {"name": f"vm-{transport}", "backend": "kernel",
         "kernel": {"transport": transport, "traddr": _env("CTXMEM_NVMET_ADDR"),
                    "trsvcid": port, "subnqn": _env("CTXMEM_NVMET_NQN"), "ctrl_loss_tmo": 5}},
        f"vm[{transport}]")
    return KernelBackend(spec, command_timeout_s=60)


def controllers_for(transport: str) -> list[str]:
    """Controllers in /sys/class/nvme for the test subsystem over `transport`."""
    nqn = _env("CTXMEM_NVMET_NQN")
    found = []
    for ctrl in sorted(Path("/sys/class/nvme").glob("nvme*")):
        try:
            if ((ctrl / "subsysnqn").read_text().strip() == nqn
                    and (ctrl / "transport").read_text().strip() == transport):
                found.append(ctrl.name)
        except OSError:
            continue  # controller going away
    return found


@pytest.fixture(params=["tcp", "rdma"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def device(transport: str) -> Iterator[KernelBackend]:
    dev = make_backend(transport)
    try:
        yield dev
    finally:
        dev.detach()


def test_attach_write_read_detach(device: KernelBackend, transport: str) -> None:
    path = device.attach(timeout_s=ATTACH_TIMEOUT_S)
    assert path.startswith("/dev/nvme") and device.is_healthy()
    assert device.size_bytes >= MIB
    out, back = mmap.mmap(-1, MIB), mmap.mmap(-1, MIB)  # page aligned for O_DIRECT
    out.write(os.urandom(MIB))
    offset = device.size_bytes - MIB  # the last MiB: the whole namespace is addressable
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        assert os.pwritev(fd, [out], offset) == MIB
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)  # a fresh descriptor for the read
    try:
        assert os.preadv(fd, [back], offset) == MIB
    finally:
        os.close(fd)
    assert back[:] == out[:], f"data read back over {transport} differs from data written"
    device.detach()
    assert controllers_for(transport) == [] and not device.is_healthy()


def test_attach_twice_is_idempotent(device: KernelBackend, transport: str) -> None:
    path = device.attach(timeout_s=ATTACH_TIMEOUT_S)
    assert device.attach(timeout_s=ATTACH_TIMEOUT_S) == path
    restarted = make_backend(transport)  # a second service instance / a restart
    assert restarted.attach(timeout_s=ATTACH_TIMEOUT_S) == path
    assert len(controllers_for(transport)) == 1, controllers_for(transport)
    restarted.detach()
    assert controllers_for(transport) == []
    device.detach()  # idempotent: already gone
