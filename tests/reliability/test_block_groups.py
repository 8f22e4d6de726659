"""Block groups (issue 29, item 1): a key's blocks in every member namespace of a group are
committed, counted and loaded as one unit, against the real service process.

Each case leaves one member of a group without a servable block (a crash between the
members' commits, one member corrupt on flash, one member evicted under pressure) and
checks that the group is a whole miss from that key on: Lookup's count, the get's count,
never a part of it. The pod case (one member's holder dies) is in
tests/pod/test_pod_groups.py.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np

import ctxmem
from ctxmem_common.config import load_config
from ctxmem_common.flash_format import FlashReader, payload_offset
from tests.kit import byte_layout, until

from .kit import FaultyService, keys, patch_file

# Two members of different geometry, as a hybrid model's KV and state pools are.
KV = byte_layout(16 << 10)
STATE = byte_layout(4 << 10)


def _data(ks: list[bytes], nbytes: int, salt: int) -> list[np.ndarray]:
    return [np.random.default_rng([salt, int.from_bytes(k[:8], "little")])
            .integers(0, 256, nbytes, dtype=np.uint8) for k in ks]


class Group:
    """The two members' namespaces and the group over them, with content-addressed data."""

    def __init__(self, svc: FaultyService) -> None:
        if svc.client is None:
            svc.ns()  # opens the client
        assert svc.client is not None
        self.client = svc.client
        self.kv = self.client.open_namespace(KV, model_id="hybrid", tenant="t",
                                             tags={"pool": "kv"})
        self.state = self.client.open_namespace(STATE, model_id="hybrid", tenant="t",
                                                tags={"pool": "mamba"})
        self.group = self.client.open_group([self.kv, self.state])

    def data(self, ks: list[bytes]) -> list[list[np.ndarray]]:
        return [_data(ks, KV.block_nbytes, 1), _data(ks, STATE.block_nbytes, 2)]

    def put(self, ks: list[bytes]) -> ctxmem.PutResult:
        return self.group.put(ks, self.data(ks))

    def get(self, ks: list[bytes]) -> int:
        """Group get; every member's delivered block is checked byte for byte."""
        out = [[np.zeros(KV.block_nbytes, np.uint8) for _ in ks],
               [np.zeros(STATE.block_nbytes, np.uint8) for _ in ks]]
        n = self.group.get(ks, out)
        for member, want in zip(out, self.data(ks), strict=True):
            for i in range(n):
                assert np.array_equal(member[i], want[i]), f"member block {i}: wrong bytes"
        return n

    def hits(self, ks: list[bytes]) -> int:
        return self.group.lookup(ks).num_hits


def _service(tmp_path: Path, **config: object) -> FaultyService:
    svc = FaultyService(tmp_path / "svc", **config)  # type: ignore[arg-type]
    svc.start()
    return svc


def test_a_group_round_trips_and_one_member_missing_is_a_whole_miss(tmp_path: Path) -> None:
    svc = _service(tmp_path)
    try:
        g = Group(svc)
        ks = keys("rt", 6)
        r = g.put(ks)
        assert (r.stored, r.existing) == (12, 0)  # every member's block
        assert g.hits(ks) == 6 and g.get(ks) == 6
        assert g.group.lookup(ks).tiers == ["dram"] * 6
        assert asyncio.run(ctxmem.AsyncNamespaceGroup(g.group).lookup(ks)).num_hits == 6
        # A key whose state block alone is deleted: the group ends there, in every member,
        # and the service reclaims the KV member's block of it (never a group hit again).
        assert g.state.delete([ks[3]]) == 1
        assert g.hits(ks) == 3 and g.get(ks) == 3
        until(lambda: g.kv.exists(ks) == [True, True, True, False, True, True], 10,
              "the KV member of the deleted state block to be reclaimed", 0.02)
        assert svc.stats()["group_members_reclaimed"] == 1
        # Put again: the group is whole.
        r = g.put(ks)
        assert (r.stored, r.existing) == (2, 10)
        assert g.hits(ks) == 6 and g.get(ks) == 6
        g.group.delete(ks[4:])
        assert g.kv.exists(ks[4:]) == g.state.exists(ks[4:]) == [False, False]
        assert g.hits(ks) == 4
        g.put(ks)
        # A group of one namespace is that namespace, exactly as before.
        one = g.client.open_group([g.kv])
        assert one.lookup(ks).num_hits == g.kv.lookup(ks).num_hits == 6
        bufs = [[np.zeros(KV.block_nbytes, np.uint8) for _ in ks]]
        assert one.get(ks, bufs) == 6
        assert all(np.array_equal(a, b) for a, b in zip(bufs[0], g.data(ks)[0], strict=True))
        assert svc.stats()["group_commits"] >= 2
    finally:
        svc.close()


