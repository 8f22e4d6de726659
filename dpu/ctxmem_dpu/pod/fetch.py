"""The fetch path: cluster lookups for the keys this node misses, and pulling remote
blocks into local DRAM through the registered sources, in order.

Sources are a plain list the service builds at start: the shared-flash source first when
registered (it only ``accepts`` entries with a shared location), then the peer. Each
entry is tried with the first source that accepts it; a miss there moves on to the next.
A source returns only blocks it verified under this node's own key of the namespace
(``RemoteSource.verifies``: the authenticator, never the index, proves a block); blocks of
a source that does not verify are not adopted (``pod_fetch_unauthenticated``). Every
block is checked again here (length and CRC32C against the index entry: an accident
check) before it is adopted, so a wrong source answer is a miss.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from itertools import compress, repeat
from operator import is_, is_not

from crc32c import crc32c

from ctxmem_common.protoconv import TIER_REMOTE, TIER_REMOTE_DRAM
from ctxmem_dpu.blocks import Block, Namespace
from ctxmem_dpu.logthrottle import throttled
from ctxmem_dpu.pod import copies as copies_mod
from ctxmem_dpu.pod.entries import RemoteEntry, unpack_entry
from ctxmem_dpu.pod.index import ClusterIndex, IndexUnavailable
from ctxmem_dpu.pod.prestage import TenantBudget
from ctxmem_dpu.pod.sources import RemoteSource
from ctxmem_dpu.store import BlockStore

log = logging.getLogger(__name__)
# Copies of fewer bytes than this (a source that returns bytes) are made on the loop.
COPY_OFF_LOOP = 1 << 20


class RemoteFetch:
    """Lookups across the pod and pulls of remote blocks, for one node."""

    def __init__(self, store: BlockStore, index: ClusterIndex, sources: list[RemoteSource],
                 counters: Counter[str], max_blocks: int) -> None:
        self.store = store
        self.index = index
        #: Tried in order per entry; the service appends at start (shared flash, peer).
        self.sources = sources
        self._counters = counters
        self._max = max_blocks
        self._down = False

    async def lookup(self, ns_digest: bytes, keys: Sequence[bytes]) -> list[bytes | None]:
        """Packed index entries of ``keys`` held by live peers; all misses when the index
        is unreachable (counted, and logged once until it answers again)."""
        self._counters["pod_lookup_keys"] += len(keys)
        try:
            found = await self.index.lookup(ns_digest, keys)
        except IndexUnavailable as exc:
            self._counters["pod_index_errors"] += 1
            if not self._down:
                self._down = True
                log.warning("cluster index unreachable (%s): cross-node hits are misses "
                            "until it answers; local blocks are served as usual", exc)
            return [None] * len(keys)
        if self._down:
            self._down = False
            log.warning("cluster index reachable again: cross-node lookups resumed")
        self._counters["pod_lookup_hits"] += len(found) - found.count(None)
        return found

    async def merged(self, ns: Namespace, keys: Sequence[bytes]
                     ) -> tuple[list[Block | None], list[bytes | None]]:
        """Per key, the local block and (for local misses only) the packed remote entry:
        the cluster is asked only for the keys this node misses, in one round trip."""
        local = self.store.lookup_blocks(ns, keys, prefix=False)
        copies = self.store.fetched_copies(ns.digest)
        if copies:  # fetched copies are checked in the same round trip (pod/copies.py)
            local, remote, _held = await self._merged_checking(ns, keys, local, copies)
            return local, remote
        return await self._merged_plain(ns, keys, local)

    async def _merged_held(self, ns: Namespace, keys: Sequence[bytes]
                           ) -> tuple[list[Block | None], list[bytes | None],
                                      list[Block | None]]:
        """:meth:`merged`, and per key the fetched copy this check looked at (``None``:
        none), for :meth:`_unchecked`."""
        local = self.store.lookup_blocks(ns, keys, prefix=False)
        copies = self.store.fetched_copies(ns.digest)
        if copies:  # fetched copies are checked in the same round trip (pod/copies.py)
            return await self._merged_checking(ns, keys, local, copies)
        return (*await self._merged_plain(ns, keys, local), [None] * len(keys))

    async def _merged_plain(self, ns: Namespace, keys: Sequence[bytes],
                            local: list[Block | None]
                            ) -> tuple[list[Block | None], list[bytes | None]]:
        """:meth:`merged` when the namespace has no fetched copies."""
        # Gather the misses in C; scatter their entries back in one comprehension (faster
        # than map(list.__setitem__): a 10,000-key Lookup; docs/pod.md, "Lookup cost").
        flags = list(map(is_, local, repeat(None)))
        if not any(flags):
            return local, [None] * len(keys)
        got = await self.lookup(ns.digest, list(compress(keys, flags)))
        if len(got) == len(keys):
            return local, got
        it = iter(got)
        return local, [next(it) if f else None for f in flags]

    async def _merged_checking(self, ns: Namespace, keys: Sequence[bytes],
                               local: list[Block | None], copies: dict[bytes, Block]
                               ) -> tuple[list[Block | None], list[bytes | None],
                                          list[Block | None]]:
        """:meth:`_merged_held` when the namespace has fetched copies: the keys that are
        copies are asked along with the misses; those the index no longer names are
        dropped."""
        ask, held = copies_mod.keys_to_ask(keys, local, copies)
        if not any(ask):
            return local, [None] * len(keys), held
        got = await self.lookup(ns.digest, list(compress(keys, ask)))
        remote, stale = copies_mod.check(keys, local, ask, held, got)
        if stale:
            self.store.drop_copies(stale)
        return local, remote, held

    async def pull(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """Fetch the remote blocks in the leading run of ``keys`` (local or remote, up to
        ``pod.fetch_max_blocks`` remote ones) into local DRAM, for the Acquire that
        follows (no await between this and the Acquire's walk of the index). Returns how
        many were adopted; the run a following Acquire sees ends at the first that was
        not.

        Each block lands once, where it will be read: DRAM slots are reserved first
        (:meth:`BlockStore.landing`), a source that :attr:`~RemoteSource.lands` receives
        each block straight into its slot and verifies it there (authenticator, length,
        CRC32C), and the slots are indexed as they are (:meth:`BlockStore.adopt_landed`):
        no buffer between the socket and the slot, no second read.

        A fetched copy is served only by an Acquire whose own index check saw it (or
        that adopted it): one that another pull (a Prefetch's) adopted while this check
        was in flight is dropped before returning (:meth:`_unchecked`), since its entry
        was read before this check and may name bytes deleted since."""
        n, seen = await self._pull(ns, keys, None)
        self._unchecked(ns, keys, seen)
        return n

    async def pull_group(self, members: Sequence[Namespace], keys: Sequence[bytes]
                         ) -> Callable[[Namespace], None]:
        """:meth:`pull` for each member of a block group, the copies no member's check
        saw (or pull adopted) dropped once all are pulled. Returns the same sweep for one
        member, for the group's Acquire to run right before it looks at that member's
        index (no await between): it leases the members one after another, awaiting a
        member's flash promotion in between, and meanwhile another pull (a get's, whose
        index entry was read before a Delete or re-put returned) may adopt over a later
        member's copy (``BlockStore.acquire_group``'s ``recheck``)."""
        done = [(m, (await self._pull(m, keys, None))[1]) for m in members]
        seen = {m.digest: s for m, s in done}
        for m, s in done:
            self._unchecked(m, keys, s)

        def recheck(ns: Namespace) -> None:
            s = seen.get(ns.digest)
            if s is not None:
                self._unchecked(ns, keys, s)
        return recheck

    async def prestage(self, ns: Namespace, keys: Sequence[bytes],
                       budget: TenantBudget) -> int:
        """A Prefetch's background pull: :meth:`pull`'s run, as many of its remote blocks
        as ``ns.tenant``'s ``budget`` admits (the rest refused, counted), adopted as
        copies whose first Acquire reports ``remote→dram``. Returns how many landed."""
        n, _seen = await self._pull(ns, keys, budget)
        return n

    async def _pull(self, ns: Namespace, keys: Sequence[bytes], budget: TenantBudget | None
                    ) -> tuple[int, list[Block | None]]:
        """(blocks adopted, per key the copy this pull vouches for: the one it adopted,
        else the one its index check looked at, ``None`` for none)."""
        local, remote, held = await self._merged_held(ns, keys)
        want: list[RemoteEntry] = []
        raws: list[bytes] = []  # the packed entries: the adopted copies' origins
        for key, b, raw in zip(keys, local, remote, strict=True):
            if b is not None:
                continue
            if raw is None:
                break
            e = unpack_entry(raw, key)
            # A block of another size than the namespace's could never be adopted.
            if e is None or len(want) >= self._max or e.nbytes != ns.block_nbytes:
                break
            want.append(e)
            raws.append(raw)
        if budget is None:
            n, ours = await self._land(ns, want, raws, TIER_REMOTE)
        else:
            taken = budget.take(ns.tenant, len(want)) if want else 0
            try:
                n, ours = await self._land(ns, want[:taken], raws[:taken], TIER_REMOTE_DRAM)
            finally:
                budget.give(ns.tenant, taken)
        if ours:
            held = [ours.get(k, h) for k, h in zip(keys, held, strict=True)]
        return n, held

    async def _land(self, ns: Namespace, want: list[RemoteEntry], raws: list[bytes],
                    fetched: str) -> tuple[int, dict[bytes, Block | None]]:
        """Fetch ``want`` into reserved DRAM slots and adopt the leading run that landed
        (``fetched``: the source their first Acquire reports). Returns how many were
        adopted and, per key of the run that landed, the copy its key holds right after
        the adoption (this pull's, or the one a Prefetch's adoption kept; ``None``: this
        node's own block)."""
        if not want:
            return 0, {}
        store = self.store
        refs = await store.landing(ns, len(want))
        views = [store.dram.view(ref, ns.block_nbytes) for ref in refs]
        try:
            landed = await self.fetch_into(ns.digest, want, views)
        except BaseException:
            for v in views:
                v.release()
            store.free_landing(refs)
            raise
        for v in views:
            v.release()
        # The run ends at the first block not fetched: the later ones are not adopted.
        run = landed.index(False) if False in landed else len(landed)
        self._counters["pod_fetch_misses"] += len(want) - run
        if run < len(want):
            log.debug("%d remote entries of namespace %s were misses", len(want) - run,
                      ns.digest.hex())
        n = store.adopt_landed(ns, refs, [(e.key, e.crc32c, raw) for e, raw in
                                          zip(want, raws, strict=True)],
                               [i < run for i in range(len(want))], fetched)
        copies = store.fetched_copies(ns.digest)  # (no await since the adoption)
        return n, {e.key: copies.get(e.key) for e in want[:run]}

    def _unchecked(self, ns: Namespace, keys: Sequence[bytes], seen: list[Block | None]
                   ) -> None:
        """Drop the copies of ``keys`` that are not the ones the pull vouches for
        (``seen``: adopted by it, or looked at by its check): another pull adopted them
        while this one awaited, under an index entry read before this check. By
        identity, not by key: a get's pull adopts over an earlier copy of the same key.
        Common case: one C-level comparison of the copies per key with ``seen``."""
        copies = self.store.fetched_copies(ns.digest)
        if not copies:
            return
        now = list(map(copies.get, keys))
        if now == seen:  # Block compares by identity
            return
        late = [b for b in compress(now, map(is_not, now, seen)) if b is not None]
        if late:
            self._counters["pod_copies_unchecked"] += len(late)
            self.store.drop_copies(late)

    async def fetch(self, ns_digest: bytes, entries: Sequence[RemoteEntry]
                    ) -> list[bytes | None]:
        """Per entry, its verified bytes from the first source that has them, or None
        (:meth:`fetch_into` buffers of its own)."""
        bufs = [bytearray(e.nbytes) for e in entries]
        landed = await self.fetch_into(ns_digest, entries, [memoryview(b) for b in bufs])
        return [bytes(b) if ok else None for b, ok in zip(bufs, landed, strict=True)]

    async def fetch_into(self, ns_digest: bytes, entries: Sequence[RemoteEntry],
                         views: Sequence[memoryview]) -> list[bool]:
        """Per entry, whether its verified block now lies in ``views[i]`` (its length:
        the entry's), from the first source that had it. A source that lands blocks
        writes them there itself and checks them in place; what another source returns
        is copied there (off the event loop) and its length and CRC32C checked over the
        copy (an accident check; the authenticator was checked by the source)."""
        out = [False] * len(entries)
        todo = list(range(len(entries)))
        for src in self.sources:
            mine = [i for i in todo if src.accepts(entries[i])]
            if not mine:
                continue
            sub = [entries[i] for i in mine]
            if src.lands and src.verifies:
                got = await src.fetch_into(ns_digest, sub, [views[i] for i in mine])
            else:
                got = await self._copied(src, ns_digest, sub, [views[i] for i in mine])
            for i, ok in zip(mine, got, strict=True):
                if ok:
                    out[i] = True
                    self._counters[f"pod_fetch_blocks_{src.name}"] += 1
                    self._counters[f"pod_fetch_bytes_{src.name}"] += entries[i].nbytes
            todo = [i for i in todo if not out[i]]
            if not todo:
                break
        return out

    async def _copied(self, src: RemoteSource, ns_digest: bytes,
                      entries: Sequence[RemoteEntry], views: Sequence[memoryview]
                      ) -> list[bool]:
        """A source that returns bytes: each block copied into its view, then its length
        and CRC32C checked there against the entry (counted ``pod_fetch_copied_bytes``)."""
        got = await src.fetch(ns_digest, entries)
        if not src.verifies:  # nothing unauthenticated is adopted
            n = len(got) - got.count(None)
            if n:
                self._counters["pod_fetch_unauthenticated"] += n
                throttled(log, logging.WARNING, "pod.fetch_unverified",
                          "source %s returned %d blocks of namespace %s without "
                          "verifying their authenticators; misses (a source must "
                          "set verifies)", src.name, n, ns_digest.hex())
            return [False] * len(got)

        def copy_and_check() -> list[bool]:
            ok = []
            for e, v, d in zip(entries, views, got, strict=True):
                if d is None:
                    ok.append(False)
                    continue
                if len(d) == e.nbytes == len(v):
                    v[:] = d
                    if crc32c(v) == e.crc32c:
                        ok.append(True)
                        continue
                ok.append(False)
            return ok

        n = sum(len(d) for d in got if d is not None)
        ok = await asyncio.get_running_loop().run_in_executor(None, copy_and_check) \
            if n >= COPY_OFF_LOOP else copy_and_check()
        self._counters["pod_fetch_copied_bytes"] += sum(
            e.nbytes for e, good in zip(entries, ok, strict=True) if good)
        for e, d, good in zip(entries, got, ok, strict=True):
            if d is not None and not good:
                self._counters["pod_fetch_bad"] += 1
                throttled(log, logging.WARNING, "pod.fetch_bad",
                          "source %s returned block %s of namespace %s with the "
                          "wrong length or CRC32C; a miss", src.name, e.key.hex()[:16],
                          ns_digest.hex())
        return ok
