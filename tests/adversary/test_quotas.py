"""Per-tenant quotas, fair eviction, caps and idle reclaim (issue 12), against the real
service.

Two tenants on one service (loopback, tenant names trusted). Tenant B stores a working
set within its guaranteed share; tenant A attacks: it floods puts far beyond DRAM and
flash, leases one block in every DRAM slab it can, and opens allocations until refused.
B's blocks must all still hit byte-exact and B must still be able to put; A's requests
over a limit get RESOURCE_EXHAUSTED naming the tenant and the quota. Then the caps on
sessions and namespaces, and the reclaim of idle sessions.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable

import grpc
import numpy as np
import pytest

import ctxmem
from ctxmem_common.errors import ERROR_METADATA_KEY, ResourceExhausted
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.proto import ctxmem_pb2_grpc as pb_grpc
from tests.adversary.raw import RawSession
from tests.conftest import ServiceHandle
from tests.kit import blocks, chain_keys, model_layout, until

# 128 KiB blocks: 32 per 4 MiB slab; DRAM is 8 slabs (256 blocks), flash ~450 blocks.
LAYOUT = model_layout(128)
BLOCK = LAYOUT.block_nbytes
SMALL = {"dram_size": "32MiB", "dram_slab": "4MiB", "flash_size": "64MiB",
         "flash_slab": "4MiB"}


def _settle(client: ctxmem.Client, timeout_s: float = 60.0) -> None:
    """Wait (bounded) until the service has no block left to write back: a flood's
    demotions otherwise race the next step on a loaded machine (the DRAM tier then reads
    full for a moment instead of the tenant's quota)."""
    until(lambda: client.stats()["dirty_blocks"] == 0, timeout_s, "write-back to settle", 0.02)


def _get_exact(ns: ctxmem.Namespace, keys: list[bytes], data: list[np.ndarray]) -> int:
    """How many leading blocks come back, asserting they are byte-exact."""
    out = [np.zeros_like(d) for d in data]
    n = ns.get(keys, out)
    for a, b in zip(data[:n], out[:n], strict=True):
        assert np.array_equal(a, b)
    return n


def _code(exc: grpc.RpcError) -> str:
    return {k: v for k, v in exc.trailing_metadata() or ()}.get(ERROR_METADATA_KEY, "")


def test_flood_pins_and_allocations_cannot_starve_another_tenant(
        service_factory: Callable[..., ServiceHandle]) -> None:
    svc = service_factory(encryption=False, **SMALL)
    with ctxmem.Client(svc.endpoint, transport="shm") as cb, \
            ctxmem.Client(svc.endpoint, transport="shm") as ca:
        nb = cb.open_namespace(LAYOUT, model_id="m", tenant="b")
        b_keys, b_data = chain_keys(LAYOUT, 0, 48), blocks(48, BLOCK, 1)
        nb.put(b_keys, b_data)
        na = ca.open_namespace(LAYOUT, model_id="m", tenant="a")
        # A floods: ~3.5x DRAM + flash together.
        refused = 0
        stored: list[bytes] = []
        for i in range(30):
            keys = chain_keys(LAYOUT, 10_000 + 32 * i, 32)
            try:
                na.put(keys, blocks(32, BLOCK, 100 + i))
                stored += keys
            except ResourceExhausted:
                refused += 1
        assert stored, "tenant a could not put at all"
        assert _get_exact(nb, b_keys, b_data) == 48, "the flood evicted tenant b's blocks"
        _settle(cb)  # write-back done: what follows races no background demotion

        # A leases one block per DRAM slab, for as many slabs as it can.
        raw = RawSession(svc.endpoint, LAYOUT, tenant="a", model_id="m", transport="tcp")
        try:
            regions: set[int] = set()
            lease_refusal = ""
            for key in stored[::-1][:300]:
                try:
                    r = raw.call("Acquire", pb.AcquireRequest(
                        session_id=raw.session_id, namespace_handle=raw.handle, keys=[key]))
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    lease_refusal = exc.details() or ""
                    break
                if r.num_acquired and r.slots[0].region not in regions:
                    regions.add(r.slots[0].region)
                else:
                    raw.call("Release", pb.ReleaseRequest(session_id=raw.session_id,
                                                          lease_ids=[r.lease_id]))
            # And allocations up to its ceiling.
            alloc_refusal = ""
            for i in range(40):
                try:
                    raw.allocate(chain_keys(LAYOUT, 50_000 + 32 * i, 32))
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    alloc_refusal = exc.details() or ""
                    break
            assert "tenant 'a'" in alloc_refusal and "quota" in alloc_refusal, alloc_refusal
            assert "tenant 'a'" in lease_refusal and "quota" in lease_refusal, lease_refusal
            # B: every block still hits byte-exact, and B can still put within its share.
            assert _get_exact(nb, b_keys, b_data) == 48
            more_keys, more_data = chain_keys(LAYOUT, 1000, 48), blocks(48, BLOCK, 2)
            nb.put(more_keys, more_data)
            assert _get_exact(nb, more_keys, more_data) == 48
            assert _get_exact(nb, b_keys, b_data) == 48
        finally:
            raw.close()
        stats = cb.stats()
        assert stats["tenant.a.refusals"] >= 1
        assert stats.get("tenant.b.evictions_flash", 0) == 0
        assert stats.get("tenant.b.evictions_dram", 0) == 0
        assert stats["tenant.b.dram_bytes"] > 0


def test_session_and_namespace_caps(service_factory: Callable[..., ServiceHandle]) -> None:
    svc = service_factory(encryption=False, transports=["tcp"], **SMALL,
                          quotas={"default": {"max_sessions": 2, "max_namespaces": 2}})
    first = RawSession(svc.endpoint, LAYOUT, tenant="a", model_id="m0", transport="tcp")
    second = RawSession(svc.endpoint, LAYOUT, tenant="a", model_id="m1", transport="tcp")
    try:
        with pytest.raises(grpc.RpcError) as info:
            RawSession(svc.endpoint, LAYOUT, tenant="a", transport="tcp")
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_sessions" in (info.value.details() or "")
        with pytest.raises(grpc.RpcError) as info:
            first.call("OpenNamespace", pb.OpenNamespaceRequest(
                session_id=first.session_id, model_id="m2",
                layout=ctxmem_layout_pb()))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_namespaces" in (info.value.details() or "")
        # Another tenant is not affected by a's caps.
        RawSession(svc.endpoint, LAYOUT, tenant="b", transport="tcp").close()
    finally:
        first.close()
        second.close()


def ctxmem_layout_pb() -> pb.KVLayout:
    from ctxmem_common.protoconv import layout_to_pb
    return layout_to_pb(LAYOUT)


def test_idle_sessions_are_reclaimed(service_factory: Callable[..., ServiceHandle]) -> None:
    svc = service_factory(encryption=False, transports=["tcp"], **SMALL,
                          service={"session_idle_s": 1.0})
    raw = RawSession(svc.endpoint, LAYOUT, tenant="a", model_id="m", transport="tcp")
    try:
        raw.allocate(chain_keys(LAYOUT, 0, 40))
        stats = raw.call("Stats", pb.StatsRequest()).values
        assert stats["allocations"] == 1 and stats["dram_used_bytes"] > 0

        def reclaimed() -> dict[str, float] | None:
            values = dict(raw.call("Stats", pb.StatsRequest()).values)
            return values if values["sessions"] == 0 else None

        stats = until(reclaimed, 10, "the idle session to be reclaimed", 0.2)
        assert stats["allocations"] == 0 and stats["dram_used_bytes"] == 0
        assert stats["idle_sessions_closed"] >= 1
        with pytest.raises(grpc.RpcError) as info:
            raw.allocate(chain_keys(LAYOUT, 100, 2))
        assert _code(info.value) == "UNKNOWN_SESSION"
    finally:
        raw.close()
    # The shim reconnects after its session was reclaimed.
    with ctxmem.Client(svc.endpoint, transport="tcp") as client:
        ns = client.open_namespace(LAYOUT, model_id="m", tenant="c")
        keys, data = chain_keys(LAYOUT, 200, 4), blocks(4, BLOCK, 3)
        ns.put(keys, data)
        time.sleep(2.5)
        assert _get_exact(ns, keys, data) == 4


@pytest.mark.parametrize(("quota", "words"), [
    ({"dram_max": 1.5}, "quotas.default.dram_max"),
    ({"dram_guaranteed": 0.6, "dram_max": 0.5}, "cannot exceed its ceiling"),
    ({"max_sessions": 0}, "quotas.default.max_sessions"),
    ({"bogus": 1}, "quotas.default.bogus"),
])
def test_bad_quota_config_names_the_key(quota: dict[str, object], words: str) -> None:
    from ctxmem_common.config import config_from_dict
    from ctxmem_common.errors import ConfigError
    with pytest.raises(ConfigError, match=re.escape(words)):
        config_from_dict({"quotas": {"default": quota}})
    with pytest.raises(ConfigError, match=re.escape("quotas.tenants.t")):
        config_from_dict({"quotas": {"tenants": {"t": quota}}})


def test_recovered_blocks_count_for_their_tenant(
        service_factory: Callable[..., ServiceHandle]) -> None:
    """Issue 25: blocks recovered from flash at a restart belong to their tenant from the
    start (the namespace tenants file), not to nobody until it reconnects: its configured
    flash guarantee protects them from another tenant's flood meanwhile, and once back its
    usage counts them against its flash ceiling."""
    svc = service_factory(encryption=False, **SMALL, write_policy="write_through",
                          quotas={"tenants": {"a": {"flash_guaranteed": 0.4,
                                                    "flash_max": 0.4}}})
    a_keys, a_data = chain_keys(LAYOUT, 0, 100), blocks(100, BLOCK, 7)
    with ctxmem.Client(svc.endpoint, transport="tcp") as ca:
        ca.open_namespace(LAYOUT, model_id="m", tenant="a").put(a_keys, a_data)
    svc.restart()
    stats = svc.stats()
    assert stats.get("recovered_blocks") == 100
    # a has no session yet: its recovered blocks are still its own.
    assert stats.get("tenant.a.flash_bytes") == 100 * LAYOUT.block_nbytes, stats
    assert "tenant._unknown.flash_bytes" not in stats
    with ctxmem.Client(svc.endpoint, transport="tcp") as cx:
        nx = cx.open_namespace(LAYOUT, model_id="m", tenant="x")
        for i in range(20):  # ~1.3x flash: every block x can evict is evicted
            nx.put(chain_keys(LAYOUT, 100_000 + 30 * i, 30), blocks(30, BLOCK, 200 + i))
        assert cx.stats().get("tenant.a.evictions_flash", 0) == 0
        with ctxmem.Client(svc.endpoint, transport="tcp") as ca:
            na = ca.open_namespace(LAYOUT, model_id="m", tenant="a")
            assert _get_exact(na, a_keys, a_data) == 100, "x's flood evicted a's blocks"
            capacity = ca.stats()["flash_capacity_bytes"]
            ceiling = int(capacity * 0.4)
            # a puts past its ceiling, on a full tier: its recovered blocks count, so it
            # evicts its own blocks beyond the ceiling and x keeps what it holds.
            for i in range(12):
                na.put(chain_keys(LAYOUT, 300_000 + 10 * i, 10), blocks(10, BLOCK, 400 + i))
            stats = ca.stats()
            assert stats["tenant.a.flash_bytes"] <= ceiling + 10 * LAYOUT.block_nbytes, stats
            assert stats.get("tenant.a.evictions_flash", 0) > 0


def test_insecure_mode_caps_live_tenant_names(
        service_factory: Callable[..., ServiceHandle]) -> None:
    """Issue 25: in insecure mode (tenant names trusted) one client opened sessions under
    3,000 names, which shrank every fair share to nothing, and evicted a victim's blocks.
    Live tenant names are capped (``service.insecure_max_tenants``): a Connect under a new
    name past the cap is RESOURCE_EXHAUSTED saying why, names that have a session are still
    served, and the victim keeps its share of the tier against the names that got in."""
    from ctxmem_common.config import config_from_dict
    from ctxmem_common.protoconv import transport_to_pb

    assert config_from_dict({}).service.insecure_max_tenants == 64  # the default
    svc = service_factory(encryption=False, transports=["tcp"], **SMALL,
                          service={"insecure_max_tenants": 4})
    with ctxmem.Client(svc.endpoint, transport="tcp") as cb:
        nb = cb.open_namespace(LAYOUT, model_id="m", tenant="b")
        b_keys, b_data = chain_keys(LAYOUT, 0, 48), blocks(48, BLOCK, 1)
        nb.put(b_keys, b_data)
        channel = grpc.insecure_channel(svc.endpoint)
        try:
            stub = pb_grpc.ContextMemoryStub(channel)
            admitted: list[str] = []
            refusals: list[str] = []
            for i in range(50):  # bounded: the attack used 3,000
                try:
                    stub.Connect(pb.ConnectRequest(
                        client_name="x", transport=transport_to_pb("tcp"),
                        tenant=f"x{i}"), timeout=10)
                    admitted.append(f"x{i}")
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    refusals.append(exc.details() or "")
            assert admitted == ["x0", "x1", "x2"], admitted
            assert len(refusals) == 47
            assert "insecure_max_tenants=4" in refusals[0] and "tenant 'x3'" in refusals[0]
            assert "not authenticated" in refusals[0], refusals[0]
            # A name that has a session may open more.
            stub.Connect(pb.ConnectRequest(client_name="x", transport=transport_to_pb("tcp"),
                                           tenant="x0"), timeout=10)
            # The admitted names flood, 16 blocks per name in turn (what the attack did
            # with 3,000: a fresh name has no blocks of its own to evict, so it takes
            # those of tenants above their (tiny) shares): ~1.1x DRAM and flash together.
            with ctxmem.Client(svc.endpoint, transport="tcp") as cx:
                for i in range(50):
                    name = admitted[i % len(admitted)]
                    ns = cx.open_namespace(LAYOUT, model_id="m", tenant=name)
                    with contextlib.suppress(ResourceExhausted):
                        ns.put(chain_keys(LAYOUT, 10_000 + 16 * i, 16), blocks(16, BLOCK, 100 + i))
            assert _get_exact(nb, b_keys, b_data) == 48, "the flood evicted tenant b's blocks"
            assert cb.stats().get("tenant.b.evictions_flash", 0) == 0
        finally:
            channel.close()