def test_a_client_crc_mismatch_in_one_member_stores_the_key_in_none(tmp_path: Path) -> None:
    """The group Commit checks every member before any block is visible: a member's block
    whose CRC32C differs from the client's keeps its key out of every member."""
    svc = _service(tmp_path)
    try:
        g = Group(svc)
        ks = keys("crc", 3)
        s = g.group._open()
        rpc = g.client._rpc
        from ctxmem_common.proto import ctxmem_pb2 as pb

        allocs = [rpc("Allocate", pb.AllocateRequest(session_id=s.id, namespace_handle=m.handle,
                                                     keys=ks)) for m in g.group.members]
        crcs = [s.channel.write_crc(a.allocation_id, a.slots, [memoryview(b) for b in d])
                for a, d in zip(allocs, g.data(ks), strict=True)]
        crcs[1][1] ^= 1  # the state block of ks[1] "was not what the client wrote"
        c = rpc("Commit", pb.CommitRequest(
            session_id=s.id, allocation_id=allocs[0].allocation_id, crc32c=crcs[0],
            group_allocation_ids=[allocs[1].allocation_id], group_crc32c=crcs[1]))
        assert c.committed == 4  # ks[0] and ks[2] in both members; ks[1] in neither
        assert g.kv.exists(ks) == [True, False, True]
        assert g.state.exists(ks) == [True, False, True]
        assert g.hits(ks) == 1 and g.get(ks) == 1
    finally:
        svc.close()


def test_a_crash_between_the_members_commits_leaves_a_whole_miss(tmp_path: Path) -> None:
    """Write-through: the KV member is durable on flash when the service is killed
    (kill -9 at ``commit.group_between_members``), the state member never written. After
    the restart the KV blocks are back on flash, and the group is a whole miss."""
    svc = _service(tmp_path, write_policy="write_through")
    try:
        g = Group(svc)
        ks = keys("crash", 4)
        svc.faults("commit.group_between_members:kill")
        try:
            g.put(ks)
            raise AssertionError("the group put was answered; the service should have died")
        except ctxmem.CtxmemError:
            pass
        assert svc.wait_dead(), "the fault point did not kill the service"
        svc.start()
        g = Group(svc)
        # The crash came between the members: the KV member's records are durable.
        assert g.kv.tiers(ks) == ["flash"] * 4
        assert g.state.tiers(ks) == [""] * 4
        assert g.hits(ks) == 0 and g.get(ks) == 0  # never a part of the group
        # The group can be stored again, whole.
        g.put(ks)
        assert g.hits(ks) == 4 and g.get(ks) == 4
    finally:
        svc.close()


def test_write_back_a_crash_with_one_member_durable_is_a_whole_miss(tmp_path: Path) -> None:
    """Write-back: the demoter writes the group's blocks in batches of 3, oldest first, a
    key's members side by side (KV 0, state 0, KV 1 | state 1, KV 2, state 2 | ...); the
    service is killed (kill -9) in the second batch, its payloads written but no header.
    After the restart key 0 is whole on flash; key 1 has only its KV member durable (its
    state was lost with DRAM): the group is a whole miss from key 1."""
    svc = _service(tmp_path, flash={"demote_batch": 3, "demote_batch_bytes": 0})
    try:
        g = Group(svc)
        ks = keys("wb", 4)
        svc.faults("demote.after_payload:kill@2")
        g.put(ks)
        assert svc.wait_dead(), "the demoter did not reach its second batch"
        svc.start()
        g = Group(svc)
        assert g.kv.tiers(ks) == ["flash", "flash", "", ""]
        assert g.state.tiers(ks) == ["flash", "", "", ""]
        assert g.hits(ks) == 1 and g.get(ks) == 1
    finally:
        svc.close()


