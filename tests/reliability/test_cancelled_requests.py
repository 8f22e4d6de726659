"""A request cancelled while the store moves its blocks (a gRPC deadline passing, a client
going away) leaves nothing half done: the promotion or demotion it started runs to its
end (``IOPool.uncancellable``), so its blocks stay servable with their exact bytes, no
DRAM slot stays reserved for nobody, and no I/O thread writes into a slot or an extent
after it was given up (``IOPool.parallel`` raises only once every part has ended).

Before this, one cold Acquire cut by its client's deadline left its blocks marked in
flight for ever: every later get of them was a miss, and their DRAM slots were lost until
a restart (a client could do it on purpose)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from ctxmem_common.identity import SESSION_TOKEN_METADATA_KEY
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_dpu import faults
from ctxmem_dpu.store.context import IOPool
from ctxmem_dpu.store.demotion import Demotion
from ctxmem_tools.rawclient import RawSession
from tests.kit import read_until, read_until_async, until, until_async

from ..dpu.storekit import get, make_flash, open_store, payload, put, session, store_config
from .kit import BLOCK, LAYOUT, FaultyService, keys, served, settled_audit, tiers
from .kit import put as put_live

K = [bytes([i]) * 8 for i in range(1, 40)]


@pytest.fixture(autouse=True)
def _no_faults() -> Iterator[None]:
    faults.reset()
    yield
    faults.reset()


async def test_parallel_raises_only_once_every_part_has_ended() -> None:
    """One part fails at once while the other is still working on its jobs: the error
    reaches the caller only after that part returned (the callers free the slots the
    parts write into as soon as it raises)."""
    pool = IOPool(2)
    ended = threading.Event()

    def work(part: list[int]) -> list[int]:
        if part[0] == 0:
            raise OSError(5, "the first part fails at once")
        time.sleep(0.3)
        ended.set()
        return part

    try:
        with pytest.raises(OSError, match="fails at once"):
            await pool.parallel(work, [0, 1])
        assert ended.is_set(), "the error was raised while a part was still running"
    finally:
        pool.shutdown()


async def test_a_cancelled_cold_acquire_still_promotes_its_blocks(tmp_path: Path) -> None:
    """In process: cancel an Acquire of flash-only blocks while its device reads stall.
    The promotion completes in the background; the blocks are then served from DRAM with
    their bytes, nothing is leased or left in flight, and the flash allocators are sound."""
    store = await open_store(store_config(dram_size="8MiB"), make_flash(tmp_path / "f.img"))
    try:
        s, ns = session(store)
        blocks = {K[i]: payload(i + 1) for i in range(16)}
        await put(store, s, ns, blocks)
        assert await store.evict(ns, list(blocks), "dram") == 16
        faults.configure(devices={"*": {"delay_s": 0.05}})  # every device read stalls
        task = asyncio.ensure_future(store.acquire(s, ns, list(blocks)))
        await asyncio.sleep(0.02)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        faults.configure(devices={})
        per_ns = store._index.get(ns.digest)
        await until_async(lambda: all(per_ns[k].io is None for k in blocks), 10,
                          "the blocks' promotion to end (blocks left marked in flight)", 0.01)
        assert all(per_ns[k].dram is not None for k in blocks), "the promotion was cut short"
        assert all(per_ns[k].pins == 0 for k in blocks)
        assert store.stats()["leases"] == 0
        assert await get(store, s, ns, list(blocks)) == list(blocks.values())
        assert await settled_audit(store) == []
    finally:
        await store.close()


async def test_a_cancelled_evict_still_makes_its_blocks_durable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In process: cancel an Evict while its device writes stall (the background demoter
    kept idle, so the Evict's own demotion is the one cut). The demotion completes: the
    blocks are on flash and durable, still served with their bytes, and the flash
    allocators are sound (no extent given up while a write into it was in flight)."""
    async def no_background_demoter(self: Demotion) -> None:
        return None

    monkeypatch.setattr(Demotion, "run", no_background_demoter)
    store = await open_store(store_config(dram_size="8MiB"), make_flash(tmp_path / "f.img"))
    try:
        s, ns = session(store)
        blocks = {K[20 + i]: payload(40 + i) for i in range(8)}
        await put(store, s, ns, blocks)
        per_ns = store._index.get(ns.digest)
        assert all(per_ns[k].flash is None for k in blocks)  # dirty: only in DRAM
        faults.configure(devices={"*": {"delay_s": 0.05}})  # every device write stalls
        task = asyncio.ensure_future(store.evict(ns, list(blocks), "dram"))
        await asyncio.sleep(0.02)
        assert any(per_ns[k].io is not None for k in blocks), "no demotion in flight"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        faults.configure(devices={})
        await until_async(lambda: all(per_ns[k].io is None for k in blocks), 10,
                          "the cancelled Evict's demotion to end", 0.01)
        assert all(per_ns[k].flash is not None and per_ns[k].durable for k in blocks), \
            "the cancelled Evict's demotion was cut short"
        assert await get(store, s, ns, list(blocks)) == list(blocks.values())
        assert await settled_audit(store) == []
    finally:
        await store.close()


