"""BlockIndex.lookup: the prefix probe runs in chunks and stops at the chunk holding the
first miss; the answer is the same as probing every key (issue 17, item 5)."""

from __future__ import annotations


def test_prefix_lookup_stops_at_the_first_miss_across_probe_chunks() -> None:
    from ctxmem_common.config import config_from_dict
    from ctxmem_dpu.blocks import Block
    from ctxmem_dpu.store.index import PREFIX_PROBE_KEYS, BlockIndex

    index = BlockIndex(config_from_dict({}))
    n = 2 * PREFIX_PROBE_KEYS
    keys = [i.to_bytes(4, "big") for i in range(n + 5)]
    stored = index.namespace(b"ns")
    for k in keys[:n]:
        stored[k] = Block(ns=b"ns", key=k, length=1, slot_size=1, crc=0, seq=0)
    for first_miss in (0, 1, PREFIX_PROBE_KEYS - 1, PREFIX_PROBE_KEYS, PREFIX_PROBE_KEYS + 1, n):
        asked = keys[:first_miss] + keys[n:] + keys[first_miss:n]
        found = index.lookup(b"ns", asked, prefix=True)
        assert [b.key for b in found if b is not None] == keys[:first_miss]
        assert len(found) == first_miss
        full = index.lookup(b"ns", asked, prefix=False)
        assert sum(b is not None for b in full) == n and len(full) == len(asked)
    assert len(index.lookup(b"ns", keys[:n], prefix=True)) == n  # all hits, to the end
    assert index.lookup(b"other", keys, prefix=True) == []
