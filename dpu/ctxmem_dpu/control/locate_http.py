"""Locate as JSON on the metrics port: ``POST /v1/locate`` (issue 29 item 3).

A router that speaks HTTP asks the same question as gRPC ``Locate`` (which leading blocks
of a request are held, in which tier, on which node) and gets the same answer, computed
by the same code (:func:`ctxmem_dpu.control.locate.locate`), as JSON::

    POST /v1/locate
    ctxmem-session-token: <the session's token, hex>
    Content-Type: application/json

    {"session_id": "<hex>", "namespace_handle": 1, "keys": ["<hex>", ...]}

    200 {"num_hits": 2, "tiers": ["dram", "flash"], "nodes": ["n1", "n2"], "node_id": "n1"}

The fields are those of the shim's ``Namespace.locate`` (``LocateResult``): per hit, its
tier on the holding node and that node's id; ``node_id`` is the answering node's. An
optional ``"prefix": true`` is accepted (Locate answers leading blocks only). A refusal
is ``{"error": <ErrorCode>, "message": ...}`` with an HTTP status: 400 a malformed body,
401 no token, an unknown session or a wrong token (one answer for both, the token compared
in constant time by :func:`ctxmem_dpu.control.auth.session_with_token`, the check of every
gRPC call), 403 the endpoint refuses tokens here (plaintext beyond loopback while gRPC has
TLS), 404 an unknown namespace handle, 405 not a POST, 411 no Content-Length, 413 a body
over :data:`MAX_BODY_BYTES` (refused from its header, never read), 503 the service did not
answer in time. Bounds: the body cap, :data:`~ctxmem_common.keys.MAX_LOOKUP_KEYS` keys,
and the metrics endpoint's own (head deadline, connection caps, workers, request deadline).

This module parses and answers; :class:`ctxmem_dpu.metrics.HttpEndpoint` serves it,
reading the body on its HTTP thread and running :func:`authenticated_locate` on the
service's event loop (the store is not thread-safe).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ctxmem_common.errors import CtxmemError, ErrorCode, InvalidArgument, UnknownSession
from ctxmem_common.identity import LOCATE_PATH, SESSION_TOKEN_HTTP_HEADER
from ctxmem_common.keys import check_key_count
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.protoconv import tier_from_pb
from ctxmem_dpu.blocks import Session
from ctxmem_dpu.control.auth import session_with_token
from ctxmem_dpu.control.locate import locate

if TYPE_CHECKING:
    from ctxmem_dpu.pod.node import PodNode
    from ctxmem_dpu.store import BlockStore

#: The request header that carries the session's token (hex), as the gRPC metadata
#: ``ctxmem-session-token-bin`` carries it raw.
TOKEN_HEADER = SESSION_TOKEN_HTTP_HEADER
#: The largest body served: about 120,000 keys of 32 bytes as hex (a prompt of 2 million
#: tokens at 16 per block). More keys than that: ask gRPC Locate (packed keys).
MAX_BODY_BYTES = 8 << 20

_FIELDS = frozenset({"session_id", "namespace_handle", "keys", "prefix"})

_STATUS = {
    ErrorCode.INVALID_ARGUMENT: "400 Bad Request",
    ErrorCode.UNKNOWN_SESSION: "401 Unauthorized",
    ErrorCode.PERMISSION_DENIED: "403 Forbidden",
    ErrorCode.UNKNOWN_NAMESPACE: "404 Not Found",
    ErrorCode.RESOURCE_EXHAUSTED: "429 Too Many Requests",
    ErrorCode.SHED: "429 Too Many Requests",
    ErrorCode.UNAVAILABLE: "503 Service Unavailable",
    ErrorCode.EXPIRED: "504 Gateway Timeout",
    ErrorCode.INTERNAL: "500 Internal Server Error",
}


def error_status(exc: CtxmemError) -> str:
    """The HTTP status line (without the version) a refusal of ``exc``'s kind gets."""
    return _STATUS.get(exc.code, "500 Internal Server Error")


def error_body(code: ErrorCode | str, message: str) -> bytes:
    """A refusal as JSON: ``{"error": code, "message": message}``."""
    return json.dumps({"error": getattr(code, "value", code), "message": message}).encode()