def test_a_client_deadline_on_a_cold_acquire_leaves_the_blocks_servable(
        tmp_path: Path) -> None:
    """End to end: a raw client's Acquire of flash-only blocks hits its gRPC deadline
    while the device reads stall (the service's handler is cancelled). Afterwards every
    block is served with its exact bytes, no lease is held, and the DRAM in use is the
    blocks the promotion brought in, none reserved for nobody."""
    svc = FaultyService(tmp_path / "svc", dram_size="8MiB")
    svc.start()
    try:
        ns = svc.ns()
        ks = keys("cancelled", 24)
        put_live(ns, ks)
        assert ns.evict(ks) == 24
        assert set(tiers(ns, ks)) == {"flash"}
        svc.faults(devices={"*": {"delay_s": 0.05}})
        with RawSession(svc.endpoint, LAYOUT, tenant="t", model_id="rel") as raw:
            md = ((SESSION_TOKEN_METADATA_KEY, raw.token),)
            with pytest.raises(grpc.RpcError) as exc:
                raw.stub.Acquire(pb.AcquireRequest(session_id=raw.session_id,
                                                   namespace_handle=raw.handle, keys=ks),
                                 timeout=0.05, metadata=md)
            assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        svc.faults()
        # The cancelled request's promotion ends in the background (bounded; the gets
        # below say whether it did).
        read_until(lambda: set(tiers(ns, ks)), lambda t: t == {"dram"}, 10, 0.02)
        assert all(served(ns, ks).values()), "blocks of the cancelled Acquire are misses"
        st = svc.stats()
        assert st["leases"] == 0
        assert st["dram_used_bytes"] == st["blocks_dram"] * BLOCK, \
            "DRAM slots stayed reserved for blocks that are not in DRAM"
    finally:
        svc.close()


def test_cancelled_deletes_log_no_traceback(tmp_path: Path) -> None:
    """End to end, the service's log: Deletes whose gRPC deadline passes while the store
    works (a stall at ``delete.after_index`` longer than the deadline: the handler is
    cancelled), then Deletes on a slow device with deadlines around the time they take,
    so some answers are sent just as their call ends (gRPC's core then fails the send:
    before, an ``ExecuteBatchError`` traceback at ERROR). The stalled Delete and every
    acknowledged one take effect (a call whose deadline passed before the service read
    it may not run at all), and the log has no traceback; a call that ended before its
    answer is one INFO line at most (``ctxmem_dpu.grpclog``)."""
    svc = FaultyService(tmp_path / "svc", dram_size="8MiB")
    svc.start()
    try:
        ns = svc.ns()
        ks = keys("cancelled-delete", 64)
        put_live(ns, ks)
        assert ns.evict(ks) == 64
        codes: dict[str, int] = {}
        deleted = ks[:4]  # the stalled Delete's, and each acknowledged one's
        with RawSession(svc.endpoint, LAYOUT, tenant="t", model_id="rel") as raw:
            md = ((SESSION_TOKEN_METADATA_KEY, raw.token),)

            def delete(batch: list[bytes], timeout: float) -> None:
                try:
                    raw.stub.Delete(pb.DeleteRequest(session_id=raw.session_id,
                                                     namespace_handle=raw.handle,
                                                     keys=batch), timeout=timeout, metadata=md)
                    codes["OK"] = codes.get("OK", 0) + 1
                    deleted.extend(batch)
                except grpc.RpcError as exc:
                    codes[exc.code().name] = codes.get(exc.code().name, 0) + 1

            svc.faults(points="delete.after_index:sleep=0.5@1")
            delete(ks[:4], 0.1)
            assert codes == {"DEADLINE_EXCEEDED": 1}
            svc.faults(devices={"*": {"delay_s": 0.002}})
            for i in range(4, 64, 2):
                delete(ks[i:i + 2], 0.002 + 0.001 * (i % 16))
        svc.faults()
        assert codes.get("DEADLINE_EXCEEDED", 0) >= 2, codes
        # Cancelled Deletes finish in the background.
        until(lambda: not any(served(ns, deleted).values()), 10, "every Delete to take effect")
    finally:
        svc.close()
    log = svc.log_path.read_text(errors="replace")
    assert "store work finished after its request was cancelled" in log
    assert "Traceback" not in log and "ExecuteBatchError" not in log, log[-4000:]


