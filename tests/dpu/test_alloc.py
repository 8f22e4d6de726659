from __future__ import annotations

import random

import pytest

from ctxmem_dpu.alloc import SlabAllocator, SlotRef


def make(num_slabs: int = 4, slab: int = 1 << 20) -> SlabAllocator:
    return SlabAllocator(num_slabs, slots_per_slab=lambda s: slab // s if s else 0)


def test_allocates_all_or_nothing() -> None:
    a = make(2)
    assert a.allocate("x", 256 << 10, 9) is None  # 8 fit in two slabs
    assert a.used_slots() == 0 and a.free_slabs == 2
    got = a.allocate("x", 256 << 10, 8)
    assert got is not None and len(set(got)) == 8
    assert a.allocate("x", 256 << 10, 1) is None


def test_classes_never_share_a_slab_and_empty_slabs_return_to_the_pool() -> None:
    a = make(3)
    big = a.allocate("big", 512 << 10, 2)
    small = a.allocate("small", 64 << 10, 3)
    assert big is not None and small is not None
    assert {r.slab for r in big}.isdisjoint({r.slab for r in small})
    for r in big:
        a.free(r)
    assert a.free_slabs == 2  # the big slab went back
    # ...and now serves another class: no fragmentation across sizes.
    other = a.allocate("other", 1 << 20, 2)
    assert other is not None


def test_placement_is_deterministic_lowest_slab_first() -> None:
    a = make(4)
    got = a.allocate("x", 512 << 10, 3)
    assert got == [SlotRef(0, 0), SlotRef(0, 1), SlotRef(1, 0)]
    a.free(SlotRef(0, 1))
    assert a.allocate("x", 512 << 10, 1) == [SlotRef(0, 1)]


def test_quarantined_slot_is_never_reused() -> None:
    a = make(1)
    (r,) = a.allocate("x", 1 << 19, 1) or []
    a.quarantine(r)
    a.free(r)
    got = a.allocate("x", 1 << 19, 1)
    assert got is not None and r not in got


def test_claim_rebuilds_state() -> None:
    a = make(2)
    a.claim("x", 256 << 10, SlotRef(1, 2))
    assert a.free_slabs == 1 and a.used_slots() == 1
    got = a.allocate("x", 256 << 10, 3)
    assert got is not None and SlotRef(1, 2) not in got and all(r.slab == 1 for r in got)


def test_batched_take_hands_out_the_slots_one_pop_each_would() -> None:
    """``allocate`` takes a slab's slots in one slice: after random allocations and frees
    (free lists out of order), it returns exactly what popping one slot at a time from
    the same free lists returns, as SlotRefs."""
    import random

    for seed in range(50):
        rng = random.Random(seed)
        a = make(4, 16 << 10)  # 16 slots of 1 KiB per slab
        held: list[SlotRef] = []
        for _ in range(40):
            if held and rng.random() < 0.4:
                for r in rng.sample(held, rng.randint(1, len(held))):
                    held.remove(r)
                    a.free(r)
                continue
            n = rng.randint(1, 20)
            free = {s.id: list(s.free) for s in a.slabs}
            partial = sorted(a._partial.get("x", set()))
            want: list[SlotRef] = []
            for sid in partial:  # the lowest partial slab first, popping from the end
                while free[sid] and len(want) < n:
                    want.append(SlotRef(sid, free[sid].pop()))
            got = a.allocate("x", 1 << 10, n)
            if got is None:
                continue
            if len(want) == n:
                assert got == want, seed
            else:
                assert got[:len(want)] == want, seed
            assert all(type(r) is SlotRef for r in got)
            held += got


def _state(a: SlabAllocator) -> object:
    return ([(s.klass, s.slot_size, s.capacity, list(s.free), s.used) for s in a.slabs],
            list(a._free_slabs), {k: set(v) for k, v in a._partial.items() if v})


def test_free_many_leaves_the_state_one_free_each_leaves() -> None:
    """Batched frees (dropping a demotion's DRAM copies) end exactly as one free per ref,
    in order: free lists (the next allocation's order), counts, partial sets, slabs
    returned to the pool, quarantined slots kept out."""
    rng = random.Random(5)
    for trial in range(30):
        one, many = make(6, 1 << 20), make(6, 1 << 20)
        held: list[SlotRef] = []
        for _step in range(6):
            size = rng.choice([64 << 10, 128 << 10])
            n = rng.randint(1, 20)
            got_one = one.allocate(size, size, n)
            assert got_one == many.allocate(size, size, n)
            held += got_one or []
            if trial % 3 == 0 and held:
                q = rng.choice(held)
                one.quarantine(q)
                many.quarantine(q)
            rng.shuffle(held)
            k = rng.randint(0, len(held))
            drop, held = held[:k], held[k:]
            for r in drop:
                one.free(r)
            many.free_many(drop)
            assert _state(one) == _state(many)


def test_free_many_refuses_a_double_free() -> None:
    a = make(2)
    got = a.allocate("x", 512 << 10, 2)
    assert got is not None
    a.free_many(got)
    with pytest.raises(AssertionError, match="double free"):
        a.free_many(got)