def _corrupt_payload(svc: FaultyService, ns_digest: bytes, key: bytes) -> None:
    """Flip a byte of ``key``'s record payload in namespace ``ns_digest`` on flash."""
    cfg = load_config(svc.config_path)
    for dev in cfg.flash.devices:
        fd = os.open(dev.path, os.O_RDONLY)
        try:
            reader = FlashReader(fd)
            sb = reader.superblocks().current
            assert sb is not None
            for scan in reader.walk(sb):
                cols = scan.records
                for slot, ns, k in zip(cols.slot, cols.namespace, cols.key, strict=True):
                    if ns == ns_digest and k == key:
                        off = payload_offset(scan.slab, slot, sb.slab_size, scan.slot_size)
                        byte = os.pread(fd, 1, off + 100)[0]
                        patch_file(dev.path, off + 100, bytes([byte ^ 0x40]))
                        return
        finally:
            os.close(fd)
    raise AssertionError(f"no record of key {key.hex()[:16]} on flash")


def test_one_member_corrupt_on_flash_is_a_whole_miss(tmp_path: Path) -> None:
    svc = _service(tmp_path)
    try:
        g = Group(svc)
        ks = keys("corrupt", 4)
        g.put(ks)
        assert g.kv.evict(ks) == 4 and g.state.evict(ks) == 4  # both on flash only
        digest = g.state.digest
        svc.close()  # a clean stop: every record durable
        _corrupt_payload(svc, digest, ks[2])
        svc.start()
        g = Group(svc)
        assert g.hits(ks) == 4  # Lookup reads the index only: the damage is found on read
        before = svc.stats()["integrity_failures"]
        assert g.get(ks) == 2  # the state block of ks[2] fails: the group ends there
        assert svc.stats()["integrity_failures"] == before + 1
        assert g.hits(ks) == 2  # dropped from the index: now a miss for Lookup too
        assert svc.stats()["group_partial_misses"] >= 1
        # The KV member of ks[2] is intact, but never again part of a group hit: reclaimed.
        until(lambda: g.kv.exists(ks) == [True, True, False, True], 10,
              "the KV member of the corrupt state block to be reclaimed", 0.02)
    finally:
        svc.close()


def test_one_member_evicted_under_pressure_is_a_whole_miss(tmp_path: Path) -> None:
    """No flash: DRAM eviction drops blocks. Every KV block and the first four state
    blocks are read (recent); the last four state blocks are the coldest. Other puts into
    the state namespace, two blocks at a time, then evict the coldest state blocks: the
    group is a whole miss from the first key whose state block went, and the KV blocks of
    those keys are reclaimed."""
    svc = _service(tmp_path, flash_size=None, dram_size="4MiB", dram_slab="1MiB")
    try:
        g = Group(svc)
        ks = keys("evict", 8)
        g.put(ks)
        out = [np.zeros(KV.block_nbytes, np.uint8) for _ in ks]
        assert g.kv.get(ks, out) == 8
        out = [np.zeros(STATE.block_nbytes, np.uint8) for _ in ks[:4]]
        assert g.state.get(ks[:4], out) == 4
        # DRAM slabs belong to one namespace: the pressure is other keys of the state
        # member's namespace (plain puts), so its own slab's coldest blocks go.
        for at in range(0, 2048, 2):
            fk = keys("fill", 2, at)
            g.state.put(fk, _data(fk, STATE.block_nbytes, 3))
            if not all(g.state.exists(ks)):
                break
        state_has = g.state.exists(ks)
        assert state_has == [True] * 4 + [False] * 2 + [True] * 2, state_has
        assert g.hits(ks) == 4 and g.get(ks) == 4
        # The KV blocks of the keys whose state block went are reclaimed, the others kept.
        until(lambda: g.kv.exists(ks) == state_has, 10,
              "the KV members of the evicted state blocks to be reclaimed", 0.02)
        assert svc.stats()["group_members_reclaimed"] == 2
    finally:
        svc.close()


def _nothing_stored(svc: FaultyService, g: Group, ks: list[bytes]) -> None:
    """Neither member holds any of ``ks``, and the members' records already written are
    gone from flash too (their headers zeroed, the space given back)."""
    assert g.kv.tiers(ks) == [""] * len(ks) and g.state.tiers(ks) == [""] * len(ks)
    assert g.hits(ks) == 0 and g.get(ks) == 0
    svc.wait_stat("flash_used_bytes", 0)
    report = svc.check()
    assert report.errors == 0, [p for d in report.devices for p in d.problems]


