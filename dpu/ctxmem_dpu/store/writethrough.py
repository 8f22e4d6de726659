"""Write-through commits: a block becomes visible only once it is durable on flash.

Under ``flash.write_policy: write_through`` an acknowledged Commit promises that its blocks
survive a crash or restart. So a committed block is first written to flash (payload and
header, each fdatasync'd: :mod:`~ctxmem_dpu.store.demotion`), and only then entered in the
index. A block whose flash write failed or could not be tried is never made visible and
never silently kept as a DRAM-only block: its DRAM slot and extent are freed, it is
counted in ``write_through_failures``, and the Commit fails, naming the device and errno:

* RESOURCE_EXHAUSTED when there was no room (the tier full, or ENOSPC from the device's
  filesystem): retry later, free flash space or add devices;
* UNAVAILABLE when a device failed (EIO, a failed sync) or none is usable: the device is
  out of service until the reaper's probe finds it working again;
* UNAVAILABLE, naming the slab lease, when on a shared device this node's lease lapsed
  (the cluster index unreachable or restarting) or was taken over: nothing was written, the
  device stays in service, and a retry succeeds once the node holds a current lease.

Blocks of the same Commit that did become durable stay stored (a later Lookup finds
them). A block whose DRAM bytes changed after its CRC was computed is dropped, as a
client-CRC mismatch is (the Commit reports fewer blocks).
"""

from __future__ import annotations

import errno
import logging

from ctxmem_common.errors import ResourceExhausted, Unavailable
from ctxmem_dpu import faults
from ctxmem_dpu.blocks import Allocation, Block
from ctxmem_dpu.store.context import StoreContext
from ctxmem_dpu.store.demotion import Demotion, DramChanged
from ctxmem_dpu.store.index import BlockIndex
from ctxmem_dpu.store.invalidation import Invalidator
from ctxmem_dpu.tiers.flash_fence import SlabFenced

log = logging.getLogger("ctxmem_dpu.store")

# errnos that mean "no room", not "the device failed".
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT})


class WriteThrough:
    """Commits that are acknowledged only for blocks durable on flash."""

    def __init__(self, ctx: StoreContext, index: BlockIndex, demotion: Demotion,
                 invalidator: Invalidator) -> None:
        self._ctx = ctx
        self._index = index
        self._demotion = demotion
        self._invalidator = invalidator

    async def commit(self, a: Allocation, blocks: list[Block]) -> list[Block]:
        """Make ``blocks`` (complete, CRC'd, not yet in the index) durable on flash, then
        visible; returns those made visible. Raises ResourceExhausted or Unavailable (see
        the module doc) when any could not be made durable."""
        failures = await self._demotion.demote(blocks)
        per_ns = self._index.namespace(a.ns.digest)
        visible: list[Block] = []
        errors: list[BaseException] = []
        for b in blocks:
            err = failures.get(b)
            if isinstance(err, DramChanged):
                continue  # dropped and counted by the demotion; its slot is freed
            if err is not None or not b.durable or b.key in per_ns:
                # Not durable (or another writer's copy became visible meanwhile): the
                # block goes, with its DRAM slot and any flash record.
                if err is not None or not b.durable:
                    errors.append(err or OSError(errno.EIO, "not written"))
                self._index.not_durable(b)
                if b.pins == 0 and b.io is None:
                    self._invalidator.release_storage(b)
                continue
            self._index.made_visible(b)
            visible.append(b)
        if errors:
            self._fail(a, errors, len(blocks), len(visible))
        return visible

    async def commit_group(self, allocs: list[Allocation], members: list[list[Block]]
                           ) -> list[Block]:
        """A block group's write-through commit: every member's ``blocks`` (one list per
        allocation, in order) made durable, member after member, then the keys whose
        every member is durable made visible in all members at once; a key that failed
        in one member is stored in none (its other members' records dropped, headers
        zeroed). Returns the blocks made visible; raises as :meth:`commit` when any
        block could not be made durable."""
        failures: dict[Block, BaseException | None] = {}
        try:
            for i, blocks in enumerate(members):
                if i:
                    faults.point("commit.group_between_members")
                failures.update(await self._demotion.demote(blocks))
        except Exception:
            # Nothing of the group is visible: the members already durable go too.
            for blocks in members:
                for b in blocks:
                    if not isinstance(failures.get(b), DramChanged):
                        self._drop(b)
            raise
        failed_keys = {b.key for blocks in members for b in blocks
                       if failures.get(b) is not None or not b.durable}
        visible: list[Block] = []
        errors: list[BaseException] = []
        n = 0
        for a, blocks in zip(allocs, members, strict=True):
            per_ns = self._index.namespace(a.ns.digest)
            n += len(blocks)
            for b in blocks:
                err = failures.get(b)
                if isinstance(err, DramChanged):
                    continue  # dropped and counted by the demotion; its slot is freed
                if b.key in failed_keys or b.key in per_ns:
                    if err is not None or not b.durable:
                        errors.append(err or OSError(errno.EIO, "not written"))
                    self._drop(b)
                    continue
                self._index.made_visible(b)
                visible.append(b)
        if errors:
            self._fail(allocs[0], errors, n, len(visible))
        return visible

    def _drop(self, b: Block) -> None:
        """A block not made visible: it goes, with its DRAM slot and any flash record
        (its header zeroed before the extent is reused)."""
        self._index.not_durable(b)
        if b.pins == 0 and b.io is None:
            self._invalidator.release_storage(b)

    def _fail(self, a: Allocation, errors: list[BaseException], n: int, stored: int) -> None:
        self._ctx.counters["write_through_failures"] += len(errors)
        no_room = all(getattr(e, "errno", None) in _NO_ROOM for e in errors)
        first = next((e for e in errors if getattr(e, "errno", None) not in _NO_ROOM),
                     errors[0])
        msg = (f"write-through commit of allocation {a.id.hex()}: {len(errors)} of {n} blocks "
               f"could not be made durable on flash and were not stored ({stored} stored): "
               f"{first}; ")
        log.warning("%s", msg.rstrip("; "))
        if no_room:
            raise ResourceExhausted(msg + "flash has no room for them: retry later, free "
                                    "flash space (delete, evict) or add flash devices")
        if any(isinstance(e, SlabFenced) and e.errno == errno.EBADE for e in errors):
            # Shared flash with NVMe reservations: another node preempted this node's key
            # (it judged this node dead and took its slabs); nothing more is written here.
            raise Unavailable(msg + "this node's reservation on the shared namespace was "
                              "preempted by another node, so it writes and acknowledges "
                              "nothing more on that device: restart the service to "
                              "register again and re-read its slabs")
        if all(isinstance(e, SlabFenced) for e in errors):
            # Nothing was written and the device did not fail: the node lacks a current
            # slab lease (renewed through the index), which it regains by itself.
            raise Unavailable(msg + "this node holds no current lease on a slab of the "
                              "shared device (is the cluster index reachable?); nothing "
                              "was written and the device stays in service: retry shortly")
        raise Unavailable(msg + "the flash device is out of service until a probe finds it "
                          "working again; retry later")