def token_of(header: str | None) -> bytes | None:
    """The token a ``ctxmem-session-token`` header value carries: None when absent; a
    value that is not hex becomes ``b""`` (it then fails the compare like a wrong one)."""
    if header is None:
        return None
    try:
        return bytes.fromhex(header.strip())
    except ValueError:
        return b""


def parse_request(body: bytes) -> pb.LookupRequest:
    """The LookupRequest a JSON body asks Locate for; InvalidArgument, naming the field,
    for anything else."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise InvalidArgument(f"{LOCATE_PATH}: the body is not JSON ({exc}); send "
                              f'{{"session_id": hex, "namespace_handle": int, "keys": '
                              f"[hex, ...]}}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument(f"{LOCATE_PATH}: the body must be a JSON object, got "
                              f"{type(doc).__name__}")
    extra = sorted(set(doc) - _FIELDS)
    if extra:
        raise InvalidArgument(f"{LOCATE_PATH}: unknown field(s) {extra}; the fields are "
                              f"{sorted(_FIELDS)}")
    missing = sorted({"session_id", "namespace_handle", "keys"} - set(doc))
    if missing:
        raise InvalidArgument(f"{LOCATE_PATH}: missing field(s) {missing}")
    if doc.get("prefix", True) is not True:
        raise InvalidArgument(f"{LOCATE_PATH}: prefix must be true or absent (Locate "
                              f"answers the leading blocks only; per-key presence is Lookup)")
    sid = doc["session_id"]
    if not isinstance(sid, str):
        raise InvalidArgument(f"{LOCATE_PATH}: session_id must be a hex string (Connect's "
                              f"session_id), got {type(sid).__name__}")
    try:
        session_id = bytes.fromhex(sid)
    except ValueError:
        raise InvalidArgument(f"{LOCATE_PATH}: session_id is not hex") from None
    handle = doc["namespace_handle"]
    if not isinstance(handle, int) or isinstance(handle, bool) or not 0 <= handle < 1 << 32:
        raise InvalidArgument(f"{LOCATE_PATH}: namespace_handle must be an integer in "
                              f"[0, 2^32) (OpenNamespace's namespace_handle), got "
                              f"{repr(handle)[:64]}")
    keys = doc["keys"]
    if not isinstance(keys, list):
        raise InvalidArgument(f"{LOCATE_PATH}: keys must be a list of hex strings, got "
                              f"{type(keys).__name__}")
    check_key_count(len(keys))
    return pb.LookupRequest(session_id=session_id, namespace_handle=handle,
                            keys=_hex_keys(keys), prefix=True)


def _hex_keys(keys: list[Any]) -> list[bytes]:
    try:
        return list(map(bytes.fromhex, keys))  # one C-level pass; the culprit named below
    except (TypeError, ValueError):
        pass
    for i, k in enumerate(keys):
        if not isinstance(k, str):
            raise InvalidArgument(f"{LOCATE_PATH}: keys[{i}] must be a hex string, got "
                                  f"{type(k).__name__}") from None
        try:
            bytes.fromhex(k)
        except ValueError:
            raise InvalidArgument(f"{LOCATE_PATH}: keys[{i}] is not hex") from None
    raise AssertionError("unreachable: a key failed to decode and then decoded")


async def authenticated_locate(store: BlockStore, pod: PodNode | None,
                               request: pb.LookupRequest, token: bytes
                               ) -> pb.LocateResponse:
    """Locate ``request`` once ``token`` proves its session (on the service's loop)."""
    sessions: Callable[[bytes], Session | None] = store.live_session
    if session_with_token(sessions, request.session_id, token) is None:
        raise UnknownSession(f"{LOCATE_PATH}: unknown session or wrong session token (the "
                             f"service restarted or the session closed); reconnect")
    return await locate(store, pod, request)


def response_body(resp: pb.LocateResponse) -> bytes:
    """The answer as JSON, with the fields of the shim's ``LocateResult``."""
    return json.dumps({
        "num_hits": resp.num_hits,
        "tiers": [tier_from_pb(x.tier) for x in resp.locations],
        "nodes": [x.node_id for x in resp.locations],
        "node_id": resp.node_id,
    }).encode()
