"""The real service on loopback, driven through the shim, byte-comparing every round trip."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest
import torch

import ctxmem
from tests.conftest import ServiceHandle
from tests.kit import blocks, byte_layout, model_layout, until

LAYOUT = model_layout(num_layers=4)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("encryption", [True, False])
def test_put_get_evict_cold_get(service_factory: Callable[..., ServiceHandle], transport: str,
                                encryption: bool) -> None:
    svc = service_factory(encryption=encryption)
    with ctxmem.Client(svc.endpoint, transport=transport) as client:  # type: ignore[arg-type]
        ns = client.open_namespace(LAYOUT, model_id="m")
        assert client.transport_in_use == transport
        keys = ctxmem.chain_hashes(range(16 * 24), 16)
        data = blocks(len(keys), LAYOUT.block_nbytes, 1)
        assert ns.put(keys, data) == ctxmem.PutResult(stored=24, existing=0)
        assert ns.put(keys[:4], data[:4]) == ctxmem.PutResult(stored=0, existing=4)
        assert ns.lookup(keys) == ctxmem.LookupResult(24, ["dram"] * 24)
        out = [np.zeros_like(d) for d in data]
        assert ns.get(keys, out) == 24
        assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
        assert ns.evict(keys) == 24
        assert ns.lookup(keys).tiers == ["flash"] * 24
        out = [np.zeros_like(d) for d in data]
        assert ns.get(keys, out) == 24  # cold: read, decrypt, CRC-verify
        assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
        assert ns.lookup(keys).tiers == ["dram"] * 24  # promoted
        st = client.stats()
        assert st["hits_flash"] == 24 and st["integrity_failures"] == 0


def test_prefix_semantics_partial_hits_and_delete(service: ServiceHandle) -> None:
    with ctxmem.Client(service.endpoint) as client:
        ns = client.open_namespace(LAYOUT, model_id="m")
        keys = ctxmem.chain_hashes(range(16 * 10), 16)
        data = blocks(10, LAYOUT.block_nbytes, 2)
        ns.put(keys[:6], data[:6])
        assert ns.lookup(keys).num_hits == 6
        assert ns.exists(keys) == [True] * 6 + [False] * 4
        out = [np.full(LAYOUT.block_nbytes, 7, np.uint8) for _ in keys]
        assert ns.get(keys, out) == 6
        assert all(np.array_equal(a, b) for a, b in zip(data[:6], out[:6], strict=True))
        assert all((o == 7).all() for o in out[6:])  # blocks after the run untouched
        assert ns.delete(keys[3:]) == 3
        assert ns.lookup(keys).num_hits == 3


def test_torch_tensors_and_memoryviews_are_accepted_without_copies(service: ServiceHandle
                                                                    ) -> None:
    with ctxmem.Client(service.endpoint) as client:
        ns = client.open_namespace(LAYOUT, model_id="torch")
        keys = ctxmem.chain_hashes(range(64), 16)
        n_el = LAYOUT.block_nbytes // 2
        src = [torch.randn(n_el, dtype=torch.float32).to(torch.bfloat16) for _ in keys]
        ns.put(keys[:2], src[:2])
        ns.put(keys[2:], [bytearray(memoryview(t.view(torch.uint8).numpy()))
                          for t in src[2:]])
        out = [torch.empty(n_el, dtype=torch.bfloat16) for _ in keys]
        assert ns.get(keys, out) == 4
        assert all(torch.equal(a, b) for a, b in zip(src, out, strict=True))
        mv_out = [memoryview(bytearray(LAYOUT.block_nbytes)) for _ in keys]
        assert ns.get(keys, mv_out) == 4
        assert bytes(mv_out[3]) == bytes(src[3].view(torch.uint8).numpy())


def test_eviction_under_pressure_keeps_every_block_servable(
        service_factory: Callable[..., ServiceHandle]) -> None:
    # 16 MiB of DRAM, 600 blocks of 32 KiB (18.75 MiB): DRAM must demote to make room.
    svc = service_factory(dram_size="16MiB", dram_slab="4MiB")
    with ctxmem.Client(svc.endpoint) as client:
        ns = client.open_namespace(LAYOUT, model_id="m")
        keys = ctxmem.chain_hashes(range(16 * 600), 16)
        data = blocks(600, LAYOUT.block_nbytes, 3)
        for i in range(0, 600, 100):
            assert ns.put(keys[i:i + 100], data[i:i + 100]).stored == 100
        out = [np.zeros_like(d) for d in data]
        assert ns.get(keys, out) == 600
        assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
        assert client.stats()["evictions_dram"] > 0


def test_async_client(service: ServiceHandle) -> None:
    async def main() -> None:
        async with ctxmem.AsyncClient(service.endpoint) as client:
            ns = await client.open_namespace(LAYOUT, model_id="async")
            keys = ctxmem.chain_hashes(range(32), 16)
            data = blocks(2, LAYOUT.block_nbytes, 4)
            await ns.put(keys, data)
            out = [np.zeros_like(d) for d in data]
            got = await asyncio.gather(ns.lookup(keys), ns.get(keys, out))
            assert got[0].num_hits == 2 and got[1] == 2
            assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
            assert await ns.prefetch(keys) == 0  # already in DRAM

    asyncio.run(main())


def test_prefetch_promotes_ahead_of_need(service: ServiceHandle) -> None:
    with ctxmem.Client(service.endpoint) as client:
        ns = client.open_namespace(LAYOUT, model_id="pf")
        keys = ctxmem.chain_hashes(range(16 * 8), 16)
        ns.put(keys, blocks(8, LAYOUT.block_nbytes, 5))
        ns.evict(keys)
        assert ns.lookup(keys).tiers == ["flash"] * 8
        assert ns.prefetch(keys) == 8
        until(lambda: ns.lookup(keys).tiers == ["dram"] * 8, 10,
              "prefetch to promote every block")


def test_per_key_tiers_follow_evict_and_delete(service: ServiceHandle) -> None:
    """``Namespace.tiers``: each key's tier on its own (not a prefix), "" when absent."""
    with ctxmem.Client(service.endpoint) as client:
        ns = client.open_namespace(LAYOUT, model_id="tiers")
        keys = ctxmem.chain_hashes(range(16 * 6), 16)
        ns.put(keys[1:5], blocks(4, LAYOUT.block_nbytes, 6))
        assert ns.tiers(keys) == ["", "dram", "dram", "dram", "dram", ""]
        assert ns.lookup(keys).num_hits == 0  # the prefix view: the first key is missing
        ns.evict(keys[1:3])
        assert ns.tiers(keys) == ["", "flash", "flash", "dram", "dram", ""]
        assert ns.exists(keys) == [t != "" for t in ns.tiers(keys)]
        ns.delete(keys[3:4])
        assert ns.tiers(keys[1:5]) == ["flash", "flash", "", "dram"]

        async def via_async() -> list[str]:
            return await ctxmem.AsyncNamespace(ns).tiers(keys[1:3])

        assert asyncio.run(via_async()) == ["flash", "flash"]


