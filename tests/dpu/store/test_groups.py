"""``store/groups.py``: once one member's block of a key leaves the index, the other
members' blocks of that key are reclaimed (through the store's delete, here a delete of
the parts' index that records what it was asked), and nothing else is: not other keys,
not namespaces outside the group, not a key put back meanwhile, not on a fetched copy's
departure. Blocks placed by hand in a DRAM-only store's parts (``parts.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from ctxmem_dpu.store import groups
from ctxmem_dpu.store.groups import GroupSiblings

from .parts import Parts, keys_of, parts


def _siblings(p: Parts) -> tuple[GroupSiblings, list[tuple[bytes, list[bytes]]]]:
    dropped: list[tuple[bytes, list[bytes]]] = []

    async def delete(digest: bytes, keys: Sequence[bytes]) -> int:
        dropped.append((digest, list(keys)))
        per_ns = p.index.namespace(digest)
        gone = [per_ns[k] for k in keys if k in per_ns]
        for b in gone:
            p.index.forget(b)
        return len(gone)

    return GroupSiblings(p.ctx, p.index, delete), dropped


async def _settled(p: Parts) -> None:
    """Every reclaim the listener started (and any it started again) has run."""
    while pending := [t for t in p.ctx.io.tasks if not t.done()]:
        await asyncio.wait_for(asyncio.gather(*pending), 10)


async def test_a_member_leaving_reclaims_its_siblings_of_that_key_only() -> None:
    with parts() as p:
        p.session("t")
        k, v, other = p.namespace("t", "k"), p.namespace("t", "v"), p.namespace("t", "x")
        kb, vb, xb = p.put(k, "key", 3), p.put(v, "key", 3), p.put(other, "key", 3)
        sib, dropped = _siblings(p)
        sib.declare([k.digest, v.digest])
        p.index.forget(kb[1])  # evicted from its last tier, failed its check, deleted
        await _settled(p)
        assert dropped == [(v.digest, [vb[1].key])]
        assert keys_of(list(p.index.namespace(v.digest).values())) == keys_of([vb[0], vb[2]])
        assert len(p.index.namespace(other.digest)) == 3  # not a member: untouched
        assert p.ctx.counters["group_members_reclaimed"] == 1
        assert xb[1].key == vb[1].key  # the same key, in a namespace outside the group


async def test_nothing_is_reclaimed_for_a_copy_a_key_put_back_or_an_unknown_group() -> None:
    with parts() as p:
        p.session("t")
        k, v = p.namespace("t", "k"), p.namespace("t", "v")
        kb, _vb = p.put(k, "key", 3), p.put(v, "key", 3)
        sib, dropped = _siblings(p)
        p.index.forget(kb[0])  # no group declared yet
        sib.declare([k.digest])  # one member is no group
        p.index.forget(kb[1])
        sib.declare([k.digest, v.digest])
        kb[2].origin = b"node-b"  # a copy fetched from another node leaving
        p.index.forget(kb[2])
        await _settled(p)
        assert dropped == []
        # A key that left and was put back before the reclaim ran keeps its siblings.
        back = p.put(k, "again", 1)[0]
        sibling = p.put(v, "again", 1)[0]
        p.index.forget(back)
        p.index.namespace(k.digest)[back.key] = back  # a group put wrote it back meanwhile
        await _settled(p)
        assert dropped == []
        assert p.index.namespace(v.digest)[sibling.key] is sibling
        assert p.ctx.counters["group_members_reclaimed"] == 0


def test_at_most_max_groups_are_remembered() -> None:
    with parts() as p:
        sib, _ = _siblings(p)
        digests = [i.to_bytes(16, "big") for i in range(groups.MAX_GROUPS + 2)]
        for i in range(groups.MAX_GROUPS + 1):
            sib.declare([digests[i], digests[i + 1]])
        assert len(sib._groups) == groups.MAX_GROUPS == 4096
        assert (digests[-2], digests[-1]) not in sib._groups  # the one past the bound
        assert sib._of[digests[1]] == {(digests[0], digests[1]), (digests[1], digests[2])}
