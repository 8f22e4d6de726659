"""Slab ownership on a pod's shared flash devices: on the device, cached in the cluster
index (Redis).

Several services of a pod attach one NVMe-oF namespace (``flash.devices[].shared``). Each
writes only slabs it owns; every service reads any extent (validated by its record header
and CRC: :mod:`ctxmem_dpu.pod.shared_flash`).

**The truth is on the device.** A slab's owner node and its *fencing epoch* are written
in the slab's own header (the ``CTXSLABP`` extension) and synced before the slab takes any
write: a slab just leased gets a *lease stamp* (a header with slot size 0: no records)
naming this node (:meth:`FlashDevice.claim_slab`), and its first assignment writes the
real header at the same epoch. The index holds a cache of it: key
``ctxmem:slab:{<device uuid>}:<slab>:lease`` = ``<node id>|<epoch>`` with a time to live
of ``pod.slab_lease_s``, and ``...:epoch``, the slab's epoch counter (one hash tag per
device: one Redis Cluster slot). A grant is one Lua script (atomic in Redis): a slab with
no live lease gets epoch max(index counter + 1, device epoch + 1), so an index that
restarts empty or from an old snapshot never hands out an epoch the device has seen. An
index that loses its state (flushed, restarted empty, an old snapshot, every lease lapsed
at once) therefore loses nothing: renewals re-create the leases of slabs whose header
still names this node at its epoch, and no node takes a slab whose header names a live
node.

**Liveness, not clocks.** Each node advances a heartbeat counter in its slot on the device
(``NodeBeat``, from ``BEAT_OFFSET``) at every renewal round (lease / 3). Another node's
slab is taken only when its owner is dead: its heartbeat counter did not change for a
full lease measured on the *taker's* monotonic clock (or, on the same host, its process
is gone). A paused node (SIGSTOP) keeps its slabs while any blank slab remains. Wall
clocks are never read.

**Which slabs a node takes** (:class:`SlabLeaseKeeper`). At start it reads every slab
header: the slabs naming this node are leased again (adopted, or granted anew and
restamped, records kept; also when the index says another node holds them: the device
wins) and are the only slabs whose records it indexes. Whenever fewer than ``spare``
leased slabs are free, it reads the headers again *then* and leases: blank slabs first,
then empty slabs of dead nodes, and a dead node's slabs with records only when the
allocator is out of room (their records become misses when stamped: durable while their
writer lives, and after that until a taker needs the room).

**When a lease cannot be renewed.** Renewals run every lease / 3, after writing the
heartbeat and reading the held slabs' headers: a header naming another node (taken
after this node was paused past its lease) revokes the slab at once. A lease the index
lost is re-created; one the index says another node holds while the device names this
node is taken back. A renewal the index does not answer (unreachable, restarting,
timeout) renews on the device alone a slab whose header, read in that round after the
heartbeat was written, still names this node at its epoch (its reservation key still
registered, where the target has them): to the heartbeat's deadline, since no taker can
judge this node dead before then (see :meth:`SlabLeaseKeeper.renew`). A heartbeat that
cannot be written renews nothing: the local deadline (sent-time + lease - margin)
lapses; every write batch checks it and the header's epoch on the device, so the node
stops writing before a taker could observe its heartbeat stopped for a lease. What the
epoch cannot do without fencing in the device (NVMe persistent reservations, not built):
see :mod:`ctxmem_dpu.tiers.flash_fence`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from ctxmem_common.flash_format import NodeBeat
from ctxmem_dpu import faults
from ctxmem_dpu.tiers.flash import FlashDevice
from ctxmem_dpu.tiers.flash_owner import boot_id, process_start

log = logging.getLogger(__name__)

# Of each lease, this fraction is kept as a margin: a writer stops that long before Redis
# could expire the lease (clock-rate drift, the I/O after the check).
MARGIN_FRACTION = 0.25

# KEYS: lease, epoch counter. ARGV: node, lease ms, device epoch, force ('1': the device
# names this node, whatever the index says).
_GRANT = """
local cur = redis.call('GET', KEYS[1])
local dev = tonumber(ARGV[3])
if cur and ARGV[4] ~= '1' then
  local sep = string.find(cur, '|', 1, true)
  if sep and string.sub(cur, 1, sep - 1) == ARGV[1] then
    local e = tonumber(string.sub(cur, sep + 1))
    if e and e >= dev then
      redis.call('PEXPIRE', KEYS[1], ARGV[2])
      return e
    end
  else
    return -1
  end
