"""RDMA channel, shim side: the control-plane exchange that connects a queue pair.

``RdmaInfo`` tells the shim the service's device (GID, LID, MTU, READ depth); the shim
picks its own device and GID towards it; ``RdmaAttach`` then swaps the two QPs' numbers
and stays open for the life of the connection; the shim's QP is then moved to RTS
towards the service's. A refused or timed-out call becomes a
:class:`~ctxmem.transport.base.TransportError` that says why. pyverbs comes in as an
argument (the channel imports it lazily), never imported here.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ctxmem.transport.base import TransportError
from ctxmem.transport.rdma_verbs import (
    ACK_TIMEOUT,
    ENV_DEVICE,
    ENV_GID_INDEX,
    MIN_RNR_TIMER,
    RETRY_CNT,
    RNR_RETRY,
    RdmaError,
    _env_int,
    _errno,
)
from ctxmem_common import rdma_wire as rw
from ctxmem_common.errors import ERROR_METADATA_KEY, InvalidArgument
from ctxmem_common.identity import SESSION_TOKEN_METADATA_KEY
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.proto import ctxmem_pb2_grpc as pb_grpc

__all__ = ["choose_device", "connect_qp", "rdma_attach", "rdma_info", "refusal"]


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


def rdma_attach(stub: pb_grpc.ContextMemoryStub, session_id: bytes, token: bytes,
                timeout_s: float, mine: rw.QpInfo) -> tuple[Any, rw.QpInfo]:
    """Open the ``RdmaAttach`` call with this side's QP ``mine``; returns the call (it
    lives as long as the connection: no deadline; cancelling it ends the connection) and
    the service's QP from its first answer. Only that first answer's wait is bounded, by
    cancelling the call if it has not come within ``timeout_s``.

    Raises:
        TransportError: the call was refused, timed out or ended without an answer, or the
            answer is malformed; the call is cancelled then.
    """
    import grpc

    call = stub.RdmaAttach(pb.RdmaAttachRequest(
        session_id=session_id, session_token=token, qp=mine.to_pb()),
        metadata=((SESSION_TOKEN_METADATA_KEY, token),))
    timer = threading.Timer(timeout_s, call.cancel)
    timer.daemon = True
    timer.start()
    try:
        try:
            resp: pb.RdmaAttachResponse = next(call)
        except grpc.RpcError as exc:
            raise refusal("RdmaAttach", session_id, timeout_s, exc) from None
        except StopIteration:
            raise TransportError(f"RdmaAttach for session {session_id.hex()}: the service "
                                 f"ended the call without an answer") from None
        finally:
            timer.cancel()
        try:
            peer = rw.QpInfo.from_pb(resp.qp).check("RdmaAttachResponse.qp")
        except InvalidArgument as exc:
            raise TransportError(f"RdmaAttach for session {session_id.hex()}: the service's "
                                 f"answer is malformed: {exc.message}") from None
    except BaseException:
        call.cancel()
        raise
    return call, peer


def connect_qp(pv: Any, qp: Any, choice: rw.GidChoice, peer: rw.QpInfo, *, psn: int,
               mtu: int, depth: int) -> None:
    """Move ``qp`` (in INIT, on ``choice``) to RTS towards the service's QP ``peer``:
    ``psn``/``mtu``/``depth`` are this side's (the path MTU and READ depth are the smaller
    of both ends'), RC timers as on the service; no remote access to anything of ours.

    Raises:
        RdmaError: the transition failed (e.g. an unreachable GID, a bad GID index).
    """
    attr = pv.qp.QPAttr(port_num=choice.port)
    attr.qp_access_flags = 0
    attr.path_mtu = min(mtu, peer.mtu) if peer.mtu else mtu
    attr.dest_qp_num = peer.qpn
    attr.rq_psn = psn
    attr.sq_psn = peer.psn
    attr.max_dest_rd_atomic = 1
    attr.max_rd_atomic = min(depth, peer.rd_atomic or 1)
    attr.min_rnr_timer = MIN_RNR_TIMER
    attr.timeout = ACK_TIMEOUT
    attr.retry_cnt = RETRY_CNT
    attr.rnr_retry = RNR_RETRY
    try:
        gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(rw.gid_to_str(peer.gid)),
                                 sgid_index=choice.gid_index, hop_limit=64)
        attr.ah_attr = pv.addr.AHAttr(port_num=choice.port, is_global=1, gr=gr, dlid=peer.lid)
        qp.to_rts(attr)
    except pv.pyverbs_error.PyverbsError as exc:
        raise RdmaError(f"connecting QP {qp.qp_num} to the service's QP {peer.qpn} "
                        f"(GID {rw.gid_to_str(peer.gid)}, local {choice.describe()}) failed: "
                        f"{exc}", _errno(exc) or 22) from None