async def test_a_cancelled_delete_still_invalidates_and_frees_its_extents(
        tmp_path: Path) -> None:
    """In process: cancel a Delete of flash blocks while its header writes stall. The
    blocks are gone from the index at once; their headers are still zeroed and their
    extents freed (the flash allocators are sound, nothing leaked)."""
    store = await open_store(store_config(dram_size="8MiB"), make_flash(tmp_path / "f.img"))
    try:
        s, ns = session(store)
        blocks = {K[30 + i]: payload(60 + i) for i in range(6)}
        await put(store, s, ns, blocks)
        assert await store.evict(ns, list(blocks), "dram") == 6
        faults.configure(devices={"*": {"delay_s": 0.05}})
        task = asyncio.ensure_future(store.delete(ns, list(blocks)))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        faults.configure(devices={})
        assert await get(store, s, ns, list(blocks)) == []
        assert await settled_audit(store) == [], "the cancelled Delete leaked its extents"
    finally:
        await store.close()


@pytest.mark.parametrize(("seed", "policy"), [(1, "write_back"), (2, "write_back"),
                                              (3, "write_through"), (4, "write_through")])
async def test_requests_cancelled_at_random_moments_leave_the_store_sound(
        tmp_path: Path, seed: int, policy: str) -> None:
    """Puts, cold and warm Acquires, Evicts and Deletes of random key sets, each cancelled
    after a random delay (0 to 20 ms) while the device stalls 0, 2 or 10 ms per I/O,
    write-back and write-through. No Acquire ever sees a wrong byte; afterwards no block
    is in flight or pinned, no lease is left, the flash allocators are sound, the DRAM in
    use is the indexed blocks' (none reserved for nobody), and every key is either served
    exact or not indexed at all."""
    import random

    rng = random.Random(seed)
    store = await open_store(store_config(dram_size="8MiB", write_policy=policy),
                             make_flash(tmp_path / "f.img"))
    try:
        s, ns = session(store)
        data = {K[i]: payload(100 + i) for i in range(len(K))}
        wrong: list[bytes] = []

        async def one(op: str, ks: list[bytes]) -> None:
            if op == "put":
                await put(store, s, ns, {k: data[k] for k in ks})
            elif op == "acquire":
                lease, _ = await store.acquire(s, ns, ks)
                try:
                    wrong.extend(b.key for b in lease.blocks if b.dram is None
                                 or bytes(store.dram.view(b.dram, b.length)) != data[b.key])
                finally:
                    store.release(s, [lease.id])
            elif op == "evict":
                await store.evict(ns, ks, "dram")
            else:
                await store.delete(ns, ks)

        for _ in range(60):
            faults.configure(devices={"*": {"delay_s": rng.choice([0, 0.002, 0.01])}})
            op = rng.choice(["put", "put", "acquire", "evict", "delete"])
            task = asyncio.ensure_future(one(op, rng.sample(K, rng.randint(1, 12))))
            await asyncio.sleep(rng.choice([0, 0.001, 0.005, 0.02]))
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        faults.configure(devices={})
        assert wrong == [], "an Acquire saw wrong bytes"
        assert await settled_audit(store) == []
        per_ns = store._index.get(ns.digest)

        def in_flight() -> tuple[list[str], list[object]]:
            """Blocks left in flight or pinned, and store tasks still running."""
            return ([k.hex() for k, b in per_ns.items() if b.io is not None or b.pins],
                    [t for t in store._ctx.io.tasks if not t.done()])
        # Cancelled work and the demoter still finishing (bounded).
        stuck, running = await read_until_async(in_flight, lambda got: not any(got), 10, 0.01)
        assert running == [], "cancelled store work still running after 10 s"
        assert stuck == [], "blocks left in flight or pinned"
        st = store.stats()
        assert st["leases"] == 0
        # A put cancelled between its Allocate and its Commit leaves its allocation open
        # until the allocation TTL, as a client that died there does; nothing else holds
        # DRAM but the indexed blocks.
        open_slots = sum(len(a.slots) for a in store._registry.allocations.values())
        committing = [a.id.hex() for a in store._registry.allocations.values() if a.done]
        assert committing == [], "allocations left half committed"
        in_dram = sum(1 for b in per_ns.values() if b.dram is not None)
        assert st["dram_used_bytes"] == (in_dram + open_slots) * ns.slot_size, \
            "DRAM slots held by no indexed block and no open allocation"
        for k, b in list(per_ns.items()):
            assert await get(store, s, ns, [k]) == [data[k]], \
                f"{k.hex()} is indexed (dram={b.dram}, flash={b.flash}) but not served"
    finally:
        await store.close()
