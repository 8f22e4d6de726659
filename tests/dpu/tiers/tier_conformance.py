"""The conformance suite every :class:`~ctxmem_dpu.tiers.base.Tier` runs (as zarr-python
ships ``StoreTests``): subclass :class:`TierTests`, name the subclass ``Test...`` and
implement :meth:`TierTests.make_tier`, :meth:`TierTests.expected_slots` and
:meth:`TierTests.is_closed`.

Real tiers, real memory and files: allocate until full, all-or-nothing requests, free and
reuse, several slot sizes and owners side by side, usage accounting, closing.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from pathlib import Path

import pytest

from ctxmem_dpu.tiers.base import Tier


class TierTests:
    """The contract's behaviour; not collected itself (no ``Test`` prefix)."""

    size = 64 << 10  # the main slot size the tests use
    other_size = 128 << 10  # a second slot size, sharing the tier

    def make_tier(self, tmp_path: Path) -> Tier[Hashable]:
        """A fresh, empty tier (under ``tmp_path`` when it needs files)."""
        raise NotImplementedError

    def expected_slots(self, tier: Tier[Hashable], slot_size: int) -> int:
        """How many slots of ``slot_size`` the empty ``tier`` holds."""
        raise NotImplementedError

    def is_closed(self, tier: Tier[Hashable]) -> bool:
        """Has ``tier`` released its memory or devices?"""
        raise NotImplementedError

    @pytest.fixture
    def tier(self, tmp_path: Path) -> Iterator[Tier[Hashable]]:
        t = self.make_tier(tmp_path)
        yield t
        t.close()

    # -- the contract -------------------------------------------------------------------
    def test_is_a_tier_and_starts_empty(self, tier: Tier[Hashable]) -> None:
        assert isinstance(tier, Tier)
        assert tier.used_bytes() == 0
        assert tier.capacity_bytes() >= self.expected_slots(tier, self.size) * self.size > 0

    def test_allocate_gives_distinct_slots_and_counts_them(self, tier: Tier[Hashable]
                                                          ) -> None:
        got = tier.allocate(self.size, 5, "t")
        assert got is not None and len(got) == 5 and len(set(got)) == 5
        assert tier.used_bytes() == 5 * self.size
        assert tier.allocate(self.size, 0, "t") == []
        assert tier.used_bytes() == 5 * self.size

    def test_allocate_until_full(self, tier: Tier[Hashable]) -> None:
        n = self.expected_slots(tier, self.size)
        got: list[Hashable] = []
        while (one := tier.allocate(self.size, 1, "t")) is not None:
            got.extend(one)
            assert len(got) <= n, "the tier handed out more slots than it holds"
        assert len(got) == n and len(set(got)) == n
        assert tier.used_bytes() == n * self.size <= tier.capacity_bytes()
        assert tier.allocate(self.size, 1, "t") is None
        assert tier.allocate(self.other_size, 1, "t") is None  # no free slab left either

    def test_a_request_that_does_not_fit_takes_nothing(self, tier: Tier[Hashable]) -> None:
        n = self.expected_slots(tier, self.size)
        assert tier.allocate(self.size, n + 1, "t") is None
        assert tier.used_bytes() == 0
        got = tier.allocate(self.size, n, "t")
        assert got is not None and len(got) == n

    def test_a_freed_slot_is_reused(self, tier: Tier[Hashable]) -> None:
        n = self.expected_slots(tier, self.size)
        got = tier.allocate(self.size, n, "t")
        assert got is not None
        victim = got[n // 2]
        tier.free(victim)
        assert tier.used_bytes() == (n - 1) * self.size
        assert tier.allocate(self.size, 1, "t") == [victim]
        assert tier.allocate(self.size, 1, "t") is None

    def test_freeing_everything_makes_the_space_usable_by_any_size(
            self, tier: Tier[Hashable]) -> None:
        got = tier.allocate(self.size, self.expected_slots(tier, self.size), "t")
        assert got is not None
        for slot in got:
            tier.free(slot)
        assert tier.used_bytes() == 0
        m = self.expected_slots(tier, self.other_size)
        big = tier.allocate(self.other_size, m, "t")
        assert big is not None and len(big) == m
        assert tier.used_bytes() == m * self.other_size

    def test_sizes_and_owners_side_by_side(self, tier: Tier[Hashable]) -> None:
        a = tier.allocate(self.size, 3, "alice")
        b = tier.allocate(self.other_size, 2, "alice")
        c = tier.allocate(self.size, 2, "bob")
        assert a is not None and b is not None and c is not None
        assert len(set(a) | set(b) | set(c)) == 7
        assert tier.used_bytes() == 5 * self.size + 2 * self.other_size
        for slot in b:
            tier.free(slot)
        assert tier.used_bytes() == 5 * self.size
        for slot in a + c:
            tier.free(slot)
        assert tier.used_bytes() == 0

    def test_close_releases_and_is_idempotent(self, tmp_path: Path) -> None:
        with self.make_tier(tmp_path) as tier:
            assert tier.allocate(self.size, 2, "t") is not None
            assert not self.is_closed(tier)
        assert self.is_closed(tier)
        tier.close()  # again: nothing happens
        assert self.is_closed(tier)
