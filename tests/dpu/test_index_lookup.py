"""BlockIndex.lookup: the prefix probe runs in chunks and stops at the chunk holding the
first miss; the answer is the same as probing every key (issue 17, item 5)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest


def _as_list(keys: list[bytes]) -> Sequence[bytes]:
    return keys


def _as_packed_array(keys: list[bytes]) -> np.ndarray:
    """The form the servicer passes for packed keys (ctxmem_common.keys.packed_key_array)."""
    return np.frombuffer(b"".join(keys), dtype=f"V{len(keys[0])}") if keys else \
        np.empty(0, dtype="V4")


@pytest.mark.parametrize("form", [_as_list, _as_packed_array])
def test_prefix_lookup_stops_at_the_first_miss_across_probe_chunks(form: object) -> None:
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
        found = index.lookup(b"ns", form(asked), prefix=True)  # type: ignore[operator]
        assert [b.key for b in found if b is not None] == keys[:first_miss]
        assert len(found) == first_miss
        full = index.lookup(b"ns", form(asked), prefix=False)  # type: ignore[operator]
        assert sum(b is not None for b in full) == n and len(full) == len(asked)
        assert [b.key for b in full if b is not None] == keys[:first_miss] + keys[first_miss:n]
    all_hits = index.lookup(b"ns", form(keys[:n]), prefix=True)  # type: ignore[operator]
    assert len(all_hits) == n  # all hits, to the end
    assert index.lookup(b"other", form(keys), prefix=True) == []  # type: ignore[operator]
    # A last chunk of one key, a hit and a miss (itemgetter of one key is not a tuple).
    one_more = keys[:PREFIX_PROBE_KEYS + 1]
    found = index.lookup(b"ns", form(one_more), prefix=True)  # type: ignore[operator]
    assert [b.key for b in found if b is not None] == one_more
    missed = keys[:PREFIX_PROBE_KEYS] + keys[n:n + 1]
    found = index.lookup(b"ns", form(missed), prefix=True)  # type: ignore[operator]
    assert [b.key for b in found if b is not None] == keys[:PREFIX_PROBE_KEYS]
