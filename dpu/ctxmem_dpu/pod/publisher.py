"""Publishing what this node holds to the cluster index, batched and off the put path.

``note`` only records the update in a dict (coalesced per key: the last one wins) and
returns: Commit never waits for the index. A background task sends the pending updates
every ``pod.publish_interval_ms`` in batches of ``pod.publish_batch``, one pipeline per
batch. While the index is unreachable the updates wait (up to ``pod.publish_backlog``;
past it they are dropped and a full republish is scheduled); :meth:`resync` republishes
everything the node holds (after the index restarted or this node was cut off).

Deletes are not batched (docs/pod.md, "Deletes and re-puts across nodes"): the Delete RPC
awaits :meth:`send_now` for its keys, and a Commit awaits :meth:`send_urgent`, which
publishes at once the keys it re-put while their earlier removal was still pending. Both
hold the lock the batches hold, so an update sent now is never overtaken by an older one
of a batch. Pending removals are never dropped when the backlog overflows (only entries
are, which the full republish restores): a removal lost would leave an entry naming bytes
this node no longer holds, which copies fetched on other nodes would still match.

The hook for the tiers (part 3, shared flash): whoever learns a new location of a block
calls ``publisher.note(ns_digest, key, entry)`` with the full :class:`RemoteEntry`
(``shared=SharedLocation(...)`` when the flash tier placed it on a device marked
shared), and ``publisher.note(ns_digest, key, None)`` when this node no longer holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from ctxmem_common.config import PodConfig
from ctxmem_dpu.pod.entries import RemoteEntry
from ctxmem_dpu.pod.index import ClusterIndex, IndexUnavailable

log = logging.getLogger(__name__)

#: Everything this node holds, as (namespace digest, key, entry): for a full republish.
Holdings = Callable[[], Iterable[tuple[bytes, bytes, RemoteEntry]]]


class Publisher:
    """Batches index updates; ``async with`` or :meth:`start` / :meth:`close`."""

    def __init__(self, pod: PodConfig, index: ClusterIndex, holdings: Holdings,
                 counters: Counter[str]) -> None:
        self._pod = pod
        self._index = index
        self._holdings = holdings
        self._counters = counters
        self._pending: dict[tuple[bytes, bytes], RemoteEntry | None] = {}
        #: Keys whose pending entry replaced a pending removal (re-put before the index
        #: confirmed the earlier block gone): a Commit publishes them before answering.
        self._urgent: set[tuple[bytes, bytes]] = set()
        self._lock = asyncio.Lock()  # one sender at a time: batches, send_now, send_urgent
        self._resync = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._down = False

    def note(self, ns_digest: bytes, key: bytes, entry: RemoteEntry | None) -> None:
        """Record that this node now holds ``key`` as ``entry`` (``None``: no longer).
        Never blocks, never raises."""
        k = (ns_digest, key)
        pending = self._pending
        if k in pending:
            if entry is not None and pending[k] is None:
                self._urgent.add(k)
            pending[k] = entry
            return
        if len(pending) >= self._pod.publish_backlog:
            if not self._resync:
                self._overflow()
            if entry is not None and len(pending) >= self._pod.publish_backlog:
                return  # the full republish publishes it
        pending[k] = entry
        if len(pending) >= self._pod.publish_batch:
            self._wake.set()

    def _overflow(self) -> None:
        """The backlog is full: drop the pending entries (a full republish restores them
        once the index answers), keep the removals and the urgent re-puts."""
        log.warning("cluster index backlog full (%d updates, pod.publish_backlog); dropping "
                    "the pending entries and republishing everything once the index "
                    "answers (pending removals are kept)", len(self._pending))
        urgent = self._urgent
        kept = {k: v for k, v in self._pending.items() if v is None or k in urgent}
        self._counters["pod_publish_dropped"] += len(self._pending) - len(kept)
        self._pending = kept
        self._resync = True

    async def send_now(self, ns_digest: bytes, keys: Sequence[bytes]) -> None:
        """Publish at once what this node holds of ``keys`` (a Delete: mostly nothing, so
        the index drops this node's entries for them, whether pending or sent before).
        Raises :class:`IndexUnavailable` when the index does not confirm; the updates
        then stay pending."""
        await self._send({k: self._pending.get((ns_digest, k)) for k in keys}, ns_digest)

    async def send_urgent(self, ns_digest: bytes, keys: Sequence[bytes]) -> None:
        """Publish at once the entries of ``keys`` that replaced a removal not yet
        confirmed (a Commit that re-put them); nothing to do (the common case) costs one
        set test. Raises :class:`IndexUnavailable` as :meth:`send_now`."""
        todo = self.urgent_of(ns_digest, keys)
        if todo:
            await self._send({k: self._pending.get((ns_digest, k)) for k in todo},
                             ns_digest)

    def urgent_of(self, ns_digest: bytes, keys: Sequence[bytes]) -> list[bytes]:
        """Those of ``keys`` still waiting for :meth:`send_urgent`."""
        urgent = self._urgent
        return [k for k in keys if (ns_digest, k) in urgent] if urgent else []

    async def _send(self, updates: dict[bytes, RemoteEntry | None], ns_digest: bytes) -> None:
        async with self._lock:
            # Under the lock: a batch may have sent (and popped) some meanwhile, or a
            # newer note replaced them; send what is pending now (absent: a removal).
            sent = {k: self._pending.get((ns_digest, k)) for k in updates}
            await self._index.apply({ns_digest: sent})
            for k, v in sent.items():  # a newer note for the same key stays pending
                pk = (ns_digest, k)
                if pk in self._pending and self._pending[pk] is v:
                    del self._pending[pk]
                    self._urgent.discard(pk)
            self._counters["pod_published_now"] += len(sent)

    def resync(self) -> None:
        """Republish everything this node holds at the next round."""
        self._resync = True
        self._wake.set()

    @property
    def backlog(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="ctxmem-pod-publisher")

    async def close(self) -> None:
        """Stop; one last bounded attempt to send what is pending. Idempotent."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        with contextlib.suppress(IndexUnavailable):
            await self.flush()

    async def _run(self) -> None:
        interval = self._pod.publish_interval_ms / 1000
        while True:
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval)
            self._wake.clear()
            try:
                await self.flush()
            except Exception as exc:  # IndexUnavailable, or a bug: publishing goes on
                if not isinstance(exc, IndexUnavailable):
                    log.exception("publishing to the cluster index failed unexpectedly")
                self._counters["pod_index_errors"] += 1
                if not self._down:
                    self._down = True
                    log.warning("publishing to the cluster index failed (%s); this node "
                                "keeps serving its own blocks and publishes the %d "
                                "pending updates when the index answers", exc, self.backlog)
                await asyncio.sleep(min(1.0, self._pod.heartbeat_s))
            else:
                if self._down:
                    self._down = False
                    log.warning("cluster index reachable again; publishing caught up")

    async def flush(self) -> None:
        """Send every pending update (and a full republish when one is due), in batches.
        Updates stay pending when the index does not answer."""
        async with self._lock:
            await self._flush()

    async def _flush(self) -> None:
        if self._resync:
            self._resync = False
            try:
                for ns, key, entry in self._holdings():
                    self._pending.setdefault((ns, key), entry)
            except Exception:
                self._resync = True
                raise
        batch = self._pod.publish_batch
        while self._pending:
            items = list(self._pending.items())[:batch]
            grouped: dict[bytes, dict[bytes, RemoteEntry | None]] = {}
            for (ns, key), update in items:
                grouped.setdefault(ns, {})[key] = update
            await self._index.apply(grouped)
            for k, v in items:  # a newer note for the same key stays pending
                if self._pending.get(k, v) is v:
                    self._pending.pop(k, None)
                    self._urgent.discard(k)
            self._counters["pod_publish_batches"] += 1
            self._counters["pod_published"] += len(items)
