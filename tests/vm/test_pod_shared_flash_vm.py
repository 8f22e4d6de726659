"""Shared flash on a REAL NVMe-oF namespace (kernel nvmet in the QEMU guest).

Two pod nodes attach the same namespace through the kernel initiator, one controller
each (node a over TCP, node b over RDMA/Soft-RoCE), with their slab leases in a real
redis-server started in the guest:

- node a (its own process) writes blocks; node b reads them straight from the namespace
  (SharedFlashSource: O_DIRECT, header and CRC checked, decrypted with the pod's key);
- node b writes its own blocks, in slabs disjoint from a's;
- node a is killed (SIGKILL): its blocks are still served from the namespace;
- after a's lease lapses, node b takes a's slab over and reuses it: a's pointers, now
  stale, are misses (never bytes); b's blocks are exact.

Run: CTXMEM_VM_PASSENV=PYTHONPATH bash tests/vm/run.sh .venv/bin/pytest -m vm \
    tests/vm/test_pod_shared_flash_vm.py
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from ctxmem_dpu.pod.shared_flash import SharedFlashSource
from ctxmem_dpu.pod.slab_leases import SlabLeases
from ctxmem_dpu.storage import parse_device_spec
from ctxmem_dpu.storage.kernel import KernelBackend
from ctxmem_tools.redis_server import RedisServer
from tests.dpu.pod import podkit
from tests.dpu.pod.podkit import (
    MASTER,
    Published,
    block_bytes,
    format_shared,
    node,
    node_process,
    put_durable,
    session,
)
from tests.kit import until_async

IN_VM = os.environ.get("CTXMEM_VM") == "1"
pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(not IN_VM, reason="needs the QEMU guest with kernel nvmet; run: "
                       "bash tests/vm/run.sh .venv/bin/pytest -m vm "
                       "tests/vm/test_pod_shared_flash_vm.py"),
    pytest.mark.timeout(1200),
]

ATTACH_TIMEOUT_S = 120.0  # bounds, not timings: the guest CPU is emulated
LEASE_S = 5.0  # long enough that an emulated, loaded guest renews in time
MIB = 1 << 20


def _backend(transport: str) -> KernelBackend:
    env = os.environ
    port = env["CTXMEM_NVMET_RDMA_PORT"] if transport == "rdma" else env[
        "CTXMEM_NVMET_TCP_PORT"]
    spec = parse_device_spec(
        {"name": f"pod-{transport}", "backend": "kernel",
         "kernel": {"transport": transport, "traddr": env["CTXMEM_NVMET_ADDR"],
                    "trsvcid": port, "subnqn": env["CTXMEM_NVMET_NQN"], "ctrl_loss_tmo": 5}},
        f"pod[{transport}]")
    return KernelBackend(spec, command_timeout_s=60)


@pytest.fixture
def paths() -> Iterator[tuple[str, str, int]]:
    """(node a's block device, node b's, the namespace's size): one controller each."""
    tcp, rdma = _backend("tcp"), _backend("rdma")
    try:
        a = tcp.attach(timeout_s=ATTACH_TIMEOUT_S)
        b = rdma.attach(timeout_s=ATTACH_TIMEOUT_S)
        yield a, b, tcp.size_bytes
    finally:
        for be in (rdma, tcp):
            try:
                be.detach()
            except Exception as exc:  # leave the guest usable for the next test
                print(f"detach {be.spec.name}: {exc}")


async def _exact(src: SharedFlashSource, pubs: list[Published]) -> list[bool | None]:
    got = await src.fetch(pubs[0].ns, [p.entry for p in pubs], [p.key for p in pubs])
    out: list[bool | None] = []
    for p, g in zip(pubs, got, strict=True):
        assert g is None or bytes(g) == block_bytes(p.key, p.entry.nbytes), "WRONG bytes"
        out.append(None if g is None else True)
    return out


def _wipe(path: str, nbytes: int) -> None:
    """Zero the first ``nbytes`` of ``path`` (O_DIRECT): the guest's nvmet namespace is
    shared by every guest test, and a later one must find no superblock or slab header of
    ours (a device holding records is refused, never reformatted)."""
    import mmap

    zeros = mmap.mmap(-1, MIB)  # page-aligned, zero-filled
    fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    try:
        for off in range(0, nbytes, MIB):
            os.pwritev(fd, [zeros], off)
        os.fsync(fd)
    finally:
        os.close(fd)
        zeros.close()


async def test_two_services_one_namespace_writer_killed_and_taken_over(
        paths: tuple[str, str, int], tmp_path: Path, monkeypatch: Any,
        request: pytest.FixtureRequest) -> None:
    path_a, path_b, size = paths  # with native multipath: one node, two controllers
    slab = 16 * MIB
    assert size >= MIB + 3 * slab, f"the namespace ({size} bytes) is too small"
    format_shared(path_a, slab, slabs=3)  # three slabs whatever the namespace's size
    request.addfinalizer(lambda: _wipe(path_a, MIB + 3 * slab))
    monkeypatch.setattr(podkit, "NODE_START_TIMEOUT_S", 300.0)
    timings: dict[str, float] = {}
    with RedisServer(tmp_path / "redis") as redis:
        url = redis.url
        with node_process(url, "a", path_a, slab, LEASE_S, blocks=8, kib=64) as (proc, pa):
            assert len(pa) == 8
            slab_a = (pa[0].entry.shared.offset - MIB) // slab  # type: ignore[union-attr]
            with SharedFlashSource([path_b], MASTER, timeout_s=60.0) as src:
                t = time.monotonic()
                assert await _exact(src, pa) == [True] * 8  # b reads a's blocks
                timings["read_8_of_a_s"] = time.monotonic() - t
            async with node(url, "b", path_b, slab, LEASE_S) as b:
                s, ns = session(b, 32, "m32")
                pb = await put_durable(b, "b", s, ns, [b"b%d" % i for i in range(4)])
                assert len(pb) == 4
                slabs_b = {blk.flash.slot.slab for blk in b.index[ns.digest].values()
                           if blk.flash is not None}
                assert slab_a not in slabs_b
                proc.kill()  # the writer dies
                proc.wait(30)
                dev = b.flash.devices[0]
                with SharedFlashSource([path_b], MASTER, timeout_s=60.0) as src:
                    assert await _exact(src, pa) == [True] * 8  # still served
                    t = time.monotonic()
                    uuid = dev.superblock.device_uuid
                    client = aioredis.Redis.from_url(url)
                    try:
                        probe = SlabLeases(client, "probe", LEASE_S)
                        async def lapsed() -> bool:  # b may take it as a spare
                            h = (await probe.holders(uuid, [slab_a]))[0]
                            return h is None or h[0] != "a"
                        await until_async(lapsed, 30 * LEASE_S, "a's lease to lapse", 0.5)
                    finally:
                        await client.aclose()
                    timings["lease_lapsed_after_kill_s"] = time.monotonic() - t
                    taken = False
                    for kib in (16, 8, 4):  # new slot sizes until a's slab is reused
                        assert await _exact(src, pa) == [True] * 8  # not reused yet
                        s2, ns2 = session(b, kib, f"m{kib}")
                        assert len(await put_durable(b, "b", s2, ns2,
                                                     [b"r%d-%d" % (kib, i)
                                                      for i in range(4)])) == 4
                        if dev.slab_owner(slab_a)[0] == "b":
                            taken = True
                            break
                    assert taken, "a's slab was never taken over"
                    timings["takeover_after_kill_s"] = time.monotonic() - t
                    assert await _exact(src, pa) == [None] * 8  # stale pointers: misses
                    assert await _exact(src, pb) == [True] * 4
                    assert src.counters["stale"] >= 8
                assert b.audit() == []
    out = Path(os.environ.get("CTXMEM_VM_OUT", tmp_path))
    (out / "pod_shared_flash_timings.txt").write_text(
        "".join(f"{k} {v:.2f}\n" for k, v in timings.items()))
