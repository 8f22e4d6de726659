"""kill -9 (and power cuts) at every named fault point of put, commit, demote, evict, flash
eviction, delete, promote and the rebuild, against the real service process.

After each crash and restart: every block that was durable before the operation is served
byte for byte; a block of the interrupted operation is either served exactly or absent,
and if the index shows it, it is servable (nothing torn or half-written is visible);
acknowledged deletes stay deleted; ``ctxmem check`` finds no error on the devices; the
service's used flash space equals the space of the valid records (no leak); and new writes
after the restart do not clobber any old block (no extent handed out twice).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ctxmem_dpu.faults import POINTS

from .kit import FaultyService, keys, put, served, tiers

OPS: dict[str, list[str]] = {
    "put": ["allocate.after_reserve:kill"],
    "commit": ["commit.after_crc:kill", "commit.after_index:kill"],
    "demote": ["demote.before_write:kill", "demote.after_payload:kill",
               "demote.after_payload_sync:kill", "demote.after_header:kill",
               "demote.after_sync:kill", "demote.after_payload:powercut",
               "demote.after_payload_sync:powercut", "demote.after_header:powercut",
               "demote.after_sync:powercut"],
    "evict": ["evict.after_demote:kill"],
    "flash_evict": ["flash_evict.after_zero:kill", "flash_evict.after_sync:kill",
                    "flash_evict.after_zero:powercut"],
    "delete": ["delete.after_index:kill", "delete.after_zero:kill", "delete.after_sync:kill",
               "delete.after_zero:powercut"],
    "promote": ["promote.after_read:kill"],
}


def test_every_named_point_is_covered() -> None:
    armed = {spec.split(":")[0] for specs in OPS.values() for spec in specs}
    # The connect.* points are slept at, not crashed at (tests/adversary/test_sessions.py);
    # a block group's commit is crashed at in tests/reliability/test_block_groups.py; the
    # pod heartbeat is failed with eio in tests/dpu/pod/test_index_outage.py.
    assert armed | {"rebuild.after_scan", "connect.before_session",
                    "connect.after_session", "commit.group_between_members",
                    "lease.before_beat"} == set(POINTS)


def _verify_after_restart(svc: FaultyService, durable: list[bytes], cut: list[bytes],
                          deleted: list[bytes]) -> None:
    ns = svc.ns()
    got = served(ns, durable)
    lost = [k.hex()[:8] for k, ok in got.items() if not ok]
    assert not lost, f"durable blocks lost: {lost}"
    # The interrupted operation's blocks: absent, or (if the index shows them) servable.
    shown = tiers(ns, cut)
    got_cut = served(ns, cut)
    for k, tier in zip(cut, shown, strict=True):
        assert not tier or got_cut[k], f"block {k.hex()[:8]} is visible but not servable"
    assert not any(served(ns, deleted).values()), "an acknowledged delete came back"
    report = svc.check()
    assert report.errors == 0, [p for d in report.devices for p in d.problems]
    st = svc.stats()
    assert st["flash_used_bytes"] == sum(d.used_bytes for d in report.devices), "space leak"


def _no_double_allocation(svc: FaultyService, durable: list[bytes], tag: str) -> None:
    ns = svc.ns()
    fresh = keys(tag, 24)
    put(ns, fresh)
    assert ns.evict(fresh) == len(fresh)
    got = served(ns, durable + fresh)
    assert all(got.values())


@pytest.mark.parametrize("op", sorted(OPS))
def test_crash_at_each_point_of(op: str, tmp_path: Path) -> None:
    small = op == "flash_evict"  # flash eviction needs a full flash tier
    svc = FaultyService(tmp_path / "svc", flash_size="9MiB" if small else "48MiB",
                        flash_slab="1MiB" if small else "4MiB")
    svc.start()
    try:
        ns = svc.ns()
        durable = keys(f"{op}/base", 404 if small else 48)  # 408 slots: the cut must evict
        for i in range(0, len(durable), 48):
            put(ns, durable[i:i + 48])
            assert ns.evict(durable[i:i + 48]) == len(durable[i:i + 48])
        deleted: list[bytes] = []
        for n, spec in enumerate(OPS[op]):
            # (Flash eviction: each cut outgrows the space the previous one freed.)
            cut = keys(f"{op}/{n}", 48 * (n + 1) if small else 8)
            must = durable
            svc.faults(points=spec)
            try:
                if op in ("put", "commit"):
                    put(ns, cut)
                elif op in ("demote", "evict"):
                    put(ns, cut)
                    ns.evict(cut)
                elif op == "flash_evict":
                    # The newest base blocks are never the LRU victims of one batch.
                    must = durable[-64:]
                    put(ns, cut)
                    ns.evict(cut)
                elif op == "delete":
                    cut = durable[:4]
                    durable = durable[4:]
                    must = durable
                    ns.delete(cut)
                elif op == "promote":
                    assert ns.evict(durable) >= 0
                    served(ns, durable[:8])
            except Exception:  # the service died under the call
                pass
            assert svc.wait_dead(), f"{spec}: the service did not die at the point"
            svc.restart()
            ns = svc.ns()
            _verify_after_restart(svc, must, cut, deleted)
            if op == "flash_evict":
                durable = [k for k, ok in served(ns, durable).items() if ok]
            if op == "delete":
                # Not acknowledged, so either outcome is fine; delete for real now.
                ns.delete(cut)
                deleted += cut
        _no_double_allocation(svc, durable[-64:] if small else durable, f"{op}/after")
    finally:
        svc.close()


def test_crash_during_the_rebuild_itself(tmp_path: Path) -> None:
    svc = FaultyService(tmp_path / "svc")
    svc.start()
    try:
        ns = svc.ns()
        durable = keys("rebuild", 40)
        put(ns, durable)
        assert ns.evict(durable) == 40
        svc.kill()
        with pytest.raises(RuntimeError, match="status -9"):
            svc.start(env={"CTXMEM_FAULTS": "rebuild.after_scan:kill"})
        svc.start()
        _verify_after_restart(svc, durable, [], [])
    finally:
        svc.close()


def test_kill_loses_only_blocks_not_yet_durable(tmp_path: Path) -> None:
    """Write-back blocks still in DRAM at a kill -9 may be lost; durable ones never."""
    svc = FaultyService(tmp_path / "svc")
    svc.start()
    try:
        ns = svc.ns()
        durable = keys("wb/durable", 32)
        put(ns, durable)
        assert ns.evict(durable) == 32
        svc.faults(points="demote.before_write:eio@1+")  # the demoter never gets through
        pending = keys("wb/pending", 16)
        put(ns, pending)
        assert set(tiers(ns, pending)) == {"dram"}
        svc.kill()
        svc.start()
        ns = svc.ns()
        assert all(served(ns, durable).values())
        assert not any(tiers(ns, pending))  # lost, as allowed: never durable
        assert svc.stats()["recovered_blocks"] == 32
    finally:
        svc.close()


def test_stale_session_ids_never_alias_another_tenant_after_a_restart(tmp_path: Path) -> None:
    """Session ids restarted at 1 after a restart, so a tenant's stale id could name
    another tenant's new session (and read its namespace). Found by ``ctxmem chaos``."""
    from ctxmem_common.errors import UnknownSession
    from ctxmem_common.proto import ctxmem_pb2 as pb

    svc = FaultyService(tmp_path / "svc")
    svc.start()
    try:
        b = svc.ns("bob")  # bob's session is the instance's first...
        old_b = b._open()
        a = svc.ns("alice")
        put(a, keys("alice", 4))
        assert a.evict(keys("alice", 4)) == 4
        svc.kill()
        svc.start()
        a2 = svc.ns("alice")  # ...and after the restart alice's is
        put(a2, keys("alice2", 1))
        new_a = a2._open()
        assert new_a.id != old_b.id
        assert svc.client is not None
        with pytest.raises(UnknownSession):
            svc.client._rpc("Lookup", pb.LookupRequest(
                session_id=old_b.id, namespace_handle=1, keys=keys("alice", 4)))
        assert served(b, keys("alice", 4)) == dict.fromkeys(keys("alice", 4), False)
        assert all(served(a2, keys("alice", 4)).values())
    finally:
        svc.close()
