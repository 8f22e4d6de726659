"""A client of the metrics port's JSON Locate (``POST /v1/locate``; docs/operations.md,
"Routers"): what a router that speaks HTTP sends, in a few lines of the standard library.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Sequence
from typing import Any

from ctxmem_common.identity import LOCATE_PATH, SESSION_TOKEN_HTTP_HEADER
from ctxmem_common.netaddr import split_hostport


def locate_body(session_id: bytes, namespace_handle: int, keys: Sequence[bytes]) -> bytes:
    """The JSON body of a Locate for ``keys`` in the session's namespace ``handle``."""
    return json.dumps({"session_id": session_id.hex(), "namespace_handle": namespace_handle,
                       "keys": [k.hex() for k in keys]}).encode()


def post_locate(metrics_listen: str, body: bytes, token: bytes | None,
                timeout_s: float = 10.0, method: str = "POST",
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """``(HTTP status, the JSON answer)`` of ``body`` sent to ``metrics_listen``
    (``host:port``) with the session ``token`` (None: no token header). A refusal is an
    answer too (``{"error": ..., "message": ...}``), not an exception."""
    host, port = split_hostport(metrics_listen, "metrics.listen")
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        hdrs = {"Content-Type": "application/json"}
        if token is not None:
            hdrs[SESSION_TOKEN_HTTP_HEADER] = token.hex()
        hdrs.update(headers or {})
        conn.request(method, LOCATE_PATH, body=body, headers=hdrs)
        r = conn.getresponse()
        data = r.read()
        return r.status, json.loads(data) if data else {}
    finally:
        conn.close()


def locate_http(metrics_listen: str, session_id: bytes, token: bytes, namespace_handle: int,
                keys: Sequence[bytes], timeout_s: float = 10.0) -> tuple[int, dict[str, Any]]:
    """Locate ``keys`` over the metrics port: ``(status, answer)``; a 200 answer has the
    fields of the shim's ``LocateResult`` (``num_hits``, ``tiers``, ``nodes``,
    ``node_id``)."""
    return post_locate(metrics_listen, locate_body(session_id, namespace_handle, keys), token,
                       timeout_s)
