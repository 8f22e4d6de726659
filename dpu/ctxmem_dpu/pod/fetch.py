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

import logging
from collections import Counter
from collections.abc import Sequence
from itertools import compress, repeat
from operator import is_

from crc32c import crc32c

from ctxmem_dpu.blocks import Block, Namespace
from ctxmem_dpu.logthrottle import throttled
from ctxmem_dpu.pod import copies as copies_mod
from ctxmem_dpu.pod.entries import RemoteEntry, unpack_entry
from ctxmem_dpu.pod.index import ClusterIndex, IndexUnavailable
from ctxmem_dpu.pod.sources import RemoteSource
from ctxmem_dpu.store import BlockStore

log = logging.getLogger(__name__)


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
            return await self._merged_checking(ns, keys, local, copies)
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
                               ) -> tuple[list[Block | None], list[bytes | None]]:
        """:meth:`merged` when the namespace has fetched copies: the keys that are copies
        are asked along with the misses; those the index no longer names are dropped."""
        ask, held = copies_mod.keys_to_ask(keys, local, copies)
        if not any(ask):
            return local, [None] * len(keys)
        got = await self.lookup(ns.digest, list(compress(keys, ask)))
        remote, stale = copies_mod.check(keys, local, ask, held, got)
        if stale:
            self.store.drop_copies(stale)
        return local, remote

    async def pull(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """Fetch the remote blocks in the leading run of ``keys`` (local or remote, up to
        ``pod.fetch_max_blocks`` remote ones) into local DRAM. Returns how many were
        adopted; the run a following Acquire sees ends at the first that was not."""
        local, remote = await self.merged(ns, keys)
        want: list[RemoteEntry] = []
        raws: list[bytes] = []  # the packed entries: the adopted copies' origins
        for key, b, raw in zip(keys, local, remote, strict=True):
            if b is not None:
                continue
            if raw is None:
                break
            e = unpack_entry(raw, key)
            if e is None or len(want) >= self._max:
                break
            want.append(e)
            raws.append(raw)
        if not want:
            return 0
        data = await self.fetch(ns.digest, want)
        items: list[tuple[bytes, bytes, int]] = []
        for e, d in zip(want, data, strict=True):
            if d is None:
                break  # the run ends at the first block not fetched
            items.append((e.key, d, e.crc32c))
        origins = raws[:len(items)]
        self._counters["pod_fetch_misses"] += len(want) - len(items)
        stale = [e for e, d in zip(want, data, strict=True) if d is None]
        if stale:
            log.debug("%d remote entries of namespace %s were misses", len(stale),
                      ns.digest.hex())
        return await self.store.adopt(ns, items, origins) if items else 0

    async def fetch(self, ns_digest: bytes, entries: Sequence[RemoteEntry]
                    ) -> list[bytes | None]:
        """Per entry, its verified bytes from the first source that has them, or None."""
        out: list[bytes | None] = [None] * len(entries)
        todo = list(range(len(entries)))
        for src in self.sources:
            mine = [i for i in todo if src.accepts(entries[i])]
            if not mine:
                continue
            got = await src.fetch(ns_digest, [entries[i] for i in mine])
            if not src.verifies:  # nothing unauthenticated is adopted
                n = len(got) - got.count(None)
                if n:
                    self._counters["pod_fetch_unauthenticated"] += n
                    throttled(log, logging.WARNING, "pod.fetch_unverified",
                              "source %s returned %d blocks of namespace %s without "
                              "verifying their authenticators; misses (a source must "
                              "set verifies)", src.name, n, ns_digest.hex())
                got = [None] * len(got)
            for i, d in zip(mine, got, strict=True):
                e = entries[i]
                if d is None:
                    continue
                if len(d) != e.nbytes or crc32c(d) != e.crc32c:
                    self._counters["pod_fetch_bad"] += 1
                    throttled(log, logging.WARNING, "pod.fetch_bad",
                              "source %s returned block %s of namespace %s with the "
                              "wrong length or CRC32C; a miss", src.name, e.key.hex()[:16],
                              ns_digest.hex())
                    continue
                out[i] = d
                self._counters[f"pod_fetch_blocks_{src.name}"] += 1
                self._counters[f"pod_fetch_bytes_{src.name}"] += len(d)
            todo = [i for i in todo if out[i] is None]
            if not todo:
                break
        return out
