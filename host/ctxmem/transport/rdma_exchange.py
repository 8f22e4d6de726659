"""RDMA channel, shim side: the control-plane exchange before a queue pair connects.

``RdmaInfo`` tells the shim the service's device (GID, LID, MTU, READ depth); the shim
picks its own device and GID towards it; ``RdmaAttach`` (in :mod:`ctxmem.transport.rdma`)
then swaps the two QPs' numbers. A refused or timed-out call becomes a
:class:`~ctxmem.transport.base.TransportError` that says why.
"""

from __future__ import annotations

import os
from typing import Any

from ctxmem.transport.base import TransportError
from ctxmem.transport.rdma_verbs import ENV_DEVICE, ENV_GID_INDEX, RdmaError, _env_int
from ctxmem_common import rdma_wire as rw
from ctxmem_common.errors import ERROR_METADATA_KEY
from ctxmem_common.identity import SESSION_TOKEN_METADATA_KEY
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.proto import ctxmem_pb2_grpc as pb_grpc

__all__ = ["choose_device", "rdma_info", "refusal"]


def rdma_info(stub: pb_grpc.ContextMemoryStub, session_id: bytes, token: bytes,
              timeout_s: float) -> pb.RdmaInfoResponse:
    """The service's RDMA device (GID, LID, MTU, READ depth) for ``session_id``.

    Raises:
        TransportError: the call was refused or timed out (the message says why), or
            the answer is malformed.
    """
    import grpc

    try:
        resp: pb.RdmaInfoResponse = stub.RdmaInfo(
            pb.RdmaInfoRequest(session_id=session_id, session_token=token),
            timeout=timeout_s, metadata=((SESSION_TOKEN_METADATA_KEY, token),))
    except grpc.RpcError as exc:
        raise refusal("RdmaInfo", session_id, timeout_s, exc) from None
    if len(resp.gid) != 16:
        raise TransportError(f"RdmaInfo for session {session_id.hex()}: the service sent a "
                             f"{len(resp.gid)}-byte GID, not 16; is it a ctxmem service "
                             f"of this version?")
    return resp


def refusal(call: str, session_id: bytes, timeout_s: float, exc: Any) -> TransportError:
    """The :class:`TransportError` for a failed ``RdmaInfo``/``RdmaAttach`` call."""
    import grpc

    code = exc.code()
    details = exc.details() or ""
    what = f"{call} for session {session_id.hex()}"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return TransportError(f"{what}: the service does not implement {call} (a ctxmem "
                              f"version without RDMA in ctxmem.proto); upgrade it or use "
                              f"transport='tcp'")
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return TransportError(f"{what}: no answer from the service within "
                              f"{timeout_s:g} s ({code.name}: {details})")
    # The ctxmem error code (UNKNOWN_SESSION, ...) where it says more than the status.
    kind = dict(exc.trailing_metadata() or ()).get(ERROR_METADATA_KEY, code.name)
    status = code.name if kind == code.name else f"{code.name}, {kind}"
    return TransportError(f"{what} failed ({status}): {details}")


def choose_device(server: pb.RdmaInfoResponse, device: str, gid_index: int) -> rw.GidChoice:
    """This host's device and GID to reach the service's GID in ``server``: ``device`` /
    ``gid_index`` when given (else the environment's), else by route to its IPv4 GID."""
    device = device or os.environ.get(ENV_DEVICE, "")
    if gid_index < 0:
        gid_index = _env_int(ENV_GID_INDEX, -1)
    peer_ip = rw.gid_ipv4(server.gid)
    try:
        if peer_ip is None:
            # An IPv6 GID: no route lookup here; the device must be named.
            return rw.find_gid("", device, gid_index)
        return rw.find_gid(rw.local_ip_towards(peer_ip), device, gid_index)
    except rw.RdmaDeviceError as exc:
        raise RdmaError(f"no local RDMA device/GID to reach the service at {peer_ip}: "
                        f"{exc.message} (or set {ENV_DEVICE} / {ENV_GID_INDEX})",
                        exc.errno or 0) from None
    except OSError as exc:
        raise RdmaError(f"no route to the service's RDMA address {peer_ip}",
                        exc.errno or 0) from None
