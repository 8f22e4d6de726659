"""One node's pod tier, wired and run: the index client, heartbeat, publisher, the
peer-fetch server, the sources and the fetch path. Built by the service when
``pod.enabled``; ``async with PodNode(cfg, store)`` or :meth:`start` / :meth:`close`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from ctxmem_common.config import Config
from ctxmem_common.errors import ConfigError, Unavailable
from ctxmem_common.keyfile import load_master_key
from ctxmem_common.peer_wire import pod_token
from ctxmem_common.podkeys import PodKeys
from ctxmem_common.protoconv import TIER_DRAM, TIER_FLASH
from ctxmem_dpu.blocks import Block, Namespace
from ctxmem_dpu.pod.entries import RemoteEntry, SharedLocation
from ctxmem_dpu.pod.fetch import RemoteFetch
from ctxmem_dpu.pod.index import ClusterIndex, IndexUnavailable
from ctxmem_dpu.pod.peer_client import PeerSource
from ctxmem_dpu.pod.peer_rdma import open_device
from ctxmem_dpu.pod.peer_server import PeerServer
from ctxmem_dpu.pod.prestage import TenantBudget
from ctxmem_dpu.pod.publisher import Publisher
from ctxmem_dpu.pod.redis_conn import connect
from ctxmem_dpu.pod.sources import RemoteSource
from ctxmem_dpu.store import BlockStore

log = logging.getLogger(__name__)


def pod_master_key(cfg: Config, master_key: bytes | None) -> bytes:
    """The pod's master key: the service's (``encryption``), also when encryption at rest
    is off (it is then read from ``encryption.key_file``/``key_env`` all the same):
    every block a peer serves is authenticated under keys derived from it, so a pod node
    needs one, the same on every node (docs/deploy.md, "A pod's master key")."""
    if master_key is not None:
        return master_key
    try:
        key = load_master_key(replace(cfg.encryption, enabled=True), create=True)
    except ConfigError as exc:
        raise ConfigError(
            f"pod.enabled: a pod node needs the pod's master key (the same on every node: "
            f"blocks served between nodes are authenticated under keys derived from it), "
            f"also with encryption.enabled false; set encryption.key_file or the variable "
            f"named by encryption.key_env ({exc.message})") from None
    assert key is not None
    return key


class PodNode:
    """This node in the pod. ``extra_sources`` go before the peer (shared flash);
    ``shared_location(block)`` says where a block lies on a shared flash device (``None``:
    not on one), so every entry this node publishes carries it.

    Hooks for the tiers: a tier that moves a block somewhere peers should learn about
    (a demotion onto a shared device) calls ``store.announce([block], True)`` (the
    entry is rebuilt with ``shared_location``), or publishes an entry it built itself
    with ``pod_node.publisher.note(ns_digest, key, entry)``."""

    def __init__(self, cfg: Config, store: BlockStore, master_key: bytes,
                 extra_sources: Sequence[RemoteSource] = (),
                 shared_location: Callable[[Block], SharedLocation | None] | None = None
                 ) -> None:
        self.pod = cfg.pod
        self.shared_location = shared_location
        self.store = store
        counters = store.counters
        # Every key the pod uses comes from the master key every node holds (the pod
        # token is mixed into the peer key, never sent): docs/security.md.
        self.keys = PodKeys(master_key, pod_token(self.pod))
        self.index = ClusterIndex(self.pod, connect(self.pod), self.keys)
        self.index.shared_devices = frozenset(
            u for src in extra_sources for u in getattr(src, "device_uuids", ()))
        self.publisher = Publisher(self.pod, self.index, self._holdings, counters)
        # Peer fetch over RDMA where both ends have it (pod.rdma_listen), else TCP.
        self.rdma = open_device(self.pod, counters)
        self.server = PeerServer(self.pod, store, counters, self.keys,
                                 io_timeout_s=cfg.data_plane.read_timeout_s, rdma=self.rdma)
        # `index.live` is replaced at each heartbeat: read it at each call.
        self.peer = PeerSource(self.pod, lambda node: self.index.live.get(node), counters,
                               self.keys, rdma=self.rdma)
        self.fetch = RemoteFetch(store, self.index, [*extra_sources, self.peer], counters,
                                 self.pod.fetch_max_blocks)
        #: Remote blocks each tenant's Prefetch pulls hold at once (docs/pod.md,
        #: "Pre-staging").
        self.prestage_budget = TenantBudget(self.pod.prefetch_max_blocks_per_tenant,
                                            counters)
        self._tasks: set[asyncio.Task[None]] = set()
        self._beat: asyncio.Task[None] | None = None
        self._index_down = False

    def _holdings(self) -> Iterator[tuple[bytes, bytes, RemoteEntry]]:
        for ns, b in self.store.holdings():
            yield ns, b.key, self.entry_of(b)

    def entry_of(self, b: Block) -> RemoteEntry:
        shared = self.shared_location(b) if self.shared_location is not None else None
        return RemoteEntry(self.pod.node_id, TIER_DRAM if b.dram is not None else TIER_FLASH,
                           b.seq, b.length, b.crc, shared, b.key)

    def _on_block(self, b: Block, present: bool) -> None:
        if b.origin is not None:  # a fetched copy: the index names its writer, not us
            return
        self.publisher.note(b.ns, b.key, self.entry_of(b) if present else None)

    # -- deletes and re-puts reach every copy (docs/pod.md) ---------------------------
    async def confirm_delete(self, ns_digest: bytes, keys: Sequence[bytes]) -> None:
        """After a Delete of ``keys`` here: this node's index entries for them are gone
        when this returns, so no copy fetched from them is served on any node (each is
        checked against the index before it is). Raises Unavailable when the index does
        not confirm it."""
        try:
            await self.publisher.send_now(ns_digest, keys)
        except IndexUnavailable as exc:
            self.store.counters["pod_index_errors"] += 1
            raise Unavailable(
                f"Delete of {len(keys)} keys in namespace {ns_digest.hex()}: deleted on "
                f"this node, but the cluster index did not confirm that its entries are "
                f"gone ({exc}); other nodes may still serve copies they fetched until it "
                f"does. Retry the Delete (it is idempotent) once the index answers") from None

    async def confirm_commit(self, ns: Namespace, keys: Sequence[bytes]) -> None:
        """After a Commit of ``keys`` here (the store's ``commit_hook``): keys re-put
        while the index still named this node's earlier block for them are published
        before the Commit is answered. When the index does not confirm it, those blocks
        are taken out again (a retried put stores them anew, and is confirmed then) and
        Unavailable is raised."""
        try:
            await self.publisher.send_urgent(ns.digest, keys)
        except IndexUnavailable as exc:
            self.store.counters["pod_index_errors"] += 1
            todo = self.publisher.urgent_of(ns.digest, keys)
            await self.store.delete(ns, todo)
            raise Unavailable(
                f"Commit in namespace {ns.digest.hex()}: {len(todo)} of its blocks replace "
                f"blocks of this node whose removal the cluster index has not confirmed "
                f"({exc}); those are not stored (other nodes could still serve the earlier "
                f"bytes). Retry the put once the index answers") from None

    async def start(self) -> None:
        await self.server.start()
        self.store.block_listeners.append(self._on_block)
        self.store.commit_hook = self.confirm_commit
        self.publisher.start()
        await self._heartbeat_once()
        self._beat = asyncio.create_task(self._heartbeat(), name="ctxmem-pod-heartbeat")
        log.info("pod node %s: index %s, peer fetch on %s (advertised %s), TLS %s, RDMA %s",
                 self.pod.node_id, self.index._where(), self.server.address,
                 self.pod.advertise, "mutual" if self.pod.tls_cert_file else "off (loopback)",
                 self.rdma.choice.describe() if self.rdma is not None else "off")

    async def _heartbeat_once(self) -> None:
        try:
            vanished = await self.index.heartbeat()
        except IndexUnavailable as exc:
            self.store.counters["pod_index_errors"] += 1
            if not self._index_down:
                self._index_down = True
                log.warning("pod heartbeat failed (%s); peers are treated as gone until "
                            "the index answers", exc)
            self.index.forget_peers()
            return
        if self._index_down:
            self._index_down = False
            log.warning("pod heartbeat: cluster index reachable again")
        if vanished:  # first beat, index restarted, or cut off past the TTL
            self.store.counters["pod_resyncs"] += 1
            self.publisher.resync()

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.pod.heartbeat_s)
            try:
                await self._heartbeat_once()
            except Exception:  # never let liveness stop: log, try again next beat
                log.exception("pod heartbeat failed unexpectedly; retrying")

    async def close(self) -> None:
        """Leave the pod (peers stop asking at once), stop serving; idempotent."""
        if self._beat is None:
            await self.server.close()
            self._close_rdma()
            return
        self._beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._beat
        self._beat = None
        with contextlib.suppress(ValueError):
            self.store.block_listeners.remove(self._on_block)
        self.store.commit_hook = None
        await self.publisher.close()
        with contextlib.suppress(IndexUnavailable):
            await self.index.leave()
        if self._tasks:  # prefetches: each bounded by the fetch timeout; then cancelled
            _done, late = await asyncio.wait(list(self._tasks),
                                             timeout=self.pod.fetch_timeout_s * 2)
            for t in late:
                t.cancel()
        await self.server.close()
        for src in self.fetch.sources:
            await src.close()
        self._close_rdma()
        await self.index.close()

    def _close_rdma(self) -> None:
        """The device, once every connection's QP and MRs are gone (server and peer
        closed first)."""
        if self.rdma is not None:
            self.rdma.close()
            self.rdma = None

    async def __aenter__(self) -> PodNode:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def prefetch(self, ns: Namespace, keys: Sequence[bytes]) -> None:
        """Pull the remote blocks of the leading run of ``keys`` into this node's DRAM in
        the background (pre-staging: bounded by the fetch timeout, and per tenant by
        ``pod.prefetch_max_blocks_per_tenant`` blocks in flight; the blocks past it are
        not pulled, counted ``pod_prefetch_refused_blocks``). Their first Acquire reports
        ``remote→dram``. A Prefetch that finds its tenant at the bound already is refused
        whole, without asking the index (``pod_prefetch_refused_calls``). Errors are
        logged, never raised."""
        budget = self.prestage_budget
        if budget.limit == 0:
            return
        if budget.held(ns.tenant) >= budget.limit:
            self.store.counters["pod_prefetch_refused_calls"] += 1
            return

        async def run() -> None:
            try:
                await self.fetch.prestage(ns, keys, self.prestage_budget)
            except Exception as exc:
                log.warning("pod prefetch of %d keys of namespace %s (tenant %r) failed: "
                            "%s; a get fetches them on demand", len(keys), ns.digest.hex(),
                            ns.tenant, exc)

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
