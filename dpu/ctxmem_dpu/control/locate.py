"""Locate: where the leading blocks of a request are held, for KV-aware routers.

A router (llm-d, Dynamo) routes by what each engine holds; with ctxmem in the pod it also
wants to know which node's service holds a prefix, and in which tier, so it can prefer
the node whose DRAM has it. Locate answers that for one namespace: this node's index
first, then (in a pod) the cluster index for this node's misses, in the one HMGET a
pod Lookup already makes (:meth:`ctxmem_dpu.pod.fetch.RemoteFetch.merged`). The answer
stops at the first key no live member holds, as a prefix Lookup does. It is what the
index says (where to look), not a promise: a block can leave a node right after.
"""

from __future__ import annotations

from collections.abc import Sequence

from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_dpu.blocks import Block
from ctxmem_dpu.pod.entries import unpack_entry

_TIERS = {"dram": pb.TIER_DRAM, "flash": pb.TIER_FLASH}


def locate_response(keys: Sequence[bytes], local: Sequence[Block | None],
                    remote: Sequence[bytes | None], node_id: str) -> pb.LocateResponse:
    """The leading run of ``keys`` held somewhere: a local block (``local[i]``) is this
    node's, in DRAM when it has a copy there; else a remote entry (``remote[i]``, packed
    as the index holds it) names its holder and tier; an entry that does not unpack ends
    the run like a miss."""
    out = pb.LocateResponse(node_id=node_id)
    locs = out.locations
    for key, b, raw in zip(keys, local, remote, strict=True):
        if b is not None:
            locs.add(tier=pb.TIER_DRAM if b.dram is not None else pb.TIER_FLASH,
                     node_id=node_id)
            continue
        e = unpack_entry(raw, key) if raw is not None else None
        if e is None:
            break
        locs.add(tier=_TIERS[e.tier], node_id=e.node_id)
    out.num_hits = len(locs)
    return out
