"""Locate: where the leading blocks of a request are held, for KV-aware routers.

A router (llm-d, Dynamo) routes by what each engine holds; with ctxmem in the pod it also
wants to know which node's service holds a prefix, and in which tier, so it can prefer
the node whose DRAM has it. Locate answers that for one namespace: this node's index
first, then (in a pod) the cluster index for this node's misses, in the one HMGET a
pod Lookup already makes (:meth:`ctxmem_dpu.pod.fetch.RemoteFetch.merged`). The answer
stops at the first key no live member holds, as a prefix Lookup does. It is what the
index says (where to look), not a promise: a block can leave a node right after.

:func:`locate` is the whole query, served by gRPC ``Locate`` (the servicer) and by the
metrics port's ``POST /v1/locate`` (:mod:`ctxmem_dpu.control.locate_http`) alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_dpu.blocks import Block
from ctxmem_dpu.control import block_ops
from ctxmem_dpu.control.lookup_wire import key_list, request_keys
from ctxmem_dpu.pod.entries import unpack_entry

if TYPE_CHECKING:
    from ctxmem_dpu.pod.node import PodNode
    from ctxmem_dpu.store import BlockStore

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


async def locate(store: BlockStore, pod: PodNode | None, request: pb.LookupRequest
                 ) -> pb.LocateResponse:
    """Locate ``request`` (a LookupRequest; ``prefix`` and ``want_tier_codes`` ignored) in
    its session's namespace: this node's index, then in a pod the cluster index for the
    rest, in one round trip. The caller has authenticated the session (its token)."""
    _s, ns = block_ops.open_namespace(store, request.session_id, request.namespace_handle)
    keys, checked = request_keys(request)  # validated by the index's lookup
    if pod is None:
        local = store.lookup_blocks(ns, keys, prefix=True, checked=checked)
        return locate_response(key_list(keys[:len(local)]), local, [None] * len(local), "")
    keys = key_list(keys)
    local, remote = await pod.fetch.merged(ns, keys)
    return locate_response(keys, local, remote, pod.pod.node_id)
