"""The cluster index: which node holds which block, on Redis/Valkey (docs/pod.md).

Every call is one round trip (a pipeline or one command per namespace) and bounded by
``pod.index_timeout_s``; an unreachable index raises :class:`IndexUnavailable`, which
the callers turn into misses (lookups) or a backlog (publishing). Liveness: each node
refreshes ``ctxmem:{nodes}:alive:ID`` (a TTL) in :meth:`heartbeat`, which also reads which other
nodes are alive; entries of a node not alive are ignored by :meth:`lookup` and deleted
lazily (:meth:`drop_stale`, a conditional delete: only the value that was judged stale).

Names: every namespace and block key is stored under a keyed hash
(:class:`~ctxmem_common.podkeys.PodKeys`: the hash tag, and the hash fields computed in
C for a whole request), so what the index reveals to whoever reads it is node ids,
addresses, sizes and counts, never a block key or a namespace digest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from itertools import compress, repeat
from operator import getitem, is_not
from typing import TYPE_CHECKING, Any

from ctxmem_common.config import PodConfig
from ctxmem_common.podkeys import PodKeys
from ctxmem_dpu.pod.entries import (
    NODES_KEY,
    RemoteEntry,
    alive_key,
    blocks_key,
    node_prefix,
    pack_entry,
    unpack_entry,
)

if TYPE_CHECKING:
    from ctxmem_dpu.pod.redis_conn import IndexClient

log = logging.getLogger(__name__)

# Delete hash fields whose value starts with ARGV[1] (this node's own entries).
_DEL_IF_PREFIX = """
local n = 0
for i = 2, #ARGV do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  if v and string.sub(v, 1, #ARGV[1]) == ARGV[1] then
    n = n + redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
