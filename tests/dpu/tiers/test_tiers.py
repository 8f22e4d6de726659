"""Every tier runs the conformance suite (:mod:`.tier_conformance`), plus what is its own:
DRAM keeps owners in separate slabs; flash spreads extents over devices and skips failed
ones."""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path

import pytest

from ctxmem_common.flash_format import DATA_START, slots_per_slab
from ctxmem_dpu.alloc import SlotRef
from ctxmem_dpu.tiers.base import Tier
from ctxmem_dpu.tiers.dram import SLOT_NDARRAYS_MIN, DramTier
from ctxmem_dpu.tiers.flash import Extent, FlashDevice, FlashTier

from .tier_conformance import TierTests

MiB = 1 << 20


class TestDramTier(TierTests):
    def make_tier(self, tmp_path: Path) -> Tier[Hashable]:
        return DramTier(4 * MiB, MiB)

    def expected_slots(self, tier: Tier[Hashable], slot_size: int) -> int:
        assert isinstance(tier, DramTier)
        return tier.num_slabs * (tier.slab_size // slot_size)

    def is_closed(self, tier: Tier[Hashable]) -> bool:
        assert isinstance(tier, DramTier)
        return not tier.regions and not tier._idle

    def test_owners_never_share_a_slab(self) -> None:
        with DramTier(4 * MiB, MiB) as dram:
            (a,) = dram.allocate(self.size, 1, "alice") or []
            (b,) = dram.allocate(self.size, 1, "bob") or []
            assert a.slab != b.slab
            assert dram.region_tenant(a.slab) == "alice"
            assert dram.region_tenant(b.slab) == "bob"
            dram.view(a, 4)[:] = b"abcd"  # the slot is real, mapped memory
            assert bytes(dram.slot_view(a)[:4]) == b"abcd"

    def test_slot_ndarrays_match_each_slot(self) -> None:
        """An Acquire's answer is encoded from :meth:`DramTier.slot_ndarrays`: every ref
        must get its own slab's generation and slot size, whatever order the refs come
        in (slabs interleaved, of different slot sizes and generations)."""
        with DramTier(4 * MiB, MiB) as dram:
            old = dram.allocate(64 << 10, 16, "alice") or []
            for ref in old:  # the slab goes back, then to another owner: generation 2
                dram.free(ref)
            small = dram.allocate(64 << 10, 20, "bob") or []  # a slab and a bit of another
            big = dram.allocate(256 << 10, 5, "carol") or []
            refs = [r for pair in zip(small, big + small[5:], strict=False) for r in pair]
            refs += [*small[len(big) + 5:], big[0], small[0]]
            assert len({r.slab for r in refs}) >= 3
            assert len({dram.generation(r.slab) for r in refs}) == 2
            assert len(refs) < SLOT_NDARRAYS_MIN <= 4 * len(refs)
            for batch in (refs, refs[::-1] * 4):  # through lists, and through numpy
                slabs, gens, offsets = dram.slot_ndarrays(batch)
                assert (slabs.dtype, gens.dtype, offsets.dtype) == ("uint32", "uint32",
                                                                    "uint64")
                assert slabs.tolist() == [r.slab for r in batch]
                assert gens.tolist() == [dram.generation(r.slab) for r in batch]
                assert offsets.tolist() == [dram.offset(r) for r in batch]
                assert [a.tolist() for a in (slabs, gens, offsets)] == list(
                    dram.slot_arrays(batch))
            assert [len(a) for a in dram.slot_ndarrays([])] == [0, 0, 0]

    def test_slot_ndarrays_far_apart_slabs(self) -> None:
        """Slots in slabs whose ids span more than the batch (the table of the ids' range
        would be larger than the batch: the ``np.unique`` path) still each get their own
        slab's generation and offset; so do slots in a narrow range with unassigned slabs
        between them (the table path)."""
        slab = 64 << 10
        with DramTier(100 * slab, slab) as dram:
            refs = []
            for i in range(100):  # owners differ, so do slabs; slot sizes differ too
                refs += (dram.allocate(4096 * (1 + i % 4), 2, f"t{i}") or [])[1:]
            for i in (9, 99):  # these two slabs go to another owner: generation 2
                dram.free(refs[i])
                dram.free(type(refs[i])(refs[i].slab, 0))
                refs[i] = (dram.allocate(4096 * (1 + i % 4), 2, f"u{i}") or [])[1]
            assert len({r.slab for r in refs}) == 100
            assert {dram.generation(r.slab) for r in refs} == {1, 2}
            assert len({dram.offset(r) for r in refs}) == 4
            far = [refs[0], refs[99]] * (SLOT_NDARRAYS_MIN // 2)  # range 100 > 64 refs
            near = [refs[3], refs[9]] * (SLOT_NDARRAYS_MIN // 2)  # range 7, 3 unused ids
            for batch in (far, near):
                slabs, gens, offsets = dram.slot_ndarrays(batch)
                assert slabs.tolist() == [r.slab for r in batch]
                assert gens.tolist() == [dram.generation(r.slab) for r in batch]
                assert offsets.tolist() == [dram.offset(r) for r in batch]


class TestFlashTier(TierTests):
    slab = MiB

    def make_tier(self, tmp_path: Path) -> Tier[Hashable]:
        devices = []
        for i, slabs in enumerate((3, 2)):
            path = tmp_path / f"flash{i}.img"
            with open(path, "wb") as f:
                f.truncate(DATA_START + slabs * self.slab)
            devices.append(FlashDevice(i, f"flash{i}", str(path), self.slab, o_direct=False))
        return FlashTier(devices)

    def expected_slots(self, tier: Tier[Hashable], slot_size: int) -> int:
        assert isinstance(tier, FlashTier)
        return sum(d.num_slabs for d in tier.devices) * slots_per_slab(self.slab, slot_size)

    def is_closed(self, tier: Tier[Hashable]) -> bool:
        assert isinstance(tier, FlashTier)
        return all(d.fd == -1 for d in tier.devices)

    def test_extents_spread_over_devices_and_skip_failed_ones(self, tmp_path: Path) -> None:
        tier = self.make_tier(tmp_path)
        assert isinstance(tier, FlashTier)
        with tier:
            per = slots_per_slab(self.slab, self.size)
            # The device with the most free space first, all it holds, then the next.
            got = tier.allocate(self.size, 3 * per + 1) or []
            assert [e.device for e in got] == [0] * (3 * per) + [1]
            assert all(isinstance(e, Extent) and isinstance(e.slot, SlotRef) for e in got)
            for e in got[: 3 * per]:
                tier.free(e)
            tier.devices[0].healthy = False
            more = tier.allocate(self.size, 2 * per - 1) or []
            assert more and {e.device for e in more} == {1}
            # Device 1 is now full; device 0 is empty but failed.
            assert tier.allocate(self.size, 1) is None


@pytest.mark.parametrize("tier_cls", [DramTier, FlashTier])
def test_every_tier_implements_the_whole_contract(tier_cls: type) -> None:
    assert issubclass(tier_cls, Tier) and not tier_cls.__abstractmethods__
