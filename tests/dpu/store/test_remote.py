"""``store/remote.py``: blocks fetched from another node of a pod enter DRAM only when
their bytes check (length, CRC32C over the slot) and their key is not stored meanwhile;
a copy (fetched under an index entry) is DRAM only, never dirty, never served on to a peer,
and leaves when dropped (a leased one at its last unpin); this node's own blocks are
served to peers pinned. A DRAM-only store's parts (``parts.py``)."""

from __future__ import annotations

from crc32c import crc32c

from ctxmem_dpu.blocks import Namespace
from ctxmem_dpu.store.remote import RemoteBlocks
from ctxmem_dpu.store.sessions import SessionRegistry
from tests import kit

from .parts import SLOT, Parts, keys_of, parts


def _remote(p: Parts) -> RemoteBlocks:
    registry = SessionRegistry(p.cfg, p.ctx.dram, p.index, p.invalidator.unpin, p.tables,
                               p.quotas)
    return RemoteBlocks(p.ctx, p.index, p.room, p.promotion(), p.invalidator, registry)


def _item(key: bytes, crc_of: bytes | None = None, n: int = SLOT) -> tuple[bytes, bytes, int]:
    data = kit.tiled(key, n)
    return key, data, crc32c(crc_of if crc_of is not None else data)


async def test_only_checked_bytes_of_keys_not_stored_meanwhile_are_adopted() -> None:
    with parts() as p:
        p.session("a")
        ns = p.namespace("a")
        mine = p.put(ns, "mine", 1)[0]  # stored meanwhile
        good, bad, short = kit.keys("fetched", 3)
        before = p.ctx.dram.used_bytes()
        n = await _remote(p).adopt(ns, [_item(good), _item(bad, crc_of=b"other"),
                                        _item(short, n=SLOT // 2), _item(mine.key)])
        assert n == 1
        per_ns = p.index.namespace(ns.digest)
        assert list(per_ns) == [mine.key, good] and per_ns[mine.key] is mine
        b = per_ns[good]
        assert b.dram is not None and bytes(p.ctx.dram.view(b.dram, SLOT)) == kit.tiled(
            good, SLOT)
        assert (b.origin, b in p.index.dirty) == (None, False)  # no flash: nothing to demote
        assert p.ctx.dram.used_bytes() == before + SLOT  # the bad block's slot went back


async def test_a_copy_is_dram_only_never_served_on_and_leaves_when_dropped() -> None:
    with parts() as p:
        p.session("a")
        ns: Namespace = p.namespace("a")
        own = p.put(ns, "own", 1)[0]
        k1, k2 = kit.keys("copy", 2)
        remote = _remote(p)
        assert await remote.adopt(ns, [_item(k1), _item(k2)], [b"entry-1", b"entry-2"]) == 2
        c1, c2 = (p.index.namespace(ns.digest)[k] for k in (k1, k2))
        assert (c1.origin, c2.origin) == (b"entry-1", b"entry-2")
        assert list(p.index.copies_of(ns.digest)) == [k1, k2] and not p.index.dirty
        assert [ns_ for ns_, _b in remote.holdings()] == [ns.digest]  # own only
        assert keys_of([b for _n, b in remote.holdings()]) == [own.key]
        # Peers get this node's own blocks, pinned; never a copy, nor a missing key.
        served = await remote.pin_for_peer(ns.digest, [own.key, k1, b"\0" * 32])
        assert served == [own, None, None]
        assert (own.pins, c1.pins) == (1, 0)
        c2.pins = 1  # leased by a client here
        used = p.ctx.dram.used_bytes()
        remote.drop_copies([c1, c2, c1])  # c1 twice: dropped once
        assert list(p.index.namespace(ns.digest)) == [own.key]
        assert p.index.copies_of(ns.digest) == {}
        assert (c1.dram, c2.dram is not None) == (None, True)  # c2 at its last unpin
        assert p.ctx.dram.used_bytes() == used - SLOT
        p.invalidator.unpin(c2)
        assert c2.dram is None and p.ctx.dram.used_bytes() == used - 2 * SLOT
        assert p.ctx.counters["pod_copies_dropped"] == 2


async def test_landed_blocks_are_indexed_unless_missing_or_stored_meanwhile() -> None:
    with parts() as p:
        p.session("a")
        ns = p.namespace("a")
        remote = _remote(p)
        before = p.ctx.dram.used_bytes()
        refs = await remote.landing(ns, 3)
        raced = p.put(ns, "raced", 1)[0]  # a put of the same key while the fetch ran
        new, lost = kit.keys("landed", 2)
        n = remote.adopt_landed(ns, refs, [(raced.key, 1, None), (new, 2, None),
                                           (lost, 3, None)], [True, True, False])
        assert n == 1
        per_ns = p.index.namespace(ns.digest)
        assert list(per_ns) == [raced.key, new] and per_ns[raced.key] is raced
        assert (per_ns[new].dram, per_ns[new].crc) == (refs[1], 2)
        assert p.ctx.dram.used_bytes() == before + 2 * SLOT  # raced's and new's slots
        more = await remote.landing(ns, 2)
        remote.free_landing(more)
        assert p.ctx.dram.used_bytes() == before + 2 * SLOT
