"""Slab ownership on a pod's shared flash devices, leased in the cluster index (Redis).

Several services of a pod attach one NVMe-oF namespace (``flash.devices[].shared``). Each
writes only slabs it holds a lease on; every service reads any extent (validated by its
record header and CRC: :mod:`ctxmem_dpu.pod.shared_flash`).

**The lease.** Key ``ctxmem:slab:{<device uuid>}:<slab>:lease`` holds ``<node id>|<epoch>``
with a time to live of ``pod.slab_lease_s``; ``...:epoch`` is the slab's *fencing epoch*
counter. The device's keys share the hash tag ``{<device uuid>}`` (one Redis Cluster slot:
the grant script's two keys and a batched read of many slabs' leases). A grant is one Lua
script (atomic in Redis): a slab with no live lease gets the
next epoch (``INCR``, so every grant of a slab has a higher epoch than any before) and a
lease naming this node; a live lease naming this node is extended and keeps its epoch (a
service restarted under the same node id takes its slabs back). Renewal extends the lease
only while it still names this node and epoch; release deletes it the same way. Node ids
must be unique among the running services of a pod.

**Which slabs a node writes** (:class:`SlabLeaseKeeper`). At start it reads every slab
header of the device: the slabs whose header names this node are leased again (adopted
or granted anew: then the header is rewritten with the new epoch, records kept) and are
the only slabs whose records it indexes (other nodes' blocks are found through the
cluster index). Then, and whenever fewer than ``spare`` leased slabs are free, it leases
more: blank slabs first, then slabs whose lease has lapsed (a dead node's: its records
stay readable by everyone until the slab is reassigned, which zeroes its header table and
writes a header naming the new owner at its epoch; a reader holding a pointer into it
then finds another record, or none: a miss). The allocator hands out only leased slabs.

**When a lease cannot be renewed.** Renewals run every lease / 3. A renewal answered
"not yours" (taken over) revokes the slab at once: nothing more is written there, its
records are left to the new owner. A renewal that fails (index unreachable, timeout)
changes nothing, but the local deadline (sent-time + lease - margin) lapses: every
write batch checks it (and the header's epoch on the device), so the node stops writing
the slab before Redis can grant it to another. What this cannot do without fencing in
the device: see :mod:`ctxmem_dpu.tiers.flash_fence`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from ctxmem_dpu.tiers.flash import FlashDevice

log = logging.getLogger(__name__)

# Of each lease, this fraction is kept as a margin: a writer stops that long before Redis
# could expire the lease (clock-rate drift, the I/O after the check).
MARGIN_FRACTION = 0.25

_GRANT = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local sep = string.find(cur, '|', 1, true)
  if sep and string.sub(cur, 1, sep - 1) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return tonumber(string.sub(cur, sep + 1))
  end
  return -1
end
local e = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. e, 'PX', ARGV[2])
return e
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class LeaseError(Exception):
    """The cluster index did not answer a lease request in time (or failed)."""


class SlabLeases:
    """Slab leases of one pod node in the cluster index (see the module docstring).

    ``client``: a ``redis.asyncio.Redis`` or ``RedisCluster`` (its lifetime is the
    caller's); ``node_id``: this service's node id in the pod; ``lease_s``:
    ``pod.slab_lease_s``; ``timeout_s``: the bound on each request (default a fifth of
    the lease, at least 0.25 s)."""

    def __init__(self, client: aioredis.Redis | aioredis.RedisCluster, node_id: str,
                 lease_s: float,
                 timeout_s: float | None = None, prefix: str = "ctxmem:slab") -> None:
        if not node_id or "|" in node_id or len(node_id.encode()) > 64:
            raise ValueError(f"node id {node_id!r}: 1-64 bytes, without '|'")
        self.client = client
        self.node_id = node_id
        self.lease_s = lease_s
        self.timeout_s = timeout_s if timeout_s is not None else max(0.25, lease_s / 5)
        self.prefix = prefix
        self._grant = client.register_script(_GRANT)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    def _key(self, device_uuid: bytes, slab: int) -> str:
        return f"{self.prefix}:{{{device_uuid.hex()}}}:{slab}"

    def deadline(self, sent: float) -> float:
        """The monotonic time until which a lease granted or renewed by a request sent at
        ``sent`` may be written under."""
        return sent + self.lease_s * (1 - MARGIN_FRACTION)

    async def _call(self, what: str, aw: Awaitable[Any]) -> Any:
        try:
            return await asyncio.wait_for(aw, self.timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            raise LeaseError(f"slab lease {what} for node {self.node_id!r} failed: "
                             f"{type(exc).__name__}: {exc or 'no answer'} (is the pod's "
                             f"index reachable?)") from None

    async def grant(self, device_uuid: bytes, slab: int) -> tuple[int, float] | None:
        """Lease ``slab``: (epoch, local deadline), or ``None`` while another node holds
        it. Raises LeaseError."""
        key = self._key(device_uuid, slab)
        sent = time.monotonic()
        epoch = int(await self._call("grant", self._grant(
            keys=[f"{key}:lease", f"{key}:epoch"],
            args=[self.node_id, int(self.lease_s * 1000)])))
        return None if epoch < 0 else (epoch, self.deadline(sent))

    async def renew(self, device_uuid: bytes, slab: int, epoch: int) -> float | None:
        """Extend the lease: the new local deadline, or ``None`` when the lease no longer
        names this node at ``epoch`` (lapsed or taken over). Raises LeaseError."""
        sent = time.monotonic()
        ok = await self._call("renewal", self._renew(
            keys=[f"{self._key(device_uuid, slab)}:lease"],
            args=[f"{self.node_id}|{epoch}", int(self.lease_s * 1000)]))
        return self.deadline(sent) if int(ok) else None

    async def release(self, device_uuid: bytes, slab: int, epoch: int) -> None:
        """Give the lease up (if it still names this node at ``epoch``)."""
        await self._call("release", self._release(
            keys=[f"{self._key(device_uuid, slab)}:lease"], args=[f"{self.node_id}|{epoch}"]))

    async def holders(self, device_uuid: bytes, slabs: list[int]
                      ) -> list[tuple[str, int] | None]:
        """Per slab, the live lease's (node, epoch), or ``None``. Raises LeaseError."""
        if not slabs:
            return []
        raw = await self._call("lookup", self.client.mget(
            [f"{self._key(device_uuid, s)}:lease" for s in slabs]))
        out: list[tuple[str, int] | None] = []
        for v in raw:
            if v is None:
                out.append(None)
                continue
            text = v.decode() if isinstance(v, bytes) else str(v)
            node, _sep, epoch = text.rpartition("|")
            out.append((node, int(epoch)))
        return out


class SlabLeaseKeeper:
    """Keeps this node's leases on every shared device of a store: attach (adopt own
    slabs), top-up (``spare`` free leased slabs ahead of need), renewal, revocation,
    release at close. Runs on the store's event loop; device reads go through ``run``
    (the store's I/O threads)."""

    def __init__(self, leases: SlabLeases, devices: list[FlashDevice],
                 run: Callable[..., Awaitable[Any]], spare: int = 2) -> None:
        self.leases = leases
        self.devices = [d for d in devices if d.fence is not None]
        self._run = run
        self.spare = spare
        self._blank: dict[int, set[int]] = {}
        self.revoked = 0

    async def attach(self) -> None:
        """At start, before the index rebuild: lease again the slabs whose header names
        this node (their records are this node's to index). Raises LeaseError when the
        index cannot be reached (a shared device is not written without it)."""
        for dev in self.devices:
            fence = dev.fence
            assert fence is not None
            owners = await self._run(lambda d=dev: [d.slab_owner(s) for s in range(d.num_slabs)])
            self._blank[dev.index] = {s for s, (o, _e) in enumerate(owners) if not o}
            # (a slab of the device's non-shared past, header without owner, counts as
            # blank: its records belong to no node and are reused.)
            mine = [s for s, (o, _e) in enumerate(owners) if o == fence.node_id]
            for slab in mine:
                got = await self.leases.grant(dev.superblock.device_uuid, slab)
                if got is None:
                    log.warning("flash device %s: slab %d names node %s but another node "
                                "holds its lease now; its records are that node's",
                                dev.name, slab, fence.node_id)
                    continue
                epoch, deadline = got
                fence.grant(slab, epoch, deadline)
                if epoch != owners[slab][1]:
                    await self._run(dev.restamp_slab, slab, epoch)
                dev.alloc.add_slab(slab)
            log.info("flash device %s (shared): node %s holds %d slabs of %d", dev.name,
                     fence.node_id, len(fence.slabs()), dev.num_slabs)

    async def top_up(self, more: int = 0) -> int:
        """Lease free slabs until each device has ``spare`` free leased slabs, and at
        least ``more`` slabs more (the allocator is out of room: a free slab leased beats
        evicting a block); returns how many were leased. Index errors are logged (the
        next round tries again)."""
        got = 0
        for dev in self.devices:
            if more and got >= more:
                break
            try:
                got += await self._top_up(dev, more - got)
            except LeaseError as exc:
                log.warning("flash device %s: %s", dev.name, exc)
        return got

    async def _top_up(self, dev: FlashDevice, more: int = 0) -> int:
        fence = dev.fence
        assert fence is not None
        need = max(self.spare - len(dev.alloc.free_slab_ids()), more)
        if need <= 0:
            return 0
        blank = self._blank.get(dev.index, set())
        candidates = sorted((s for s in range(dev.num_slabs) if not fence.held(s)),
                            key=lambda s: (s not in blank, s))
        uuid = dev.superblock.device_uuid
        got = 0
        for i in range(0, len(candidates), 64):
            chunk = candidates[i:i + 64]
            for slab, holder in zip(chunk, await self.leases.holders(uuid, chunk),
                                    strict=True):
                if holder is not None or dev.alloc.slabs[slab].klass is not None:
                    continue
                grant = await self.leases.grant(uuid, slab)
                if grant is None:
                    continue
                fence.grant(slab, *grant)
                dev.alloc.add_slab(slab)
                blank.discard(slab)
                got += 1
                if got >= need:
                    return got
        return got

    async def renew(self) -> None:
        """Renew every lease held; a lease that names another node now is revoked."""
        for dev in self.devices:
            fence = dev.fence
            assert fence is not None
            uuid = dev.superblock.device_uuid
            for slab in fence.slabs():
                epoch = fence.epoch(slab)
                try:
                    deadline = await self.leases.renew(uuid, slab, epoch)
                except LeaseError as exc:
                    log.warning("flash device %s: %s; slab %d is written until its lease "
                                "lapses here", dev.name, exc, slab)
                    continue
                if deadline is None:
                    self.revoked += 1
                    fence.revoke(slab)
                    dev.alloc.revoke_slab(slab)
                    log.warning("flash device %s: lease on slab %d (epoch %d) lost (lapsed "
                                "or taken over); nothing more is written there", dev.name,
                                slab, epoch)
                else:
                    fence.grant(slab, epoch, deadline)

    async def run(self, period_s: float = 0.2) -> None:
        """Renew every lease / 3 and top up every ``period_s`` until cancelled."""
        renew_at = time.monotonic() + self.leases.lease_s / 3
        while True:
            await asyncio.sleep(min(period_s, self.leases.lease_s / 6))
            if time.monotonic() >= renew_at:
                renew_at = time.monotonic() + self.leases.lease_s / 3
                await self.renew()
            await self.top_up()

    async def close(self) -> None:
        """Release the leases of slabs that hold nothing (others may take them now); the
        leases of slabs with records lapse on their own (their blocks stay readable)."""
        for dev in self.devices:
            fence = dev.fence
            assert fence is not None
            for slab in dev.alloc.free_slab_ids():
                if fence.held(slab):
                    try:
                        await self.leases.release(dev.superblock.device_uuid, slab,
                                                  fence.epoch(slab))
                    except LeaseError as exc:
                        log.info("flash device %s: %s", dev.name, exc)
                    fence.revoke(slab)