def test_channel_options_reach_the_grpc_channel(service: ServiceHandle,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``Client(channel_options=...)``: gRPC channel arguments merged over the defaults."""
    opts = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", 1 << 20)]
    with ctxmem.Client(service.endpoint, channel_options=opts) as client:
        assert client.channel_options == [
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 1 << 20),  # the caller's replaces the default
            ("grpc.use_local_subchannel_pool", 1),
        ]
        ns = client.open_namespace(LAYOUT, model_id="opts")
        keys = ctxmem.chain_hashes(range(16), 16)
        ns.put(keys, blocks(1, LAYOUT.block_nbytes, 7))
        assert ns.tiers(keys) == ["dram"]
    with pytest.raises(ctxmem.CtxmemError):  # the 1 MiB send limit is in force
        big = byte_layout(1 << 20)
        # The Lookup must go over gRPC, not the control fast path (shm or TCP)
        monkeypatch.setenv("CTXMEM_FAST_OPS", "0")
        with ctxmem.Client(service.endpoint, channel_options=opts, transport="tcp") as client:
            ns = client.open_namespace(big, model_id="opts-big")
            ns.lookup([bytes([i % 256]) * 32 + i.to_bytes(4, "big") for i in range(40_000)])


def test_weights_revision_separates_namespaces(service: ServiceHandle) -> None:
    """Issue 25, item 6: KV stored under one weights revision is never served to another
    under the same model id; a namespace without a revision keeps its digest."""
    from ctxmem_common.keys import namespace_digest

    keys = ctxmem.chain_hashes(range(16 * 4), 16)
    data = blocks(len(keys), LAYOUT.block_nbytes, 9)
    with ctxmem.Client(service.endpoint) as client:
        r1 = client.open_namespace(LAYOUT, model_id="m", weights_revision="sha256:aa")
        r1.put(keys, data)
        r2 = client.open_namespace(LAYOUT, model_id="m", weights_revision="sha256:bb")
        plain = client.open_namespace(LAYOUT, model_id="m")
        assert r2.lookup(keys).num_hits == 0
        assert plain.lookup(keys).num_hits == 0
        out = [np.zeros_like(d) for d in data]
        assert r2.get(keys, out) == 0 and plain.get(keys, out) == 0
        again = client.open_namespace(LAYOUT, model_id="m", weights_revision="sha256:aa")
        assert again.get(keys, out) == 4
        assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
        assert plain.digest == namespace_digest("default", "m", LAYOUT)
        assert r1.digest == namespace_digest("default", "m", LAYOUT, {}, "sha256:aa")
        assert len({plain.digest, r1.digest, r2.digest}) == 3
        with pytest.raises(ctxmem.InvalidArgument, match="weights_revision"):
            client.open_namespace(LAYOUT, model_id="m", weights_revision="x" * 257)
