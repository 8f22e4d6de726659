"""`spdk` backend against a REAL SPDK application (spdk_tgt, or SNAP on a BlueField).

Skipped unless CTXMEM_SPDK_RPC_SOCKET names the RPC socket of a running SPDK. No SPDK
target can be installed on this project's machines (no registry reachable from them
packages one), so these tests have not run here; they exist for machines that have one.

The round-trip test is self-contained: the same SPDK serves as target (a malloc bdev
exported over NVMe/TCP on 127.0.0.1) and as initiator (ctxmem's backend attaches to it
and exposes it via nbd or ublk). It needs root and the nbd (or ublk_drv) kernel module.

    CTXMEM_SPDK_RPC_SOCKET=/var/tmp/spdk.sock   required
    CTXMEM_SPDK_EXPOSE=nbd|ublk                 default nbd
    CTXMEM_SPDK_NVMF_PORT=4420                  loopback target port
    CTXMEM_SPDK_CRYPTO=1                        also run through a crypto bdev
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ctxmem_dpu.storage import parse_device_spec
from ctxmem_dpu.storage.spdk import SpdkBackend
from ctxmem_dpu.storage.spdk_requests import SENDABLE_METHODS, RpcRequest
from ctxmem_dpu.storage.spdk_rpc import SpdkRpcChannel, SpdkRpcError

SOCKET = os.environ.get("CTXMEM_SPDK_RPC_SOCKET", "")
pytestmark = pytest.mark.skipif(
    not SOCKET,
    reason="needs a running SPDK target: set CTXMEM_SPDK_RPC_SOCKET to its RPC socket. No "
    "SPDK target is installable on this project's machines, so this runs only where one "
    "exists (a BlueField with SNAP, or a host with spdk_tgt built from source)",
)

TARGET_NQN = "nqn.2024-01.io.ctxmem:realtest"
MALLOC = "ctxmem_realtest_malloc"
MIB = 1 << 20
# Optional modules: SPDK may be built without them.
OPTIONAL = {"ublk_create_target", "ublk_start_disk", "ublk_stop_disk", "ublk_get_disks",
            "bdev_crypto_create", "bdev_crypto_delete"}


def rpc(method: str, params: dict[str, Any] | None = None) -> Any:
    """Test setup only (target side); ctxmem's own requests come from spdk_requests."""
    channel = SpdkRpcChannel(SOCKET, "realtest")
    try:
        return channel.call(RpcRequest(method, params or {}), 30)
    finally:
        channel.close()


def test_target_registers_every_method_ctxmem_sends() -> None:
    registered = set(rpc("rpc_get_methods", {"current": True}))
    missing = SENDABLE_METHODS - registered
    assert not missing - OPTIONAL, f"SPDK lacks methods ctxmem sends: {sorted(missing)}"


@pytest.fixture
def loopback_target() -> Iterator[str]:
    """A malloc bdev exported by the same SPDK over NVMe/TCP on 127.0.0.1."""
    port = os.environ.get("CTXMEM_SPDK_NVMF_PORT", "4420")
    rpc("bdev_malloc_create", {"name": MALLOC, "num_blocks": 16384, "block_size": 4096})
    try:
        if not any(t.get("trtype", "").lower() == "tcp" for t in rpc("nvmf_get_transports")):
            rpc("nvmf_create_transport", {"trtype": "tcp"})
        rpc("nvmf_create_subsystem", {"nqn": TARGET_NQN, "allow_any_host": True})
        rpc("nvmf_subsystem_add_ns", {"nqn": TARGET_NQN, "namespace": {"bdev_name": MALLOC}})
        rpc("nvmf_subsystem_add_listener", {"nqn": TARGET_NQN, "listen_address": {
            "trtype": "tcp", "adrfam": "ipv4", "traddr": "127.0.0.1", "trsvcid": port}})
        yield port
    finally:
        for method, params in (("nvmf_delete_subsystem", {"nqn": TARGET_NQN}),
                               ("bdev_malloc_delete", {"name": MALLOC})):
            with contextlib.suppress(SpdkRpcError):  # not created
                rpc(method, params)


@pytest.mark.parametrize("crypto", [False, True])
def test_loopback_round_trip(loopback_target: str, crypto: bool, tmp_path: Path) -> None:
    if crypto and os.environ.get("CTXMEM_SPDK_CRYPTO") != "1":
        pytest.skip("set CTXMEM_SPDK_CRYPTO=1 to test the crypto bdev (needs AES_XTS in an "
                    "accel module; SPDK's software module has it)")
    expose = os.environ.get("CTXMEM_SPDK_EXPOSE", "nbd")
    raw: dict[str, Any] = {"name": "realtest", "backend": "spdk", "spdk": {
        "rpc_socket": SOCKET, "bdev_name": "CtxmemRealtest", "trtype": "tcp",
        "traddr": "127.0.0.1", "trsvcid": loopback_target, "subnqn": TARGET_NQN,
        "expose": expose}}
    if crypto:
        key = tmp_path / "xts.key"
        key.write_text(os.urandom(64).hex())
        key.chmod(0o600)
        raw["spdk"]["crypto"] = {"enabled": True, "key_name": "ctxmem_realtest",
                                 "key_file": str(key)}
    dev = SpdkBackend(parse_device_spec(raw, "realtest"))
    try:
        path = dev.attach(timeout_s=60)
        assert dev.attach(timeout_s=60) == path  # idempotent
        assert dev.size_bytes == 64 * MIB and dev.is_healthy()
        out, back = mmap.mmap(-1, MIB), mmap.mmap(-1, MIB)
        out.write(os.urandom(MIB))
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        try:
            assert os.pwritev(fd, [out], 8 * MIB) == MIB
            assert os.preadv(fd, [back], 8 * MIB) == MIB
        finally:
            os.close(fd)
        assert back[:] == out[:]
    finally:
        dev.detach()
        dev.close()
    controllers = rpc("bdev_nvme_get_controllers")
    assert not any(c.get("name") == "CtxmemRealtest" for c in controllers)
