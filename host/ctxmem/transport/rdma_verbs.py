"""RDMA channel, shim side: tuning knobs, lazy pyverbs import, and the errors.

pyverbs is imported on first use (:func:`_verbs`), never at module import, so
``import ctxmem`` never needs it. The knobs are environment variables so a deployment
can tune the channel without code changes.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ctxmem.transport.base import TransportError
from ctxmem_common import rdma_wire as rw

__all__ = ["RdmaError", "wc_status_text"]

log = logging.getLogger(__name__)

MiB = 1 << 20
# Client-side knobs (environment, so a deployment can tune them without code changes).
ENV_DEVICE = "CTXMEM_RDMA_DEVICE"  # verbs device of this host (default: by route)
ENV_GID_INDEX = "CTXMEM_RDMA_GID_INDEX"  # GID index on it (default: the RoCE v2 one)
ENV_REG_MIN_KB = "CTXMEM_RDMA_REG_MIN_KB"
ENV_REG_CACHE_MB = "CTXMEM_RDMA_REG_CACHE_MB"
ENV_BOUNCE_MB = "CTXMEM_RDMA_BOUNCE_MB"
ENV_SIGNAL_EVERY = "CTXMEM_RDMA_SIGNAL_EVERY"

INITIATOR_DEPTH = 16  # outstanding RDMA READs (max_rd_atomic), capped by both ends
SQ_DEPTH = 256
SPIN_S = 50e-6  # busy-poll this long before sleeping on the completion channel
# RC timers, as on the service (ctxmem_dpu.transport.rdma_device): ~2 s to declare a peer gone.
ACK_TIMEOUT = 16
RETRY_CNT = 7
RNR_RETRY = 7
MIN_RNR_TIMER = 12

OP_WRITE = "write"
OP_READ = "read"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        raise TransportError(f"{name}={raw!r} is not an integer") from None


def _verbs() -> Any:
    try:
        import pyverbs.addr
        import pyverbs.cq
        import pyverbs.device
        import pyverbs.libibverbs_enums
        import pyverbs.mr
        import pyverbs.pd
        import pyverbs.pyverbs_error
        import pyverbs.qp
        import pyverbs.wr
    except ImportError as exc:
        raise TransportError(
            f"transport 'rdma' needs pyverbs, which cannot be imported ({exc}); install it "
            f"with `pip install ctxmem-kv[rdma]` (deploy/ci/pyverbs-wheel.sh) or use "
            f"transport='tcp'") from None
    return pyverbs


def _errno(exc: BaseException) -> int:
    code = getattr(exc, "error_code", -1)
    return code if isinstance(code, int) and code > 0 else 0


class RdmaError(TransportError):
    """An RDMA operation failed. ``errno`` (a verbs call) or ``wc_status`` (a work
    completion) says how; the message says what to check."""

    def __init__(self, message: str, errno: int = 0, wc_status: int = 0) -> None:
        if errno:
            message = f"{message} (errno {errno}: {os.strerror(errno)}); {rw.verbs_hint(errno)}"
        super().__init__(message)
        self.errno = errno
        self.wc_status = wc_status


# Work-completion statuses worth a specific hint (values of enum ibv_wc_status).
_WC_HINTS = {
    10: "remote access error: the address/rkey is not one the service granted this session "
        "(another tenant's or session's key, an address outside the granted slots, a "
        "lease that was released or expired, an allocation already committed, a write "
        "with a lease's read-only key) — the service's NIC refused it",
    12: "transport retry count exceeded: the service's queue pair is gone (service "
        "restarted or crashed) or the path is down — check the port state, GID index, MTU",
    13: "RNR retry count exceeded: the service's queue pair is not ready",
    4: "local protection error: the local buffer's registration does not cover it",
    9: "remote invalid request: the service's QP refused the operation (access flags, "
       "length, or a READ deeper than its responder depth)",
    11: "remote operation error at the service",
    5: "work request flushed: the queue pair was already in error",
}


def wc_status_text(status: int) -> str:
    try:
        name = _verbs().libibverbs_enums.ibv_wc_status(status).name
    except Exception:
        name = f"status {status}"
    hint = _WC_HINTS.get(status, "check the device and port state")
    return f"{name}: {hint}"
