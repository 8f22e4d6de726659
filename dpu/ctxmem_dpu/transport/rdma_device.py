"""RDMA transport, service side: the verbs device context and the verbs helpers.

pyverbs is imported on first use (:func:`load_verbs`), never at module import, so a service
without RDMA never needs it. The tuning constants below set the RC queue pairs' depth
and timers and the memory-window bind pipeline of every session
(:mod:`ctxmem_dpu.transport.rdma_endpoint`).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

from ctxmem_common import rdma_wire as rw
from ctxmem_common.errors import ConfigError

__all__ = [
    "ACK_TIMEOUT", "BIND_DEPTH", "BIND_SPIN_S", "BIND_TIMEOUT_S", "MIN_RNR_TIMER",
    "RESPONDER_DEPTH", "RETRY_CNT", "RNR_RETRY", "RXE_VENDOR_ID", "RdmaDevice",
    "buffer_address", "load_verbs", "verbs_errno", "wc_status_name",
]

log = logging.getLogger(__name__)


# Outstanding RDMA READs the service's QP answers at once (max_dest_rd_atomic), capped by
# the device. 16 keeps a 2 MiB-block READ pipeline full on 100-200 Gb/s NICs.
RESPONDER_DEPTH = 16
# RC transport timers (IB spec encoding): local ACK timeout 4.096 us * 2^16 = 268 ms, 7
# retries: a vanished peer is detected in about 2 s, never a hang.
ACK_TIMEOUT = 16
RETRY_CNT = 7
RNR_RETRY = 7
MIN_RNR_TIMER = 12
# Soft-RoCE's vendor id. rxe (at least through Linux 6.1) checks a memory window's rkey,
# QP, state and access flags on every request, but checks the address range against the
# *underlying MR*, not the window's bounds: a window over one slot reaches the whole slab
# behind it (tests/vm/test_rdma_transport.py::test_a_key_reaches_only_its_own_slot, an
# expected failure there). Hardware NICs check the window's bounds, as the IB spec asks.
RXE_VENDOR_ID = 0xFFFFFF
# Memory-window binds posted at once on a session's send queue; the last is signalled.
BIND_DEPTH = 64
# A bind completes in microseconds (a local operation of the NIC); waiting longer than
# this means the device is stuck, and the session is dropped.
BIND_TIMEOUT_S = 2.0
# Busy-poll this long for a bind's completion before yielding the event loop between polls.
BIND_SPIN_S = 0.0002


def load_verbs() -> Any:
    """The pyverbs modules, imported on first use (ImportError says how to install)."""
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
        raise ConfigError(
            f"'rdma' is in service.transports but pyverbs cannot be imported ({exc}); install "
            f"it with `pip install ctxmem-kv[rdma]` (see deploy/ci/pyverbs-wheel.sh) or drop "
            f"'rdma' from service.transports") from None
    return pyverbs


def wc_status_name(status: int) -> str:
    try:
        return str(load_verbs().libibverbs_enums.ibv_wc_status(status).name)
    except Exception:
        return f"work completion status {status}"


def verbs_errno(exc: BaseException) -> int:
    code = getattr(exc, "error_code", -1)
    return code if isinstance(code, int) and code > 0 else 0


def buffer_address(buf: Any) -> int:
    """Virtual address of a writable buffer (an mmap): where an MR over it starts."""
    c = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(c)
    finally:
        del c  # drop the buffer export at once, so the mmap can still be closed


class RdmaDevice:
    """The service's verbs context on the chosen device and port."""

    def __init__(self, choice: rw.GidChoice) -> None:
        pv = load_verbs()
        self.choice = choice
        self.port = choice.port
        self.gid_index = choice.gid_index
        self.gid = choice.gid
        try:
            self.ctx = pv.device.Context(name=choice.device)
        except pv.pyverbs_error.PyverbsError as exc:
            raise rw.RdmaDeviceError(
                f"cannot open RDMA device {choice.device!r}: {exc}; "
                f"{rw.verbs_hint(verbs_errno(exc))}", verbs_errno(exc)) from None
        try:
            port_attr = self.ctx.query_port(self.port)
            dev_attr = self.ctx.query_device()
            gid = rw.gid_from_str(self.ctx.query_gid(self.port, self.gid_index).gid)
        except pv.pyverbs_error.PyverbsError as exc:
            self.ctx.close()
            raise rw.RdmaDeviceError(
                f"cannot query {choice.describe()}: {exc}; {rw.verbs_hint(verbs_errno(exc))}",
                verbs_errno(exc)) from None
        if gid != self.gid:
            self.ctx.close()
            raise rw.RdmaDeviceError(
                f"{choice.device} port {self.port} GID[{self.gid_index}] is "
                f"{rw.gid_to_str(gid)} through verbs but {rw.gid_to_str(self.gid)} in sysfs: "
                f"the GID table changed; restart the service")
        self.lid = int(port_attr.lid)
        self.mtu = int(port_attr.active_mtu)
        self.max_qp_wr = int(dev_attr.max_qp_wr)
        self.responder_depth = max(1, min(RESPONDER_DEPTH, int(dev_attr.max_qp_rd_atom)))
        caps = int(dev_attr.device_cap_flags)
        type2 = int(pv.libibverbs_enums.ibv_device_cap_flags.IBV_DEVICE_MEM_WINDOW_TYPE_2B)
        self.max_mw = int(dev_attr.max_mw)
        self.has_mw2 = bool(caps & type2) and self.max_mw > 0
        self.window_bounds_checked = int(dev_attr.vendor_id) != RXE_VENDOR_ID
        self.bind_depth = max(1, min(BIND_DEPTH, self.max_qp_wr))

    def close(self) -> None:
        self.ctx.close()