return n
"""
# Delete hash fields whose value is exactly the stale one (pairs field, value).
_DEL_IF_EQUAL = """
local n = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    n = n + redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
return n
"""


class IndexUnavailable(Exception):
    """The index did not answer within its timeout, or refused (what and why in the
    message)."""


class ClusterIndex:
    """This node's view of the pod's index: publish, look up, liveness."""

    def __init__(self, pod: PodConfig, client: IndexClient, keys: PodKeys) -> None:
        self.pod = pod
        self.keys = keys
        self.node_id = pod.node_id
        self._r = client
        self._prefix = node_prefix(pod.node_id)
        self._del_equal = client.register_script(_DEL_IF_EQUAL)
        #: Live peers (not this node) → advertised address, as of the last heartbeat.
        self.live: dict[str, str] = {}
        self.live_at = 0.0
        self._cleanups: set[asyncio.Task[None]] = set()
        self._live_prefixes: set[bytes] = set()
        #: This node's publish epoch (see ``entries``): a new one at each full republish.
        self.epoch = 0
        self._beat_ok = 0.0  # monotonic time of the last acknowledged heartbeat
        # A call failed (any: lookup, publish, heartbeat) and when it last did: the index
        # may have lost writes it had acknowledged (a Redis Cluster master failed over to
        # a replica that lagged), so the node republishes once calls succeed again.
        self._troubled = False
        self._trouble_at = 0.0
        #: UUIDs (hex) of the shared flash devices this node reads directly: an entry
        #: located there outlives its writer (docs/pod.md, "Shared flash"), so a dead
        #: node's entry on one of them is still a hit and is not cleaned up.
        self.shared_devices: frozenset[str] = frozenset()

    def blocks_key(self, ns_digest: bytes) -> str:
        """The Redis hash of namespace ``ns_digest``'s entries (a keyed name)."""
        return blocks_key(self.keys.index_tag(ns_digest))

    async def _call(self, what: str, coro: Any) -> Any:
        try:
            return await asyncio.wait_for(coro, self.pod.index_timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            self._note_trouble()
            raise IndexUnavailable(
                f"cluster index {what}: no answer from {self._where()} within "
                f"pod.index_timeout_s={self.pod.index_timeout_s} s") from None
        except Exception as exc:  # redis.exceptions.* and OSError: the index is down
            raise self._failed(what, exc) from None

    def _note_trouble(self) -> None:
        self._troubled = True
        self._trouble_at = time.monotonic()

    def _failed(self, what: str, exc: Exception) -> IndexUnavailable:
        """The error for a failed call, with what to do when TLS says why."""
        self._note_trouble()
        text = f"{type(exc).__name__}: {exc}"
        hint = ""
        if "CERTIFICATE_REQUIRED" in text or "certificate required" in text:
            hint = ("; the index requires a client certificate: set pod.index_cert_file "
                    "and pod.index_key_file (signed by a CA the index trusts)")
        elif self.pod.index_cert_file and ("UNKNOWN_CA" in text or "BAD_CERTIFICATE" in text
                                           or "CERTIFICATE_EXPIRED" in text):
            hint = (f"; the index refused this node's client certificate "
                    f"{self.pod.index_cert_file} (pod.index_cert_file): is it signed by the "
                    f"CA the index trusts (tls-ca-cert-file), and valid?")
        elif (self.pod.index_url.startswith("rediss://") and not self.pod.index_cert_file
              and any(s in text for s in ("reset by peer", "closed by server", "EOF"))):
            # TLS 1.3 checks the client's certificate after the client's handshake is
            # done: the server's alert can be lost to the reset of the connection, so a
            # closed connection is all the node sees. Say what it most likely means.
            hint = ("; the index closed the TLS connection: if it requires client "
                    "certificates (tls-auth-clients yes), set pod.index_cert_file and "
                    "pod.index_key_file")
        return IndexUnavailable(f"cluster index {what} at {self._where()} failed: {text}"
                                f"{hint}")

    def _where(self) -> str:
        url = self.pod.index_url
        return url.split("@", 1)[-1] if "@" in url else url.split("//", 1)[-1]

    # -- liveness --------------------------------------------------------------------
    async def heartbeat(self) -> bool:
        """Refresh this node's alive key and read which peers are alive. Returns whether
        the caller must republish everything it holds: this node's key had vanished
        (first beat, index restarted, or no beat acknowledged for longer than the TTL), or
        the index is answering again after calls failed (a failover may have lost entries
        it had acknowledged; the first beat with no failure for a heartbeat period)."""
        try:
            return await self._heartbeat()
        except IndexUnavailable:
            raise
        except Exception as exc:  # a pipeline's setup or reset on a dead connection
            raise self._failed("heartbeat", exc) from None

    async def _heartbeat(self) -> bool:
        ttl_ms = int(self.pod.node_ttl_s * 1000)
        async with self._r.pipeline(transaction=False) as p:
            p.set(alive_key(self.node_id), self.pod.advertise, px=ttl_ms, get=True)
            p.hset(NODES_KEY, self.node_id, self.pod.advertise)
            p.hgetall(NODES_KEY)
            old, _n, nodes = await self._call("heartbeat", p.execute())
        peers = {k.decode(): v.decode() for k, v in nodes.items()
                 if k.decode() != self.node_id}
        names = sorted(peers)
        async with self._r.pipeline(transaction=False) as p:
            for name in names:
                p.exists(alive_key(name))
            alive = await self._call("liveness read", p.execute()) if names else []
        self.live = {n: peers[n] for n, a in zip(names, alive, strict=True) if a}
        self._live_prefixes = {node_prefix(n) for n in self.live}
        # Vanished: the key was gone, or the last acknowledged beat is older than the TTL
        # (peers may have judged this node dead and deleted its entries, even if a SET
        # retransmitted after a partition has since put the key back).
        now = self.live_at = time.monotonic()
        vanished = old is None or now - self._beat_ok > self.pod.node_ttl_s
        self._beat_ok = now
        if vanished:  # everything is republished under a new epoch
            self.epoch += 1
        recovered = self._troubled and now - self._trouble_at > self.pod.heartbeat_s
        if recovered:
            self._troubled = False
            log.warning("cluster index answering again after failed calls: republishing "
                        "what this node holds (entries written just before a failover "
                        "may have been lost)")
        return vanished or recovered

    def forget_peers(self) -> None:
        """Treat every peer as gone (the index does not answer: liveness is unknown)."""
        self.live = {}
        self._live_prefixes = set()

    async def leave(self) -> None:
        """Mark this node dead now (clean stop): peers stop asking it at once."""
        await self._call("leave", self._r.delete(alive_key(self.node_id)))

    # -- publish ---------------------------------------------------------------------
    async def apply(self, updates: dict[bytes, dict[bytes, RemoteEntry | None]]) -> int:
        """Publish a batch: per namespace, key → entry (``None``: this node dropped it).
        One pipeline for the whole batch. Returns how many updates were sent."""
        try:
            return await self._apply(updates)
        except IndexUnavailable:
            raise
        except Exception as exc:  # a pipeline's setup or reset on a dead connection
            raise self._failed("publish", exc) from None

    async def _apply(self, updates: dict[bytes, dict[bytes, RemoteEntry | None]]) -> int:
        n = 0
        async with self._r.pipeline(transaction=False) as p:
            for ns, per_key in updates.items():
                fields = self.keys.index_fields(ns, list(per_key))
                sets = {f: pack_entry(e, self.epoch)
                        for f, e in zip(fields, per_key.values(), strict=True)
                        if e is not None}
                gone = [f for f, e in zip(fields, per_key.values(), strict=True)
                        if e is None]
                name = self.blocks_key(ns)
                if sets:
                    p.hset(name, mapping=sets)  # type: ignore[arg-type]
                if gone:  # EVAL, not EVALSHA: a cluster pipeline loads no scripts
                    p.eval(_DEL_IF_PREFIX, 1, name, self._prefix, *gone)
                n += len(per_key)
            if n:
                await self._call("publish", p.execute())
        return n

    # -- lookup ----------------------------------------------------------------------
    async def lookup(self, ns_digest: bytes, keys: Sequence[bytes]) -> list[bytes | None]:
        """The packed entries of ``keys`` held by live peers (``None``: no entry, this
        node's own, a dead node's, or unreadable): one HMGET, and per value one slice
        compared with the live nodes' prefixes (no unpacking: a 10,000-key Lookup needs
        only which keys are held). :func:`~ctxmem_dpu.pod.entries.unpack_entry` gives
        the entries of the ones a fetch wants."""
        if not keys:
            return []
        raw = await self._call("lookup", self._r.hmget(
            self.blocks_key(ns_digest), self.keys.index_fields(ns_digest, keys)))
        live = self._live_prefixes
        # The common case, checked in C: every value is a live peer's entry. A prefix
        # holds the node id's length byte, so a match is exact; when the live nodes' ids
        # have one length, the set of the values' prefixes must be among theirs.
        values = compress(raw, map(is_not, raw, repeat(None)))
        if len(lengths := {len(p) for p in live}) == 1:
            if set(map(getitem, values, repeat(slice(0, lengths.pop())))) <= live:
                return list(raw)
        elif live and all(map(bytes.startswith, values, repeat(tuple(live)))):
            return list(raw)
        try:  # then per value: a live peer's entry or no entry
            out: list[bytes | None] = [v if v is not None and v[:2 + v[1]] in live else None
                                       for v in raw]
        except IndexError:  # a value shorter than 2 bytes: not an entry (below)
            out = [None] * len(raw)
        if out.count(None) == raw.count(None):
            return out
        # Values that are neither: this node's own, a dead node's (on shared flash still a
        # hit), or unreadable.
        mine = self._prefix
        dead: list[tuple[bytes, bytes]] = []
        for i, (key, value) in enumerate(zip(keys, raw, strict=True)):
            if value is None or out[i] is not None or len(value) < 2:
                continue
            if value[:2 + value[1]] in live:
                out[i] = value
                continue
            if self.shared_devices and not value.startswith(mine):
                e = unpack_entry(value)
                if e is not None and e.shared is not None \
                        and e.shared.device_uuid in self.shared_devices:
                    out[i] = value  # on shared flash: readable whoever wrote it
                    continue
            if not value.startswith(mine):
                dead.append((key, value))
        if dead:
            task = asyncio.get_running_loop().create_task(self._drop_quietly(ns_digest, dead))
            self._cleanups.add(task)
            task.add_done_callback(self._cleanups.discard)
        return out

    async def drop_stale(self, ns_digest: bytes, stale: Sequence[tuple[bytes, bytes]]) -> int:
        """Delete entries (block key, exact packed value) found stale: a dead holder's, or
        one the holder no longer has. Another node's newer entry for the same key is
        kept."""
        if not stale:
            return 0
        fields = self.keys.index_fields(ns_digest, [k for k, _v in stale])
        args = [x for f, (_k, v) in zip(fields, stale, strict=True) for x in (f, v)]
        return int(await self._call("stale cleanup", self._del_equal(
            keys=[self.blocks_key(ns_digest)], args=args)))

    async def _drop_quietly(self, ns_digest: bytes, stale: list[tuple[bytes, bytes]]) -> None:
        """Delete entries of nodes whose alive key is gone from the index itself (not
        merely missing from this node's cached view, which lags a heartbeat): a node that
        comes back finds its own key gone too, and republishes everything it holds."""
        try:
            nodes = sorted({e.node_id for _k, v in stale
                            if (e := unpack_entry(v)) is not None})
            alive = await self._call("liveness check", self._r.exists(
                *[alive_key(n) for n in nodes])) if nodes else 0
            if alive:  # one of them is alive: check each
                async with self._r.pipeline(transaction=False) as p:
                    for n in nodes:
                        p.exists(alive_key(n))
                    flags = await self._call("liveness check", p.execute())
                live = {n for n, f in zip(nodes, flags, strict=True) if f}
                stale = [(k, v) for k, v in stale
                         if (e := unpack_entry(v)) is not None and e.node_id not in live]
            await self.drop_stale(ns_digest, stale)
        except Exception as exc:  # IndexUnavailable mostly; cleanup is best effort
            log.debug("lazy cleanup of %d stale entries skipped: %s", len(stale), exc)

    async def close(self) -> None:
        """Wait for lazy cleanups (each bounded by the index timeout), close the
        connections; idempotent."""
        if self._cleanups:
            await asyncio.wait(list(self._cleanups))
        await self._r.aclose()
