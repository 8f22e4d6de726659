"""``store/recovery.py``: the index rebuilt from the flash file's self-describing records,
exactly (which keys, which extents, in which order, the next sequence number), the newer of
two records of one key kept and the older's header zeroed and extent freed, and the audit
naming a leaked extent. Records written by the real demotion in one set of parts
(``parts.py``), read back by a fresh set over the same file, as a restart does."""

from __future__ import annotations

from pathlib import Path

from ctxmem_dpu.keyring import Keyring
from ctxmem_dpu.store.recovery import Recovery, audit

from ..storekit import MASTER
from .parts import Parts, keys_of, parts


def _recovery(p: Parts) -> Recovery:
    return Recovery(p.ctx, p.index, p.invalidator, Keyring(MASTER))


async def test_the_rebuild_indexes_every_record_in_flash_order(tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img") as before:
        before.session("a")
        ns = before.namespace("a")
        blocks = before.put(ns, "a", 6, dirty=True)
        assert await before.demotion().demote(blocks) == {}
        written = [(b.ns, b.key, b.crc, b.seq, b.flash) for b in blocks]
    with parts(flash_file=tmp_path / "f.img") as p:
        await _recovery(p).rebuild()
        got = p.index.namespace(ns.digest)
        assert [(b.ns, b.key, b.crc, b.seq, b.flash) for b in got.values()] == written
        assert all(b.durable and b.dram is None for b in got.values())
        assert keys_of(p.index.flash_lru.order()) == keys_of(blocks)
        assert p.ctx.counters["recovered_blocks"] == 6
        assert p.index.next_seq() == blocks[-1].seq + 1
        assert audit(p.ctx, p.index, p.invalidator) == []


async def test_the_newer_record_of_a_key_wins_and_the_older_is_freed(tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img") as before:
        before.session("a")
        ns = before.namespace("a")
        old = before.put(ns, "a", 2, dirty=True)
        new = before.put(ns, "a", 1, dirty=True)  # key 0 again, a higher sequence number
        assert new[0].key == old[0].key and new[0].seq > old[0].seq
        assert await before.demotion().demote(old + new) == {}
        stale = old[0].flash
    with parts(flash_file=tmp_path / "f.img") as p:
        await _recovery(p).rebuild()
        got = p.index.namespace(ns.digest)
        assert [(b.key, b.seq, b.flash) for b in got.values()] == \
            [(new[0].key, new[0].seq, new[0].flash), (old[1].key, old[1].seq, old[1].flash)]
        assert stale is not None and p.ctx.flash.devices[0].read_header(stale.slot) is None
        assert p.ctx.flash.used_bytes() == 2 * old[0].slot_size
        assert audit(p.ctx, p.index, p.invalidator) == []


async def test_the_audit_names_an_extent_nothing_accounts_for(tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        p.session("a")
        blocks = p.put(p.namespace("a"), "a", 2, dirty=True)
        assert await p.demotion().demote(blocks) == {}
        assert audit(p.ctx, p.index, p.invalidator) == []
        leaked = p.ctx.flash.allocate(blocks[0].slot_size, 1)
        assert leaked is not None
        assert audit(p.ctx, p.index, p.invalidator) == [
            "device flash0: 3 slots allocated, but 2 indexed + 0 parked + 0 quarantined + "
            "0 in flight (leak of 1)"]
        p.invalidator.park(leaked[0])
        assert audit(p.ctx, p.index, p.invalidator) == []
