"""Run in vLLM's side environment: decode ctxmem's KV event messages with vLLM's own
decoder (``msgspec`` over ``vllm.distributed.kv_events.KVEventBatch``) and print what
they say as JSON. Argument: a JSON file of [[topic hex, seq hex, payload hex], ...]."""

from __future__ import annotations

import json
import sys

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

with open(sys.argv[1]) as f:
    frames = json.load(f)
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
out = []
for topic, seq, payload in frames:
    batch = decoder.decode(bytes.fromhex(payload))
    for ev in batch.events:
        assert isinstance(ev, (BlockStored, BlockRemoved)), type(ev)
        out.append({"topic": bytes.fromhex(topic).decode(),
                    "seq": int.from_bytes(bytes.fromhex(seq), "big"),
                    "kind": type(ev).__name__, "hashes": [h.hex() for h in ev.block_hashes],
                    "medium": ev.medium, "ownership": ev.ownership,
                    "block_size": getattr(ev, "block_size", None), "ts": batch.ts})
print(json.dumps(out))
print("DECODE OK")