end
local e = redis.call('INCR', KEYS[2])
if e <= dev then
  e = dev + 1
  redis.call('SET', KEYS[2], e)
end
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. e, 'PX', ARGV[2])
return e
"""
# KEYS: lease, epoch counter. ARGV: node|epoch, lease ms, epoch, force. 1: extended; 2:
# the index had no lease (lost, lapsed): re-created; 0: another holder (with force: set).
_RENEW = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if (not cur or ARGV[4] == '1') and tonumber(ARGV[3]) > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  local top = tonumber(redis.call('GET', KEYS[2]) or '0')
  if top < tonumber(ARGV[3]) then
    redis.call('SET', KEYS[2], ARGV[3])
  end
  return 2
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

    async def grant(self, device_uuid: bytes, slab: int, device_epoch: int = 0,
                    force: bool = False) -> tuple[int, float] | None:
        """Lease ``slab``: (epoch, local deadline), or ``None`` while another node holds
        it (unless ``force``: the device names this node). The epoch is above both the
        index's counter and ``device_epoch`` (the slab header's), unless this node's own
        live lease already is at least ``device_epoch`` (kept). Raises LeaseError."""
        key = self._key(device_uuid, slab)
        sent = time.monotonic()
        epoch = int(await self._call("grant", self._grant(
            keys=[f"{key}:lease", f"{key}:epoch"],
            args=[self.node_id, int(self.lease_s * 1000), device_epoch,
                  "1" if force else "0"])))
        return None if epoch < 0 else (epoch, self.deadline(sent))

    async def renew(self, device_uuid: bytes, slab: int, epoch: int, force: bool = False
                    ) -> float | None:
        """Extend the lease: the new local deadline, or ``None`` when another node's lease
        is in the index (unless ``force``). A lease the index lost (flushed, lapsed) is
        re-created at ``epoch``: the device, not the index, says whose the slab is (the
        caller checked its header). Raises LeaseError."""
        key = self._key(device_uuid, slab)
        sent = time.monotonic()
        ok = await self._call("renewal", self._renew(
            keys=[f"{key}:lease", f"{key}:epoch"],
            args=[f"{self.node_id}|{epoch}", int(self.lease_s * 1000), epoch,
                  "1" if force else "0"]))
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


class Liveness:
    """Which pod nodes are dead, by what this node observed of their heartbeats on one
    device. A node that ran on this host is checked first, by what can be checked: dead
    at once when its process is gone (or the host rebooted since), alive while its process
    runs with its start time, whatever its heartbeat says (paused by SIGSTOP, stalled: a
    lease that lapses while its owner lives is renewed, never taken; issue 26). A node of
    another host is dead once its counter has not changed for ``lease_s`` on this node's
    monotonic clock (measured from the first time this node saw that value)."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._seen: dict[str, tuple[int, float]] = {}
        self._dead_since: dict[str, float] = {}  # node -> when this node first found it dead

    def observe(self, beats: dict[str, NodeBeat], nodes: set[str], now: float) -> None:
        """Record what the device says now for ``nodes`` (and every node with a beat)."""
        for node in nodes | set(beats):
            b = beats.get(node)
            value = b.beat if b is not None else -1
            seen = self._seen.get(node)
            if seen is None or seen[0] != value:
                self._seen[node] = (value, now)

    def dead(self, node: str, beats: dict[str, NodeBeat], now: float) -> str:
        """Why ``node`` counts as dead (``""``: alive, or not yet known to be dead); also
        notes since when (:meth:`dead_for`)."""
        why = self._dead(node, beats, now)
        if not why:
            self._dead_since.pop(node, None)
        else:
            self._dead_since.setdefault(node, now)
        return why

    def dead_for(self, node: str, now: float) -> float:
        """Seconds since this node first found ``node`` dead (0 while it is not)."""
        since = self._dead_since.get(node)
        return 0.0 if since is None else now - since

    def _dead(self, node: str, beats: dict[str, NodeBeat], now: float) -> str:
        b = beats.get(node)
        if b is not None and b.host == socket.gethostname():
            if b.boot_id != boot_id() or process_start(b.pid) != b.start_ticks:
                return "its process is gone"
            return ""  # its process runs here: alive, even with its heartbeat stopped
        seen = self._seen.get(node)
        if seen is None or now - seen[1] < self.lease_s:
            return ""
        return (f"its heartbeat ({seen[0]}) did not advance for {now - seen[1]:.1f} s "
                f"(lease {self.lease_s:g} s)")


