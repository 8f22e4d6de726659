"""Bad input gets a clear error and loses nothing (issue 2, item 6), each case for real."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import yaml

import ctxmem
from ctxmem_tools.launcher import ServiceProcess, local_config
from tests import kit
from tests.conftest import ServiceHandle
from tests.kit import model_layout

LAYOUT = model_layout(dtype="float16")


def blocks(n: int) -> list[np.ndarray]:
    return kit.blocks(n, LAYOUT.block_nbytes, n)


def test_wrong_buffer_size(service: ServiceHandle) -> None:
    with ctxmem.Client(service.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        keys = ctxmem.chain_hashes(range(32), 16)
        with pytest.raises(ctxmem.InvalidArgument,
                           match=r"buffers\[1\] is 100 bytes; this namespace's blocks are"):
            ns.put(keys, [np.zeros(LAYOUT.block_nbytes, np.uint8), np.zeros(100, np.uint8)])
        assert ns.lookup(keys).num_hits == 0  # nothing half-stored
        with pytest.raises(ctxmem.InvalidArgument, match="read-only"):
            ns.get(keys[:1], [bytes(LAYOUT.block_nbytes)])
        # Flat uint8 arrays take the shim's fast path (buffers._flat_uint8): same checks.
        frozen = np.zeros(LAYOUT.block_nbytes, np.uint8)
        frozen.flags.writeable = False
        with pytest.raises(ctxmem.InvalidArgument, match=r"buffers\[0\] is read-only"):
            ns.get(keys[:1], [frozen])
        strided = np.zeros(2 * LAYOUT.block_nbytes, np.uint8)[::2]
        with pytest.raises(ctxmem.InvalidArgument, match="not C-contiguous"):
            ns.put(keys[:1], [strided])
        with pytest.raises(ctxmem.InvalidArgument, match="2 keys and 1 buffers"):
            ns.put(keys, blocks(1))


def test_key_too_long_and_duplicate_keys(service: ServiceHandle) -> None:
    with ctxmem.Client(service.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        with pytest.raises(ctxmem.InvalidArgument, match=r"keys\[0\] is 65 bytes"):
            ns.lookup([b"k" * 65])
        with pytest.raises(ctxmem.InvalidArgument, match=r"keys\[1\] duplicates keys\[0\]"):
            ns.put([b"a", b"a"], blocks(2))


def test_service_rejects_bad_keys_even_from_a_raw_client(service: ServiceHandle) -> None:
    # Bypass the shim's own checks: the service validates too.
    import grpc

    from ctxmem_common.identity import SESSION_TOKEN_METADATA_KEY
    from ctxmem_common.proto import ctxmem_pb2 as pb
    from ctxmem_common.proto import ctxmem_pb2_grpc as pb_grpc

    with grpc.insecure_channel(service.endpoint) as ch:
        stub = pb_grpc.ContextMemoryStub(ch)
        s = stub.Connect(pb.ConnectRequest(tenant="t", transport=pb.TRANSPORT_TCP))
        md = ((SESSION_TOKEN_METADATA_KEY, s.session_token),)
        with pytest.raises(grpc.RpcError) as exc:
            stub.Lookup(pb.LookupRequest(session_id=s.session_id, namespace_handle=9,
                                         keys=[b"a"]), metadata=md)
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
        assert "namespace handle 9 is not open" in exc.value.details()
        ns = stub.OpenNamespace(pb.OpenNamespaceRequest(
            session_id=s.session_id, model_id="m",
            layout=pb.Layout(dtype="float16", num_layers=1, num_kv_heads=1, head_dim=8,
                             tokens_per_block=16)), metadata=md)
        with pytest.raises(grpc.RpcError) as exc:
            stub.Allocate(pb.AllocateRequest(session_id=s.session_id,
                                             namespace_handle=ns.namespace_handle,
                                             keys=[b"x" * 80]), metadata=md)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as exc:
            stub.Lookup(pb.LookupRequest(session_id=bytes(16), namespace_handle=1, keys=[b"a"]),
                        metadata=md)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "reconnect" in exc.value.details()


def test_unknown_namespace_layout_rejected(service: ServiceHandle) -> None:
    with ctxmem.Client(service.endpoint) as c, pytest.raises(ctxmem.InvalidArgument,
                                                             match="larger than one DRAM slab"):
        big = ctxmem.KVLayout(dtype="float32", num_layers=64, num_kv_heads=16, head_dim=128,
                              tokens_per_block=64)
        c.open_namespace(big, model_id="too-big")


def test_expired_lease_and_allocation(service_factory: Callable[..., ServiceHandle]) -> None:
    svc = service_factory(lease_ttl_s=0.3, allocation_ttl_s=0.3)
    with ctxmem.Client(svc.endpoint, transport="tcp") as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        keys = ctxmem.chain_hashes(range(32), 16)
        data = blocks(2)
        ns.put(keys, data)
        # A lease that expires before the client reads: the TCP read is refused and the
        # get degrades to a miss: never wrong data.
        from ctxmem_common.proto import ctxmem_pb2 as pb

        s = ns._open()
        a = c._rpc("Acquire", pb.AcquireRequest(session_id=s.id, namespace_handle=ns.handle,
                                                keys=keys))
        assert a.num_acquired == 2
        time.sleep(0.8)  # let the lease expire
        views = [memoryview(bytearray(LAYOUT.block_nbytes)) for _ in range(2)]
        with pytest.raises(ctxmem.Unavailable, match="expired"):
            s.channel.read(a.lease_id, a.slots, views)
        rel = c._rpc("Release", pb.ReleaseRequest(session_id=s.id, lease_ids=[a.lease_id]))
        assert list(rel.valid) == [False]
        b = c._rpc("Allocate", pb.AllocateRequest(
            session_id=s.id, namespace_handle=ns.handle,
            keys=ctxmem.chain_hashes(range(100, 116), 16)))
        time.sleep(0.8)
        with pytest.raises(ctxmem.Expired, match="allocate again"):
            c._rpc("Commit", pb.CommitRequest(session_id=s.id, allocation_id=b.allocation_id))
        out = [np.zeros_like(d) for d in data]
        assert ns.get(keys, out) == 2  # a fresh request still works
        assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_service_restarted_mid_session_reconnects_and_loses_nothing(
        service_factory: Callable[..., ServiceHandle], transport: str) -> None:
    svc = service_factory()
    with ctxmem.Client(svc.endpoint, transport=transport) as c:  # type: ignore[arg-type]
        ns = c.open_namespace(LAYOUT, model_id="m")
        keys = ctxmem.chain_hashes(range(16 * 6), 16)
        data = blocks(6)
        ns.put(keys[:3], data[:3])
        svc.restart()  # clean restart: write-back blocks are flushed, index rebuilt
        # The old session is unknown to the new instance: the shim reconnects, retries.
        assert ns.put(keys[3:], data[3:]).stored == 3
        out = [np.zeros_like(d) for d in data]
        assert ns.get(keys, out) == 6
        assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))


def test_service_gone_get_is_a_miss_put_is_an_error(
        service_factory: Callable[..., ServiceHandle]) -> None:
    svc = service_factory()
    with ctxmem.Client(svc.endpoint, timeout_s=2) as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        keys = ctxmem.chain_hashes(range(32), 16)
        data = blocks(2)
        ns.put(keys, data)
        svc.kill()
        out = [np.zeros_like(d) for d in data]
        assert ns.get(keys, out) == 0  # a miss: the engine recomputes
        with pytest.raises(ctxmem.Unavailable, match="unavailable"):
            ns.put(keys, data)  # the caller still has its buffers: nothing lost


def test_dram_full_is_resource_exhausted_never_a_crash(
        service_factory: Callable[..., ServiceHandle]) -> None:
    svc = service_factory(dram_size="8MiB", dram_slab="4MiB", flash_size=None)
    with ctxmem.Client(svc.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id="m")  # 16 KiB blocks: 512 fit
        keys = ctxmem.chain_hashes(range(16 * 1000), 16)
        c.max_batch_bytes = 1 << 30
        with pytest.raises(ctxmem.ResourceExhausted, match="more DRAM than the tier holds"):
            ns.put(keys[:600], blocks(600))
        c.max_batch_bytes = 256 << 20
        assert ns.lookup(keys).num_hits == 0  # nothing half-stored
        # Without flash, eviction drops old blocks instead of failing.
        for i in range(0, 1000, 200):
            assert ns.put(keys[i:i + 200], blocks(200)).stored == 200
        assert c.stats()["blocks"] <= 512
        assert svc.proc is not None and svc.proc.poll() is None


def test_flash_full_evicts_oldest_and_keeps_serving(
        service_factory: Callable[..., ServiceHandle]) -> None:
    svc = service_factory(dram_size="8MiB", dram_slab="4MiB", flash_size="20MiB",
                          flash_slab="4MiB")
    with ctxmem.Client(svc.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        keys = ctxmem.chain_hashes(range(16 * 2000), 16)  # 31 MiB into 8 + ~16 MiB
        data = blocks(2000)
        for i in range(0, 2000, 200):
            ns.put(keys[i:i + 200], data[i:i + 200])
        st = c.stats()
        assert st["evictions_flash"] > 0 and st["blocks"] < 2000
        newest = keys[1800:]
        out = [np.zeros_like(d) for d in data[1800:]]
        assert ns.get(newest, out) == 200
        assert all(np.array_equal(a, b) for a, b in zip(data[1800:], out, strict=True))


def _serve(cfg_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ctxmem_dpu", "serve", "--config",
                           str(cfg_path)], capture_output=True, text=True, timeout=60)


def test_device_missing_at_start_is_a_clear_error(tmp_path: Path) -> None:
    cfg = local_config(tmp_path)
    cfg["flash"]["devices"][0].update(path=str(tmp_path / "absent.img"), create=False)
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg))
    r = _serve(p)
    assert r.returncode == 1
    assert "absent.img" in r.stderr and "cannot start" in r.stderr


def test_invalid_config_is_a_clear_error(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("dram:\n  size: 1GiB\n  colour: blue\n")
    r = _serve(p)
    assert r.returncode == 2
    assert "dram.colour: unknown key" in r.stderr


def test_wrong_master_key_file_is_refused_not_replaced(tmp_path: Path) -> None:
    cfg = local_config(tmp_path)
    key = tmp_path / "master.key"
    key.write_text("not hex")
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg))
    r = _serve(p)
    assert r.returncode == 1 and "64 hex characters" in r.stderr
    assert "not hex" not in r.stderr  # the key's content is never printed
    assert key.read_text() == "not hex"


def test_service_process_start_failure_reports_the_log(tmp_path: Path) -> None:
    cfg = local_config(tmp_path)
    cfg["dram"]["size"] = "nonsense"
    with pytest.raises(RuntimeError, match="exited with status 2"):
        ServiceProcess(tmp_path, cfg)


def test_open_namespace_after_a_restart_reconnects(
        service_factory: Callable[..., ServiceHandle]) -> None:
    svc = service_factory()
    with ctxmem.Client(svc.endpoint) as c:
        c.open_namespace(LAYOUT, model_id="m").put(ctxmem.chain_hashes(range(16), 16), blocks(1))
        svc.restart()
        ns = c.open_namespace(LAYOUT, model_id="m2")  # the cached session is stale now
        assert ns.put(ctxmem.chain_hashes(range(16), 16), blocks(1)).stored == 1
