"""The service's side of the control fast path: one decoded op in, one reply body out
(frames in :mod:`ctxmem_common.wire`, bodies in :mod:`ctxmem_common.shm_ops`). Both the
shared-memory socket (:mod:`.shm`) and the TCP data channel (:mod:`.tcp`) serve their OP
frames through :func:`serve_op`, so the two refuse and answer alike.

The connection's session was authenticated by its HELLO; each op looks it up again
(``block_ops`` take the session id), so an op on a connection whose session ended or
expired is answered UNKNOWN_SESSION and the client reconnects. Every check is the gRPC
path's own (:mod:`ctxmem_dpu.control.block_ops`); a body that does not decode is
:class:`Malformed` (the caller answers BAD_REQUEST and closes the connection).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ctxmem_common import shm_ops as wire_ops
from ctxmem_common.errors import CtxmemError
from ctxmem_common.shm_ops import Body
from ctxmem_common.wire import (
    SHM_OP_ACQUIRE,
    SHM_OP_ALLOCATE,
    SHM_OP_COMMIT,
    SHM_OP_LOOKUP,
    SHM_OP_RELEASE,
    SHM_STAGE_OPS,
    Status,
)
from ctxmem_dpu.control import block_ops
from ctxmem_dpu.transport.shm_staging import serve_staging_op

if TYPE_CHECKING:
    from ctxmem_dpu.store import BlockStore

__all__ = ["Malformed", "serve_op"]

# Ops that read the index and therefore need the pod's cluster view in pod mode: there
# they are answered UNSUPPORTED and the client asks over gRPC.
POD_GRPC_ONLY = frozenset({SHM_OP_ACQUIRE, SHM_OP_LOOKUP})


class Malformed(Exception):
    """The body does not decode (counts and length disagree, flags unknown)."""


async def serve_op(store: BlockStore, session_id: bytes, op: int, body: Body,
                   pod: bool, staging: bool = False) -> tuple[Status, bytes] | None:
    """Run one op for the connection's session: (status, reply body), or None for a
    RELEASE flagged no-reply. A CtxmemError becomes Status.ERROR with its code and
    message; Malformed propagates. ``staging``: the connection can carry a staging
    region's fd (the shared-memory socket); elsewhere the staging ops are UNSUPPORTED."""
    if pod and op in POD_GRPC_ONLY:
        return Status.UNSUPPORTED, b""
    if op in SHM_STAGE_OPS:
        if not staging:
            return Status.UNSUPPORTED, b""
        try:
            return await serve_staging_op(store, session_id, op, body)
        except CtxmemError as exc:
            return Status.ERROR, wire_ops.encode_error(exc)
        except ValueError as exc:
            raise Malformed(str(exc)) from None
    try:
        if op == SHM_OP_RELEASE:
            try:
                ids, reply = wire_ops.decode_release(body)
            except ValueError as exc:
                raise Malformed(str(exc)) from None
            try:
                valid = store.release(store.session(session_id), ids)
            except CtxmemError:
                if not reply:  # nobody reads it: an ended session's leases ended with it
                    return None
                raise
            return (Status.OK, wire_ops.encode_release_reply(valid)) if reply else None
        if op == SHM_OP_COMMIT:
            try:
                aid, crcs, abort = wire_ops.decode_commit(body)
            except ValueError as exc:
                raise Malformed(str(exc)) from None
            n = await block_ops.commit(store, session_id, aid, crcs, abort)
            return Status.OK, wire_ops.encode_commit_reply(n)
        return await _keys_op(store, session_id, op, body)
    except CtxmemError as exc:
        return Status.ERROR, wire_ops.encode_error(exc)


async def _keys_op(store: BlockStore, session_id: bytes, op: int, body: Body
                   ) -> tuple[Status, bytes]:
    s = store.session(session_id)  # an ended session first, whatever the body
    try:
        req = wire_ops.decode_keys_request(body, lookup=op == SHM_OP_LOOKUP)
    except ValueError as exc:
        if isinstance(exc, CtxmemError):  # bad keys: the same answer as over gRPC
            raise
        raise Malformed(str(exc)) from None
    ns = store.namespace(s, req.handle)
    if op == SHM_OP_LOOKUP:
        n, codes = block_ops.lookup(store, ns, req.keys, req.prefix, checked=True)
        return Status.OK, wire_ops.encode_lookup_reply(n, codes)
    keys: list[bytes] = req.keys.tolist()
    if op == SHM_OP_ACQUIRE:
        # decode_keys_request refused bad and duplicate keys (as validate_keys would)
        lease, sources = await block_ops.acquire(store, s, ns, keys, keys_checked=True)
        regions, gens, offsets, lengths, crcs = block_ops.lease_slots(store, lease)
        return Status.OK, wire_ops.encode_acquire_reply(
            lease.id, regions, gens, offsets, lengths, crcs, sources)
    assert op == SHM_OP_ALLOCATE
    a, exists, (a_regions, a_gens, a_offsets, a_lengths, _) = await block_ops.allocate(
        store, s, ns, keys)
    return Status.OK, wire_ops.encode_allocate_reply(a.id, exists, a_regions, a_gens,
                                                     a_offsets, a_lengths)