class SlabLeaseKeeper:
    """Keeps this node's slabs on every shared device of a store: attach (adopt own
    slabs, from the device), top-up (``spare`` free leased slabs ahead of need), heartbeat
    and renewal, revocation, release at close. Runs on the store's event loop; device
    I/O goes through ``run`` (the store's I/O threads)."""

    def __init__(self, leases: SlabLeases, devices: list[FlashDevice],
                 run: Callable[..., Awaitable[Any]], spare: int = 2,
                 dead_grace_s: float = 60.0) -> None:
        self.leases = leases
        self.dead_grace_s = dead_grace_s  # pod.dead_slab_grace_s
        self.devices = [d for d in devices if d.fence is not None]
        self._run = run
        self.spare = spare
        self.revoked = 0
        # Renewals of a held slab made on the device alone while the index could not be
        # reached (see renew).
        self.device_renewals = 0
        self._beat = 0
        self._beat_deadline = 0.0  # monotonic: writes stop unless the heartbeat advanced
        self._live = {d.index: Liveness(leases.lease_s) for d in self.devices}

    def _deadline(self, index_deadline: float) -> float:
        return min(index_deadline, self._beat_deadline)

    async def heartbeat(self) -> bool:
        """Advance this node's heartbeat on every shared device; True when it was written
        on each (the writes' deadline then moved on)."""
        self._beat += 1
        sent = time.monotonic()
        me = os.getpid()
        beat = NodeBeat(self.leases.node_id, self._beat, me, process_start(me) or 0,
                        boot_id(), socket.gethostname())
        ok = True
        for dev in self.devices:
            if dev.fence is not None and dev.fence.stopped:
                continue  # preempted: it writes nothing more there (SlabFence.stop)
            try:
                faults.point("lease.before_beat")
                await self._run(dev.write_beat, beat)
            except OSError as exc:
                ok = False
                log.warning("flash device %s: writing node %s's heartbeat failed: %s; its "
                            "slabs are written until its lease lapses here", dev.name,
                            beat.node, exc)
        if ok:
            self._beat_deadline = self.leases.deadline(sent)
        return ok

    async def _observe(self, dev: FlashDevice, owners: list[tuple[str, int]]
                       ) -> dict[str, NodeBeat]:
        beats: dict[str, NodeBeat] = await self._run(dev.read_beats)
        nodes = {o for o, _e in owners if o and o != self.leases.node_id}
        self._live[dev.index].observe(beats, nodes, time.monotonic())
        return beats

    async def attach(self) -> None:
        """At start, before the index rebuild: lease again the slabs whose header names
        this node (their records are this node's to index), whatever the index says.
        Raises LeaseError when the index cannot be reached (a shared device is not
        written without it)."""
        await self.heartbeat()
        for dev in self.devices:
            fence = dev.fence
            assert fence is not None
            owners = await self._run(dev.slab_owners)
            await self._observe(dev, owners)
            mine = [s for s, (o, _e) in enumerate(owners) if o == fence.node_id]
            uuid = dev.superblock.device_uuid
            for slab in mine:
                got = await self.leases.grant(uuid, slab, owners[slab][1])
                if got is None:
                    # The index names another node (an old snapshot, a taker that lost a
                    # race): the device says this node's.
                    log.warning("flash device %s: slab %d names node %s on the device but "
                                "the index names another holder; taking the index's lease "
                                "back (the device is the truth)", dev.name, slab,
                                fence.node_id)
                    got = await self.leases.grant(uuid, slab, owners[slab][1], force=True)
                    assert got is not None
                epoch, deadline = got
                if epoch != owners[slab][1]:
                    await self._run(dev.restamp_slab, slab, epoch)
                fence.grant(slab, epoch, self._deadline(deadline))
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
            except (LeaseError, OSError) as exc:
                log.warning("flash device %s: %s", dev.name, exc)
        return got

    async def _top_up(self, dev: FlashDevice, more: int = 0) -> int:
        fence = dev.fence
        assert fence is not None
        need = max(self.spare - len(dev.alloc.free_slab_ids()), more)
        if need <= 0 or fence.stopped:
            return 0
        if time.monotonic() + self.leases.lease_s / 2 > self._beat_deadline:
            await self.heartbeat()  # (the grants' deadlines are bounded by the beat's)
        # The headers as the device holds them now (not as they were at attach).
        stamps: list[tuple[str, int, bool]] = await self._run(dev.slab_stamps)
        owners = [(o, e) for o, e, _r in stamps]
        beats = await self._observe(dev, owners)
        live = self._live[dev.index]
        now = time.monotonic()
        blank: list[int] = []
        dead_empty: list[int] = []
        dead_full: list[int] = []
        for s, (owner, _e, records) in enumerate(stamps):
            if fence.held(s) or dev.alloc.slabs[s].klass is not None:
                continue
            if not owner:
                blank.append(s)  # (a header of the device's non-shared past counts too)
            elif owner != fence.node_id and live.dead(owner, beats, now):
                if not records:
                    dead_empty.append(s)
                elif live.dead_for(owner, now) >= self.dead_grace_s:
                    dead_full.append(s)
        # A dead node's slab with records is taken only when the allocator is out of room
        # (``more``), never as a spare, and only once the node has been dead for
        # pod.dead_slab_grace_s (a killed node restarting takes its slabs back): its
        # acknowledged durable blocks stay served as long as possible.
        order = blank + dead_empty + (dead_full if more > 0 else [])
        uuid = dev.superblock.device_uuid
        got = 0
        for slab in order:
            victim = owners[slab][0]
            if victim and victim != fence.node_id:
                # Where the target has reservations: the dead node's key is preempted
                # (and its queued commands aborted) before its slab is stamped, so a
                # write it still sends fails on the device instead of landing.
                try:
                    done = await self._run(dev.fence_out, victim)
                except OSError as exc:
                    log.warning("flash device %s: slab %d of node %s not taken: %s",
                                dev.name, slab, victim, exc)
                    continue
                if done:
                    log.warning("flash device %s: %s before taking slab %d", dev.name, done,
                                slab)
            grant = await self.leases.grant(uuid, slab, owners[slab][1])
            if grant is None:
                continue
            epoch, deadline = grant
            if not await self._run(dev.claim_slab, slab, epoch, owners[slab]):
                # The header changed since it was read (another node stamped it first).
                await self.leases.release(uuid, slab, epoch)
                continue
            if owners[slab][0]:
                log.warning("flash device %s: took slab %d of node %s (%s) at epoch %d; "
                            "its records there are gone", dev.name, slab, owners[slab][0],
                            live.dead(owners[slab][0], beats, now), epoch)
            fence.grant(slab, epoch, self._deadline(deadline))
            dev.alloc.add_slab(slab)
            got += 1
            if got >= need:
                return got
        return got

    async def renew(self) -> None:
        """Advance the heartbeat, then renew every lease held: a slab whose header on the
        device names another node now is revoked; a lease the index lost is re-created;
        one the index gives another node while the device names this node is taken back.

        When the index cannot be reached (restarting, cut off), a slab whose header, read
        this round after the heartbeat was written, still names this node at its epoch
        (and, where the target has reservations, whose key is still registered) is renewed
        on the device alone, until the heartbeat's deadline: no other node can take it
        before then, since a taker needs this node's heartbeat unchanged for a whole
        lease on its own clock (or its process gone, on this host), the same rule the
        index's lease is only a cache of (docs/reliability.md, "Write-through while the
        index restarts")."""
        beat_ok = await self.heartbeat()
        for dev in self.devices:
            fence = dev.fence
            assert fence is not None
            uuid = dev.superblock.device_uuid
            held = fence.slabs()
            owners: dict[int, tuple[str, int]] | None
            try:
                # Where the target has reservations: is this node's key still registered?
                # (A node that took its slabs preempted it: the fence stops.)
                registered = bool(await self._run(dev.check_registration))
            except OSError as exc:
                registered = False
                log.warning("flash device %s: reading its reservations failed: %s", dev.name,
                            exc)
            try:
                owners = dict(zip(held, await self._run(
                    lambda d=dev, h=held: [d.slab_owner(s) for s in h]), strict=True))
                await self._observe(dev, [])
            except OSError as exc:
                log.warning("flash device %s: reading slab headers failed: %s", dev.name,
                            exc)
                owners = None
            # The index did not answer this round: the rest of the round asks the device
            # only (one bounded wait per round, not one per slab: the next heartbeat is
            # not held up behind a slab count of timeouts).
            index_down: LeaseError | None = None
            on_device = 0
            for slab in held:
                epoch = fence.epoch(slab)
                if owners is not None and owners[slab] != (fence.node_id, epoch):
                    self._revoke(dev, slab, epoch, owners[slab])
                    continue
                deadline: float | None = None
                if index_down is None:
                    try:
                        deadline = await self.leases.renew(uuid, slab, epoch)
                        if deadline is None and owners is not None:
                            log.warning("flash device %s: the index names another holder "
                                        "of slab %d, whose header names node %s at epoch "
                                        "%d; taking the index's lease back", dev.name, slab,
                                        fence.node_id, epoch)
                            deadline = await self.leases.renew(uuid, slab, epoch,
                                                               force=True)
                    except LeaseError as exc:
                        index_down = exc
                if index_down is not None:
                    if (owners is not None and beat_ok and registered
                            and not fence.stopped):
                        fence.grant(slab, epoch, self._beat_deadline)
                        self.device_renewals += 1
                        on_device += 1
                    continue
                if deadline is not None:
                    fence.grant(slab, epoch, self._deadline(deadline))
            if index_down is not None:
                if on_device:
                    log.warning("flash device %s: %s; %d slab leases renewed on the device "
                                "alone (their headers name node %s at their epochs and its "
                                "heartbeat advanced)", dev.name, index_down, on_device,
                                fence.node_id)
                else:
                    why = ("the heartbeat was not written" if not beat_ok else
                           "the slab headers could not be read" if owners is None else
                           "its reservation key could not be checked" if not registered
                           else "the node writes nothing more there")
                    log.warning("flash device %s: %s; %s, so the slabs are written until "
                                "their leases lapse here", dev.name, index_down, why)

    def _revoke(self, dev: FlashDevice, slab: int, epoch: int, on_device: tuple[str, int]
                ) -> None:
        fence = dev.fence
        assert fence is not None
        self.revoked += 1
        fence.revoke(slab)
        dev.alloc.revoke_slab(slab)
        log.warning("flash device %s: slab %d (epoch %d) was taken over by node %r at epoch "
                    "%d (this node was paused or cut off past its lease); nothing more is "
                    "written there", dev.name, slab, epoch, on_device[0], on_device[1])

    async def run(self, period_s: float = 0.2) -> None:
        """Heartbeat and renew every lease / 3 and top up every ``period_s`` until
        cancelled."""
        renew_at = time.monotonic() + self.leases.lease_s / 3
        while True:
            await asyncio.sleep(min(period_s, self.leases.lease_s / 6))
            if time.monotonic() >= renew_at:
                renew_at = time.monotonic() + self.leases.lease_s / 3
                await self.renew()
            await self.top_up()

    async def close(self) -> None:
        """Give back the slabs that hold nothing (their lease stamp blanked, the lease
        released: others take them as blank); the slabs with records stay this node's on
        the device (their blocks stay readable; others take them only once this node's
        heartbeat has stopped for a lease)."""
        for dev in self.devices:
            fence = dev.fence
            assert fence is not None
            if fence.stopped:
                continue  # preempted: it writes nothing more there, lease stamps included
            for slab in dev.alloc.free_slab_ids():
                if fence.held(slab):
                    epoch = fence.epoch(slab)
                    fence.revoke(slab)
                    try:
                        await self._run(dev.unclaim_slab, slab, epoch)
                        await self.leases.release(dev.superblock.device_uuid, slab, epoch)
                    except (LeaseError, OSError) as exc:
                        log.info("flash device %s: %s", dev.name, exc)
