"""Exact eviction order of the segmented LRU (scenario tests, vLLM style)."""

from __future__ import annotations

from ctxmem_dpu.policy import SegmentedLRU


def test_plain_lru_order_without_reuse() -> None:
    p: SegmentedLRU[str] = SegmentedLRU(protect_after_hits=2)
    for k in "abcd":
        p.add(k)
    p.touch("b", hits=1)
    assert p.order() == ["a", "c", "d", "b"]
    assert list(p.victims()) == ["a", "c", "d", "b"]


def test_reused_prefix_blocks_outlive_a_one_off_scan() -> None:
    p: SegmentedLRU[str] = SegmentedLRU(protect_after_hits=2, protected_fraction=0.8)
    for k in ("sys0", "sys1"):
        p.add(k)
    for k in ("sys0", "sys1"):  # two requests reused the system prompt
        p.touch(k, hits=1)
        p.touch(k, hits=2)
    for k in ("scan0", "scan1", "scan2", "scan3"):  # a long one-off prompt streams in
        p.add(k)
    assert p.order() == ["scan0", "scan1", "scan2", "scan3", "sys0", "sys1"]


def test_protected_overflow_demotes_its_lru_to_probation_mru() -> None:
    p: SegmentedLRU[str] = SegmentedLRU(protect_after_hits=1, protected_fraction=0.5)
    for k in "abcd":
        p.add(k)
    p.touch("a", 1)
    p.touch("b", 1)
    assert p.order() == ["c", "d", "a", "b"]
    p.touch("c", 1)  # 3 protected > 0.5 * 4: "a" (protected LRU) drops back
    assert p.order() == ["d", "a", "b", "c"]


def test_victims_skip_pinned_and_tolerate_removal() -> None:
    p: SegmentedLRU[str] = SegmentedLRU()
    for k in "abc":
        p.add(k)
    out = []
    for v in p.victims(skip=lambda k: k == "a"):
        out.append(v)
        p.remove(v)
    assert out == ["b", "c"] and p.order() == ["a"]


def test_add_unhit_appends_to_probation_in_order_like_add() -> None:
    bulk: SegmentedLRU[str] = SegmentedLRU(protect_after_hits=1)
    one: SegmentedLRU[str] = SegmentedLRU(protect_after_hits=1)
    bulk.add("x", hits=1)
    one.add("x", hits=1)
    bulk.add_unhit(["a", "b", "c"])
    for k in "abc":
        one.add(k)
    assert bulk.order() == one.order() == ["a", "b", "c", "x"]
    assert len(bulk) == 4 and "b" in bulk


def _touched(p: SegmentedLRU[int], batch: list[tuple[int, int]], batched: bool
             ) -> tuple[list[int], list[int]]:
    if batched:
        p.touch_many([k for k, _ in batch], [h for _, h in batch])
    else:
        for k, h in batch:
            p.touch(k, h)
    return list(p._probation), list(p._protected)


def test_touch_many_leaves_the_order_of_one_touch_per_item() -> None:
    """Random lists (both segments, overflowing protected), random batches (items not in
    the list, repeats, hits below and above the threshold): batched and one by one leave
    the same two segments, item for item, after every batch."""
    import random

    for seed in range(300):
        rng = random.Random(seed)
        kw = {"protect_after_hits": rng.randint(1, 3),
              "protected_fraction": rng.choice([0.0, 0.2, 0.5, 0.8, 1.0])}
        one: SegmentedLRU[int] = SegmentedLRU(**kw)  # type: ignore[arg-type]
        many: SegmentedLRU[int] = SegmentedLRU(**kw)  # type: ignore[arg-type]
        for k in range(rng.randint(0, 40)):
            h = rng.randint(0, 3)
            one.add(k, h)
            many.add(k, h)
        for _ in range(5):
            batch = [(rng.randint(0, 45), rng.randint(0, 4))
                     for _ in range(rng.randint(0, 30))]
            assert _touched(many, batch, True) == _touched(one, batch, False), (seed, batch)


def test_touch_many_within_one_segment_leaves_the_order_of_one_touch_per_item() -> None:
    """The batches a get makes most (every item in protected, or every one in probation
    with hits below the threshold: touch_many's one-pass cases), with repeats: the same
    two segments, item for item, as one touch each."""
    import random

    for seed in range(300):
        rng = random.Random(seed)
        threshold = rng.randint(1, 3)
        kw = {"protect_after_hits": threshold,
              "protected_fraction": rng.choice([0.2, 0.5, 0.8, 1.0])}
        one: SegmentedLRU[int] = SegmentedLRU(**kw)  # type: ignore[arg-type]
        many: SegmentedLRU[int] = SegmentedLRU(**kw)  # type: ignore[arg-type]
        for k in range(rng.randint(2, 40)):
            h = rng.randint(0, 3)
            one.add(k, h)
            many.add(k, h)
        for _ in range(5):
            protected = rng.random() < 0.5
            members = list(one._protected if protected else one._probation)
            if not members:
                continue
            batch = [(rng.choice(members),
                      rng.randint(0, 4) if protected else rng.randint(0, threshold - 1))
                     for _ in range(rng.randint(1, 30))]
            assert _touched(many, batch, True) == _touched(one, batch, False), (seed, batch)


def test_touch_many_promotes_and_demotes_like_touch() -> None:
    p: SegmentedLRU[str] = SegmentedLRU(protect_after_hits=1, protected_fraction=0.5)
    for k in "abcd":
        p.add(k)
    p.touch_many(["a", "b", "x", "c"], [1, 1, 1, 1])  # "x": not here, ignored
    assert p.order() == ["d", "a", "b", "c"]  # as test_protected_overflow_... one by one
