"""Which slabs of a shared flash device this service may write: its slab leases as the
I/O threads see them, and the fence every write passes.

A *shared* device (``flash.devices[].shared``) is attached by several services of a pod
(the pod's flash enclosure over NVMe-oF). Each writes only slabs it holds a lease on
(:mod:`ctxmem_dpu.pod.slab_leases`: leased in the cluster index, Redis, with a *fencing
epoch* above every earlier grant's, the index's and the device's). The owner and epoch are
written into the slab's header on the device, and synced, when the lease is granted,
before the slab takes any write (the device holds the truth; the index is a cache).

What a writer checks (:meth:`SlabFence.check`): before each demotion batch, that its
lease is still current by its own clock (the local deadline is the time the grant or
renewal was *sent* plus the lease, less a margin: Redis expires the key no earlier) and
that the slab header on the device names no later epoch (a new owner writes its header,
with a higher epoch, before its first record); before each header write, the local
deadline again. What that cannot do alone: stop a writer that passed the check and was
then paused longer than the lease's remaining time from writing after the new owner took
the slab. Where the target offers NVMe persistent reservations
(:mod:`ctxmem_dpu.storage.nvme_resv`) the new owner first preempts the dead node's key,
so such a late write fails on the device (Reservation Conflict, ``EBADE``) and the fence
stops (:meth:`SlabFence.stop`): nothing more is written or acknowledged. Where it does not
(a file, kernel nvmet before Linux 6.13), such a late write can destroy the new owner's
records (they become misses) but never make a read return wrong bytes: every reader
checks the record header (namespace, key, sequence, length, CRC) and the payload's
CRC32C, and the XTS tweak ties ciphertext to its offset.

The dictionaries are written on the event loop and read on the I/O threads (single item
reads and writes, atomic in CPython).
"""

from __future__ import annotations

import errno
import time
from dataclasses import dataclass

from ctxmem_dpu.tiers.flash_io import FlashIOError


class SlabFenced(FlashIOError):
    """This service may not write the slab any more (its lease lapsed or was taken over):
    nothing was written; the block stays in DRAM and goes to another slab."""


@dataclass(frozen=True, slots=True)
class SlabGrant:
    """A lease this service holds on one slab: its fencing epoch and the monotonic time
    after which it must not write the slab unless the lease was renewed."""

    epoch: int
    deadline: float


class SlabFence:
    """This service's leases on one shared device, as the I/O threads check them."""

    def __init__(self, device: str, node_id: str) -> None:
        self.device = device
        self.node_id = node_id
        self._grants: dict[int, SlabGrant] = {}
        self._lost: set[int] = set()  # leases this service held and lost (taken over)
        # Why this node may write nothing more on the device (its NVMe reservation key
        # was preempted: another node judged it dead and took its slabs); "" while it may.
        self.stopped = ""

    def stop(self, reason: str) -> None:
        """Write nothing more on this device, whatever the leases say (``reason``: why;
        the first reason is kept)."""
        self.stopped = self.stopped or reason

    def grant(self, slab: int, epoch: int, deadline: float) -> None:
        """Record (or renew) the lease on ``slab``."""
        self._grants[slab] = SlabGrant(epoch, deadline)
        self._lost.discard(slab)

    def revoke(self, slab: int) -> None:
        """The lease on ``slab`` is gone for good: never write it again."""
        self._grants.pop(slab, None)
        self._lost.add(slab)

    def held(self, slab: int) -> bool:
        """Does this service hold ``slab``'s lease (whether or not it is still fresh)?"""
        return slab in self._grants

    def lost(self, slab: int) -> bool:
        """Did this service hold ``slab`` and lose it?"""
        return slab in self._lost

    def epoch(self, slab: int) -> int:
        """The epoch of the lease held on ``slab`` (0 when none)."""
        g = self._grants.get(slab)
        return g.epoch if g is not None else 0

    def slabs(self) -> list[int]:
        """The slabs held, in order."""
        return sorted(self._grants)

    def check(self, slab: int, on_device: tuple[str, int] | None = None) -> None:
        """Raise :class:`SlabFenced` unless this service may write ``slab`` now.
        ``on_device``: (owner, epoch) of the slab header read from the device, when the
        caller read it (see the module docstring)."""
        if self.stopped:
            raise SlabFenced(errno.EBADE, f"flash device {self.device!r}: node "
                             f"{self.node_id!r} writes nothing more here: {self.stopped}; "
                             f"slab {slab} not written")
        g = self._grants.get(slab)
        if g is None:
            raise SlabFenced(errno.EACCES, f"flash device {self.device!r}: slab {slab} is "
                             f"not leased to node {self.node_id!r} (lost or never held); "
                             f"not written")
        if time.monotonic() >= g.deadline:
            raise SlabFenced(errno.ETIMEDOUT, f"flash device {self.device!r}: the lease of "
                             f"slab {slab} (epoch {g.epoch}) was not renewed in time (index "
                             f"unreachable?); not written until it is")
        if on_device is not None:
            owner, epoch = on_device
            if epoch > g.epoch or (epoch == g.epoch and owner != self.node_id):
                raise SlabFenced(errno.EACCES, f"flash device {self.device!r}: slab {slab} "
                                 f"was taken over by node {owner!r} at epoch {epoch} (this "
                                 f"node held epoch {g.epoch}); not written")