def test_a_failure_between_the_members_stores_the_group_in_none(tmp_path: Path) -> None:
    """Write-through: the KV member is durable when the commit fails before the state
    member is written (``eio`` at ``commit.group_between_members``): the Commit fails and
    the KV member's records are dropped with the rest, nothing is leaked."""
    svc = _service(tmp_path, write_policy="write_through")
    try:
        g = Group(svc)
        ks = keys("eio", 3)
        svc.faults("commit.group_between_members:eio")
        try:
            g.put(ks)
            raise AssertionError("the group put succeeded through an I/O error")
        except ctxmem.CtxmemError:
            pass
        svc.faults("")
        _nothing_stored(svc, g, ks)
        g.put(ks)
        assert g.get(ks) == 3
    finally:
        svc.close()


def test_one_members_failed_flash_write_stores_the_key_in_none(tmp_path: Path) -> None:
    """Write-through: the state member's flash writes fail (EIO) after the KV member's
    records are durable. The keys are stored in no member; the KV records are dropped."""
    import threading

    svc = _service(tmp_path, write_policy="write_through")
    try:
        g = Group(svc)
        ks = keys("wfail", 3)
        # The commit waits at the point between the members while the device starts
        # failing writes; the KV member is durable by then.
        svc.faults("commit.group_between_members:sleep=3")
        raised: list[BaseException] = []

        def put() -> None:
            try:
                g.put(ks)
            except BaseException as exc:  # checked below
                raised.append(exc)

        t = threading.Thread(target=put)
        t.start()
        assert svc.wait_injected("point:sleep", timeout=20) == 1
        svc.faults("", devices={"*": {"write": "eio", "count": 1000}})
        t.join(30)
        assert not t.is_alive()
        assert raised and isinstance(raised[0], ctxmem.Unavailable), raised
        svc.faults("", devices={"*": {}})
        _nothing_stored(svc, g, ks)
    finally:
        svc.close()


def test_malformed_group_requests_are_refused(tmp_path: Path) -> None:
    """A namespace named twice (or the request's own), too many members, a group Commit
    whose CRCs do not add up: InvalidArgument, nothing committed; the shim refuses a group
    of one namespace twice or of two tenants before asking."""
    from ctxmem_common.proto import ctxmem_pb2 as pb

    svc = _service(tmp_path)
    try:
        g = Group(svc)
        ks = keys("bad", 2)
        s = g.group._open()
        rpc = g.client._rpc
        h0, h1 = g.kv.handle, g.state.handle
        for handles in ([h0], [h1, h1], [h1] * 64):
            for name, req in (
                    ("Lookup", pb.LookupRequest(session_id=s.id, namespace_handle=h0, keys=ks,
                                                prefix=True, group_namespace_handles=handles)),
                    ("Acquire", pb.AcquireRequest(session_id=s.id, namespace_handle=h0,
                                                  keys=ks, group_namespace_handles=handles))):
                try:
                    rpc(name, req)
                    raise AssertionError(f"{name} with group {handles[:3]} was answered")
                except ctxmem.InvalidArgument:
                    pass
        allocs = [rpc("Allocate", pb.AllocateRequest(session_id=s.id, namespace_handle=h,
                                                     keys=ks)) for h in (h0, h1)]
        crcs = [s.channel.write_crc(a.allocation_id, a.slots, [memoryview(b) for b in d])
                for a, d in zip(allocs, g.data(ks), strict=True)]
        try:
            rpc("Commit", pb.CommitRequest(
                session_id=s.id, allocation_id=allocs[0].allocation_id, crc32c=crcs[0],
                group_allocation_ids=[allocs[1].allocation_id], group_crc32c=crcs[1][:1]))
            raise AssertionError("a group Commit short of CRCs was answered")
        except ctxmem.InvalidArgument:
            pass
        assert g.kv.exists(ks) == g.state.exists(ks) == [False, False]
        # The allocations are still open: the same Commit, complete, stores the group.
        c = rpc("Commit", pb.CommitRequest(
            session_id=s.id, allocation_id=allocs[0].allocation_id, crc32c=crcs[0],
            group_allocation_ids=[allocs[1].allocation_id], group_crc32c=crcs[1]))
        assert c.committed == 4 and g.get(ks) == 2
        for members in ([g.kv, g.kv], []):
            try:
                g.client.open_group(members)
                raise AssertionError(f"a group of {len(members)} was made")
            except ctxmem.InvalidArgument:
                pass
        other = g.client.open_namespace(STATE, model_id="hybrid", tenant="u")
        try:
            g.client.open_group([g.kv, other])
            raise AssertionError("a group across tenants was made")
        except ctxmem.InvalidArgument:
            pass
    finally:
        svc.close()
