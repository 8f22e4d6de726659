"""Metrics and health endpoints, tenant isolation on the shared-memory channel, fork safety."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Callable

import numpy as np
import pytest

import ctxmem
from ctxmem.transport.shm import ShmChannel
from tests.conftest import ServiceHandle
from tests.kit import model_layout

LAYOUT = model_layout(dtype="float16")


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_prometheus_metrics_and_health(service: ServiceHandle) -> None:
    with ctxmem.Client(service.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        keys = ctxmem.chain_hashes(range(64), 16)
        ns.put(keys, [np.ones(LAYOUT.block_nbytes, np.uint8)] * 4)
        ns.get(keys, [np.zeros(LAYOUT.block_nbytes, np.uint8) for _ in keys])
        ns.get(ctxmem.chain_hashes(range(5, 21), 16), [np.zeros(LAYOUT.block_nbytes, np.uint8)])
        assert c.health().status == "serving"
    assert _get(service.metrics_url_for("/healthz")) == (200, "ok\n")
    assert _get(service.metrics_url_for("/readyz"))[0] == 200
    code, text = _get(service.metrics_url_for("/metrics"))
    assert code == 200
    for line in ('ctxmem_hits_total{tier="dram"} 4.0', "ctxmem_misses_total 1.0",
                 'ctxmem_bytes_total{op="put"} ' + f"{4 * LAYOUT.block_nbytes}.0",
                 "ctxmem_integrity_failures_total 0.0", "ctxmem_leases 0.0",
                 'ctxmem_tier_used_bytes{tier="dram"}', 'ctxmem_evictions_total{tier="dram"}',
                 'ctxmem_tier_capacity_bytes{tier="flash"}', "process_cpu_seconds_total "):
        assert line in text, f"missing {line!r} in /metrics"
    assert _get(service.metrics_url_for("/nope"))[0] == 404


def test_stats_reports_the_service_process_cpu(service: ServiceHandle) -> None:
    """Stats carries the service's own CPU seconds (user + system), which the benches
    divide by the bytes moved; they grow with the work the service does."""
    before = service.stats()
    assert before["process_cpu_seconds"] == pytest.approx(
        before["process_cpu_user_seconds"] + before["process_cpu_system_seconds"])
    assert before["process_cpu_seconds"] > 0
    with ctxmem.Client(service.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id="cpu")
        keys = ctxmem.chain_hashes(range(16 * 64), 16)
        bufs = [np.ones(LAYOUT.block_nbytes, np.uint8)] * 64
        ns.put(keys, bufs)
        ns.get(keys, [np.zeros(LAYOUT.block_nbytes, np.uint8) for _ in keys])
    after = service.stats()
    assert after["process_cpu_seconds"] > before["process_cpu_seconds"]


def test_the_service_freezes_its_start_up_objects_out_of_the_collector(
        service: ServiceHandle) -> None:
    """The service process (``ctxmem_dpu.gctune.tune_gc``) froze what start-up allocated and
    collects its youngest generation after 10,000 net allocations, not 700: a put of
    1,024 blocks then deletes them with at most one collection (at least four with
    Python's default; the gc share of 64 KiB puts)."""
    before = service.stats()
    assert before["process_gc_frozen_objects"] > 10_000
    assert before["process_gc_gen0_threshold"] == 10_000
    with ctxmem.Client(service.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id="gc")
        keys = ctxmem.chain_hashes(range(16 * 1024), 16)
        ns.put(keys, [np.ones(LAYOUT.block_nbytes, np.uint8)] * len(keys))
        ns.delete(keys)
    ran = service.stats()["process_gc_collections"] - before["process_gc_collections"]
    assert ran <= 1, f"{ran} collections during one put and delete of 1,024 blocks"


def test_another_tenant_cannot_map_my_regions(service: ServiceHandle) -> None:
    with ctxmem.Client(service.endpoint, transport="shm") as alice, \
            ctxmem.Client(service.endpoint, transport="shm") as bob:
        ns_a = alice.open_namespace(LAYOUT, model_id="m", tenant="alice")
        ns_b = bob.open_namespace(LAYOUT, model_id="m", tenant="bob")
        keys = ctxmem.chain_hashes(range(64), 16)
        secret = [np.full(LAYOUT.block_nbytes, 0x5A, np.uint8) for _ in keys]
        ns_a.put(keys, secret)
        # Same keys, other tenant: invisible.
        assert ns_b.lookup(keys).num_hits == 0
        assert ns_b.exists(keys) == [False] * 4
        # Bob forges a MAP of Alice's region on his own authenticated channel.
        from ctxmem_common.proto import ctxmem_pb2 as pb

        sa = ns_a._open()
        a = alice._rpc("Acquire", pb.AcquireRequest(session_id=sa.id,
                                                    namespace_handle=ns_a.handle,
                                                    keys=keys[:1]))
        slot = a.slots[0]
        sb = ns_b._open()
        assert isinstance(sb.channel, ShmChannel)
        with pytest.raises(ctxmem.Unavailable, match="namespace this session has open"):
            sb.channel.read(0, [slot], [memoryview(bytearray(LAYOUT.block_nbytes))])


def test_shm_channel_rejects_a_wrong_token(service: ServiceHandle) -> None:
    with ctxmem.Client(service.endpoint) as c:
        health = c.health()
    with pytest.raises(ctxmem.Unavailable, match="wrong session token"):
        ShmChannel(health.shm_socket, bytes(16), b"\0" * 16, timeout_s=5)


def test_tcp_data_port_rejects_unauthenticated_peers(service: ServiceHandle) -> None:
    with ctxmem.Client(service.endpoint) as c:
        host, _, port = c.health().data_endpoint.rpartition(":")
    from ctxmem_common.wire import TCP_HELLO, TCP_RESP, Status

    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(TCP_HELLO.pack(b"CXT1", bytes(16), b"x" * 16))
        _m, status, _n = TCP_RESP.unpack(s.recv(TCP_RESP.size))
        assert status == Status.UNAUTHENTICATED


# Run in a process of its own, as an engine runs: `import ctxmem` first (it turns gRPC's
# fork support on), one client, then fork. Run inside pytest's process, the fork met the
# gRPC threads of every earlier test's channels ("Other threads are currently calling into
# gRPC, skipping fork() handlers") and failed at random under load.
_FORK = textwrap.dedent("""
    import os, sys
    import numpy as np
    import ctxmem
    layout = ctxmem.KVLayout(dtype="float16", num_layers=2, num_kv_heads=2, head_dim=64,
                             tokens_per_block=16)
    with ctxmem.Client(sys.argv[1]) as c:
        ns = c.open_namespace(layout, model_id="fork")
        keys = ctxmem.chain_hashes(range(32), 16)
        data = [np.full(layout.block_nbytes, 3, np.uint8)] * 2
        ns.put(keys, data)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: same Client object, inherited from the parent
            try:
                out = [np.zeros(layout.block_nbytes, np.uint8) for _ in keys]
                n = ns.get(keys, out)
                exact = all((o == 3).all() for o in out)
                more = ctxmem.chain_hashes(range(100, 132), 16)
                stored = ns.put(more, data).stored
                ok = n == 2 and exact and stored == 2
                os.write(w, b"1" if ok else f"got {n} exact {exact} stored {stored}".encode())
            except BaseException as exc:
                os.write(w, repr(exc).encode()[:200])
            finally:
                os._exit(0)
        os.close(w)
        _, status = os.waitpid(pid, 0)
        msg = os.read(r, 300).decode()
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        assert msg == "1", f"child: {msg}"
        # The parent's client still works after the child used its copy.
        hits = ns.lookup(ctxmem.chain_hashes(range(100, 132), 16)).num_hits
        assert hits == 2, f"parent after the child: {hits} hits"
    print("ok")
""")


def test_sync_client_survives_fork(service: ServiceHandle) -> None:
    """A blocking Client inherited by a forked child works there (it reconnects) and
    still works in the parent afterwards (docs: engines fork their workers)."""
    proc = subprocess.run([sys.executable, "-c", _FORK, service.endpoint],
                          capture_output=True, text=True, timeout=120,
                          # gRPC's settings as `import ctxmem` chooses them, not pytest's
                          env={k: v for k, v in os.environ.items()
                               if not k.startswith("GRPC_")})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", \
        f"exit {proc.returncode}: {proc.stdout[-500:]} {proc.stderr[-2000:]}"


def test_two_clients_share_blocks_within_a_tenant(
        service_factory: Callable[..., ServiceHandle]) -> None:
    svc = service_factory()
    with ctxmem.Client(svc.endpoint, transport="shm") as a, \
            ctxmem.Client(svc.endpoint, transport="tcp") as b:
        keys = ctxmem.chain_hashes(range(48), 16)
        data = [np.random.default_rng(i).integers(0, 255, LAYOUT.block_nbytes, dtype=np.uint8)
                for i in range(3)]
        a.open_namespace(LAYOUT, model_id="m").put(keys, data)
        out = [np.zeros_like(d) for d in data]
        assert b.open_namespace(LAYOUT, model_id="m").get(keys, out) == 3
        assert all(np.array_equal(x, y) for x, y in zip(data, out, strict=True))
        # A different cache_salt tag is a different namespace.
        assert b.open_namespace(LAYOUT, model_id="m",
                                tags={"cache_salt": "u2"}).lookup(keys).num_hits == 0
