"""The service's side of the staging ops (STAGE_CREATE, STAGE_PUT, STAGE_FREE; bodies in
:mod:`ctxmem_common.staging_wire`), served on the shared-memory socket only: a region's
memfd can only be handed over a Unix socket (SCM_RIGHTS), so over TCP they are answered
UNSUPPORTED.

Each op looks the connection's session up again (an ended session is refused) and
checks everything against the service's own state (the region belongs to this session,
every entry lies in the region's data, the namespace is open in this session) before
any byte moves; :mod:`ctxmem_dpu.store.staging` has the trust surface.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ctxmem_common import staging_wire
from ctxmem_common.errors import CtxmemError
from ctxmem_common.shm_ops import Body
from ctxmem_common.wire import SHM_OP_STAGE_CREATE, SHM_OP_STAGE_PUT, Status

if TYPE_CHECKING:
    from ctxmem_dpu.store import BlockStore

__all__ = ["serve_staging_op"]


async def serve_staging_op(store: BlockStore, session_id: bytes, op: int, body: Body
                           ) -> tuple[Status, bytes]:
    """Run one staging op; ValueError for a body that does not decode (the caller
    answers BAD_REQUEST), CtxmemError for a refusal (answered ERROR)."""
    s = store.session(session_id)
    if op == SHM_OP_STAGE_CREATE:
        nbytes = staging_wire.decode_create(body)
        r = await store.staging.create(s, nbytes,
                                       store.cfg.quotas.of(s.tenant).staging_max_bytes)
        return Status.OK, staging_wire.encode_create_reply(store.staging.created(r))
    if op == SHM_OP_STAGE_PUT:
        req = staging_wire.decode_put(body)
        ns = store.namespace(s, req.handle)
        r = store.staging.region(s, req.region_id)
        store.staging.check_entries(r, req.offsets, req.lengths, ns.block_nbytes)
        try:
            out = await store.put_staged(s, ns, r, req.keys.tolist(), req.offsets, req.crcs)
        except ValueError as exc:  # not the body's fault: never answered BAD_REQUEST
            if isinstance(exc, CtxmemError):
                raise
            raise CtxmemError(f"staged put from region {r.id}: {exc}; report it") from exc
        return Status.OK, staging_wire.encode_put_reply(out)
    store.staging.free(s, staging_wire.decode_free(body))
    return Status.OK, b""
