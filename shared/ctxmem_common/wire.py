"""Framing of the data-plane connections (shared memory and TCP).

Both start with HELLO (session id + session token from Connect) so a data connection is
bound to one session, and through it to one tenant. All integers little-endian.

Shared memory (Unix stream socket)::

    C->S  HELLO  "CXS1" session_id 16B token 16B          S->C  "CXSA" status u32
    C->S  MAP    "CXSM" region u32 generation u32          S->C  "CXSR" status u32
                                                                 generation u32 size u64
                                                                 (+ the region's memfd as
                                                                 SCM_RIGHTS when status 0)
    C->S  OP     "CXSO" op u32 body_len u32 + body     S->C  "CXSP" status u32 op u32
                                                                 body_len u64 + body

OP is the control fast path (:mod:`ctxmem_common.shm_ops`: ACQUIRE, RELEASE, LOOKUP,
ALLOCATE, COMMIT without gRPC), offered when Health says ``shm_ops``. The staging ops
(STAGE_CREATE, STAGE_PUT, STAGE_FREE: :mod:`ctxmem_common.staging_wire`) are OPs too; an
OK answer to STAGE_CREATE carries the new region's memfd as SCM_RIGHTS with its header.
Their replies share the MAP replies' queue, so every reply comes back in request order
(a RELEASE flagged no-reply has none). ``status`` OK: the op's answer; ERROR: an
ErrorCode and a message (the same error as over gRPC); UNSUPPORTED: ask over gRPC
instead; BAD_REQUEST: the frame was malformed, and the service closes the connection
after this reply.

TCP::

    C->S  HELLO  "CXT1" session_id 16B token 16B          S->C  "CXTA" status u8 len u64=0
    C->S  REQ    "CXTR" op u8 id 16B index u32 length u64  (+ payload for WRITE)
    S->C  RESP   "CXTA" status u8 length u64               (+ payload for READ)

``id`` is an allocation id (WRITE into its ``index``-th slot) or a lease id (READ its
``index``-th block). Requests are answered in order, so a client pipelines a whole batch.

The TCP channel carries the same control fast path as the shared-memory socket (the
bodies of :mod:`ctxmem_common.shm_ops`), offered when Health says ``tcp_ops``::

    C->S  OP     "CXTO" op u8 id 16B=0 index u32=0 length u64 + body   (TCP_REQ's layout)
    S->C  OPREP  "CXTP" status u8 op u8 length u64 + body              (TCP_RESP's size)

An OP is answered in order with the READ and WRITE around it (a RELEASE flagged
no-reply has no answer); ``status`` as on the shared-memory socket (OK, ERROR,
UNSUPPORTED, or BAD_REQUEST and the connection closed). An older service answers an OP
BAD_REQUEST (``CXTA``) and closes: a client only sends one when Health offered it.

Session, allocation and lease ids are 16 random bytes (:data:`ID_BYTES`), as in the
protobuf messages (they were u64 counters before: a session one id away was found by
guessing).

The service checks a request's header (magic, op, id, index, length) against the named
allocation or lease before it reads or allocates anything; a bad one is answered with its
status and the connection is closed (no payload is read "to keep framing"). Over a
connection cap the HELLO is answered TOO_MANY_CONNECTIONS. Deadlines and caps:
``data_plane`` in docs/config.md, docs/security.md.
"""

from __future__ import annotations

import enum
import struct

ID_BYTES = 16  # session, allocation and lease ids: secrets.token_bytes(16)

SHM_HELLO = struct.Struct("<4s16s16s")
SHM_STATUS = struct.Struct("<4sI")
SHM_MAP = struct.Struct("<4sII")
SHM_MAP_REPLY = struct.Struct("<4sIIQ")
SHM_OP = struct.Struct("<4sII")  # same size as SHM_MAP: the reader dispatches on magic
SHM_OP_REPLY = struct.Struct("<4sIIQ")  # same size as SHM_MAP_REPLY

SHM_OP_ACQUIRE = 1
SHM_OP_RELEASE = 2
SHM_OP_LOOKUP = 3
SHM_OP_ALLOCATE = 4
SHM_OP_COMMIT = 5
# Staging memory owned by the service (ctxmem_common.staging_wire): served on the
# shared-memory socket only (a TCP connection answers them UNSUPPORTED).
SHM_OP_STAGE_CREATE = 6
SHM_OP_STAGE_PUT = 7
SHM_OP_STAGE_FREE = 8
SHM_STAGE_OPS = frozenset({SHM_OP_STAGE_CREATE, SHM_OP_STAGE_PUT, SHM_OP_STAGE_FREE})
SHM_OP_NAMES = {SHM_OP_ACQUIRE: "acquire", SHM_OP_RELEASE: "release",
                SHM_OP_LOOKUP: "lookup", SHM_OP_ALLOCATE: "allocate", SHM_OP_COMMIT: "commit",
                SHM_OP_STAGE_CREATE: "stage_create", SHM_OP_STAGE_PUT: "stage_put",
                SHM_OP_STAGE_FREE: "stage_free"}

TCP_HELLO = struct.Struct("<4s16s16s")
TCP_REQ = struct.Struct("<4sBxxx16sIQ")
TCP_RESP = struct.Struct("<4sBxxxQ")
TCP_OP = TCP_REQ  # magic b"CXTO", op (SHM_OP_*), id and index zero, body length
TCP_OP_REPLY = struct.Struct("<4sBBxxQ")  # b"CXTP", status, op, body length
TCP_NO_ID = bytes(ID_BYTES)

OP_WRITE = 1
OP_READ = 2


class Status(enum.IntEnum):
    OK = 0
    BAD_REQUEST = 1
    UNAUTHENTICATED = 2
    DENIED = 3
    EXPIRED = 4
    STALE = 5
    WRONG_LENGTH = 6
    PEER_NOT_ALLOWED = 7
    TOO_MANY_CONNECTIONS = 8
    ERROR = 9  # fast path: the body carries an ErrorCode and the message
    UNSUPPORTED = 10  # fast path: this op is not served here; use gRPC


STATUS_TEXT = {
    Status.BAD_REQUEST: "malformed data-plane request",
    Status.UNAUTHENTICATED: "unknown session or wrong session token (service restarted?)",
    Status.DENIED: "the region or slot does not belong to a namespace this session has open",
    Status.EXPIRED: "allocation or lease expired or unknown",
    Status.STALE: "region generation changed (the slab was recycled)",
    Status.WRONG_LENGTH: "payload length differs from the slot's block size",
    Status.PEER_NOT_ALLOWED: "this process's uid/gid is not allowed on the shared-memory "
                             "socket (service.shm_allowed_uids / shm_allowed_gids)",
    Status.TOO_MANY_CONNECTIONS: "too many data connections open (the service's "
                                 "data_plane.max_connections caps); close idle clients or "
                                 "raise the cap",
    Status.ERROR: "the operation failed (the reply names the error)",
    Status.UNSUPPORTED: "this operation is not served on the control fast path here",
}
