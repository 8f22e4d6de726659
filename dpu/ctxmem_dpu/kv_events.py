"""KV events for routers: what this node stores and drops, in the format vLLM publishes.

KV-aware routers (llm-d's KV cache manager, Dynamo's router) learn what each engine holds
from vLLM's KV events: msgpack batches of ``BlockStored`` / ``BlockRemoved`` on a ZMQ PUB
socket, one multipart message per batch (topic, an 8-byte big-endian sequence number, the
payload). ctxmem publishes the same messages for the blocks its service holds, so a
router that already consumes vLLM's events can prefer the node whose ctxmem holds a
prefix (and, with ``medium``, in which tier):

* ``BlockStored`` when blocks are committed (``medium`` ``"CPU"``: ctxmem's DRAM tier) or
  announced again from flash (``"STORAGE"``: vLLM's name for a storage tier);
* ``BlockRemoved`` when blocks leave the index (delete, eviction of the last copy, a
  failed check), ``medium`` ``None`` (every tier of this node);
* ``block_hashes`` are the engine's own block hashes (ctxmem's keys, ``bytes``: vLLM's
  ``ExternalBlockHash`` allows ``bytes``); ``block_size`` is the namespace's tokens per
  block; ``token_ids`` is empty and ``parent_block_hash`` ``None`` (the service never
  sees tokens); ``ownership`` is ``"ctxmem"`` and ``locality`` ``"LOCAL"``.

A batch holds the events of one namespace and goes out under the topic
``<events.topic>@<node>@<model id>`` (llm-d names its topics ``kv@<pod>@<model>``). The
listener (:meth:`KvEventPublisher.note`) only appends to a bounded list on the event
loop; a task sends every ``events.batch_ms``, never blocking: a send the socket cannot
take at once (its high-water mark reached, no subscriber keeping up) is dropped and
counted (``kv_events_dropped``), as vLLM's publisher drops on a full queue. The socket
binds loopback or a Unix socket only (the config check): the events name every tenant's
block hashes and ZMQ here has no authentication. Replay of missed batches (vLLM's
optional ROUTER socket) is not offered: a router that missed events asks Locate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from ctxmem_common.config import EventsConfig
from ctxmem_dpu.blocks import Block, Namespace

log = logging.getLogger(__name__)

MEDIUM_DRAM = "CPU"
MEDIUM_FLASH = "STORAGE"
OWNERSHIP = "ctxmem"
#: Messages the PUB socket queues per subscriber before it drops (ZMQ_SNDHWM).
SEND_HWM = 10_000


def stored_event(keys: list[bytes], block_size: int, medium: str) -> dict[str, Any]:
    """One ``BlockStored`` as vLLM's msgspec struct encodes it (a map tagged ``type``)."""
    return {"type": "BlockStored", "block_hashes": keys, "parent_block_hash": None,
            "token_ids": [], "block_size": block_size, "lora_id": None, "medium": medium,
            "lora_name": None, "locality": "LOCAL", "ownership": OWNERSHIP}


def removed_event(keys: list[bytes]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": keys, "medium": None,
            "locality": "LOCAL", "ownership": OWNERSHIP}


def pack_batch(ts: float, events: list[dict[str, Any]]) -> bytes:
    """A ``KVEventBatch`` (array-like: timestamp, events; no data-parallel rank)."""
    out: bytes = msgpack.packb([ts, events], use_bin_type=True)
    return out


class KvEventPublisher:
    """Collects index changes on the event loop and publishes them in batches."""

    def __init__(self, cfg: EventsConfig, node_id: str,
                 namespace_of: Callable[[bytes], Namespace | None],
                 counters: Counter[str]) -> None:
        self._cfg = cfg
        self._node = node_id or "local"
        self._namespace_of = namespace_of
        self._counters = counters
        # (namespace digest, stored?, medium) -> keys, in arrival order
        self._pending: dict[tuple[bytes, bool, str | None], list[bytes]] = {}
        self._count = 0
        self._seq = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(cfg.endpoint)
        #: The bound address (a tcp:// port 0 becomes the port the kernel chose).
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._task: asyncio.Task[None] | None = None

    def note(self, b: Block, present: bool) -> None:
        """The index listener: ``b`` entered (``present``) or left the index."""
        if self._count >= self._cfg.max_pending:
            self._counters["kv_events_dropped"] += 1
            return
        medium = (MEDIUM_DRAM if b.dram is not None else MEDIUM_FLASH) if present else None
        self._pending.setdefault((b.ns, present, medium), []).append(b.key)
        self._count += 1

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-events")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._cfg.batch_ms / 1000)
            self.flush()

    def flush(self) -> None:
        """Send what is pending now, one message per namespace (never blocks)."""
        if not self._pending:
            return
        pending, self._pending, self._count = self._pending, {}, 0
        by_ns: dict[bytes, list[dict[str, Any]]] = {}
        for (digest, present, medium), keys in pending.items():
            ns = self._namespace_of(digest)
            block_size = ns.layout.tokens_per_block if ns is not None else 0
            by_ns.setdefault(digest, []).append(
                stored_event(keys, block_size, medium or MEDIUM_DRAM) if present
                else removed_event(keys))
        ts = time.time()
        for digest, events in by_ns.items():
            ns = self._namespace_of(digest)
            model = ns.model_id if ns is not None else "_unknown"
            topic = f"{self._cfg.topic}@{self._node}@{model}".encode()
            try:
                self._sock.send_multipart(
                    (topic, self._seq.to_bytes(8, "big"), pack_batch(ts, events)),
                    flags=zmq.NOBLOCK)
            except zmq.Again:
                self._counters["kv_events_dropped"] += sum(len(e["block_hashes"])
                                                           for e in events)
                continue
            self._seq += 1
            self._counters["kv_event_batches"] += 1

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.flush()
        self._sock.close(linger=0)
