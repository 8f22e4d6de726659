"""RDMA transport, service side: per-session protection domains over the DRAM slabs.

The client moves the bytes itself, with one-sided RDMA WRITE (put) and READ (get) into
the slots that Allocate and Acquire name; the service's CPU never touches them. What the
service does here is *exposure and isolation*:

* one verbs device context, opened at start on the device/port/GID chosen by
  ``service.rdma_listen`` (its IP), ``service.rdma_device`` and ``service.rdma_gid_index``;
* per session that attaches over RDMA (see :mod:`ctxmem_common.rdma_wire`): its own
  protection domain (PD), a responder-only RC queue pair in that PD, and — lazily, the
  first time a slot of a slab is handed to that session — a memory region (MR) over the
  slab, registered in that PD only. A slab belongs to one tenant at a time (the DRAM
  allocator's class includes the tenant), so a session's PD only ever holds MRs over its
  own tenant's memory, and its rkeys are worthless on any other session's QP: the NIC
  answers a foreign rkey, or an address outside the session's MRs, with a remote access
  error and never with bytes;
* when a slab's memory leaves its tenant (an emptied slab is kept for the same tenant,
  and retired only when another tenant needs it), the DRAM tier's ``on_retire`` hook
  deregisters every session's MR over it *before* the memory is unmapped, so no rkey
  outlives the slab's tenancy;
* when the client's ``Attach`` call ends (close, crash, lost connection) the session's
  QP, CQ, MRs and PD are destroyed, in that order.

Everything here runs on the service's event-loop thread (the gRPC handlers and
``ContextMemoryServicer._slot``), like the rest of the store's state: no locks.
pyverbs is imported only when an :class:`RdmaServer` starts, so a service without RDMA
never needs it.
"""

from __future__ import annotations

import asyncio
import ctypes
import hmac
import ipaddress
import logging
import secrets
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ctxmem_common import rdma_wire as rw
from ctxmem_common.errors import ConfigError, Unavailable

if TYPE_CHECKING:
    import grpc

    from ctxmem_dpu.blocks import Session
    from ctxmem_dpu.store import BlockStore
    from ctxmem_dpu.tiers.dram import DramRegion

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


def _verbs() -> Any:
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
    except ImportError as exc:
        raise ConfigError(
            f"'rdma' is in service.transports but pyverbs cannot be imported ({exc}); install "
            f"it with `pip install ctxmem[rdma]` (see deploy/ci/pyverbs-wheel.sh) or drop "
            f"'rdma' from service.transports") from None
    return pyverbs


def _errno(exc: BaseException) -> int:
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
        pv = _verbs()
        self.choice = choice
        self.port = choice.port
        self.gid_index = choice.gid_index
        self.gid = choice.gid
        try:
            self.ctx = pv.device.Context(name=choice.device)
        except pv.pyverbs_error.PyverbsError as exc:
            raise rw.RdmaDeviceError(
                f"cannot open RDMA device {choice.device!r}: {exc}; "
                f"{rw.verbs_hint(_errno(exc))}", _errno(exc)) from None
        try:
            port_attr = self.ctx.query_port(self.port)
            dev_attr = self.ctx.query_device()
            gid = rw.gid_from_str(self.ctx.query_gid(self.port, self.gid_index).gid)
        except pv.pyverbs_error.PyverbsError as exc:
            self.ctx.close()
            raise rw.RdmaDeviceError(
                f"cannot query {choice.describe()}: {exc}; {rw.verbs_hint(_errno(exc))}",
                _errno(exc)) from None
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

    def close(self) -> None:
        self.ctx.close()


class SessionEndpoint:
    """One RDMA session's verbs resources: PD, CQ, responder QP and the MRs of its slabs.

    Built by :meth:`RdmaServer._attach`; torn down by :meth:`close` in the order verbs
    requires (QP, CQ, MRs, PD). The QP only answers: its CQ never gets a completion.
    """

    def __init__(self, dev: RdmaDevice, session_id: int, tenant: str, peer: rw.QpInfo) -> None:
        pv = _verbs()
        e = pv.libibverbs_enums
        self.session_id = session_id
        self.tenant = tenant
        self.dev = dev
        self.access = (e.ibv_access_flags.IBV_ACCESS_LOCAL_WRITE
                       | e.ibv_access_flags.IBV_ACCESS_REMOTE_WRITE
                       | e.ibv_access_flags.IBV_ACCESS_REMOTE_READ)
        # slab id -> (generation, MR, base address)
        self.mrs: dict[int, tuple[int, Any, int]] = {}
        self.qp: Any = None
        self.cq: Any = None
        self.pd: Any = pv.pd.PD(dev.ctx)
        try:
            self.cq = pv.cq.CQ(dev.ctx, 1)
            cap = pv.qp.QPCap(max_send_wr=1, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
            init = pv.qp.QPInitAttr(qp_type=e.ibv_qp_type.IBV_QPT_RC, scq=self.cq, rcq=self.cq,
                                    cap=cap, sq_sig_all=0)
            attr = pv.qp.QPAttr(port_num=dev.port)
            attr.qp_access_flags = (e.ibv_access_flags.IBV_ACCESS_REMOTE_WRITE
                                    | e.ibv_access_flags.IBV_ACCESS_REMOTE_READ)
            self.qp = pv.qp.QP(self.pd, init, attr)  # RESET -> INIT
            self.psn = secrets.randbits(24)
            self.mtu = min(dev.mtu, peer.mtu) if peer.mtu else dev.mtu
            attr = pv.qp.QPAttr(port_num=dev.port)
            attr.qp_access_flags = (e.ibv_access_flags.IBV_ACCESS_REMOTE_WRITE
                                    | e.ibv_access_flags.IBV_ACCESS_REMOTE_READ)
            attr.path_mtu = self.mtu
            attr.dest_qp_num = peer.qpn
            attr.rq_psn = self.psn
            attr.sq_psn = peer.psn
            attr.max_dest_rd_atomic = dev.responder_depth
            attr.max_rd_atomic = 1
            attr.min_rnr_timer = MIN_RNR_TIMER
            attr.timeout = ACK_TIMEOUT
            attr.retry_cnt = RETRY_CNT
            attr.rnr_retry = RNR_RETRY
            gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(rw.gid_to_str(peer.gid)),
                                     sgid_index=dev.gid_index, hop_limit=64)
            attr.ah_attr = pv.addr.AHAttr(port_num=dev.port, is_global=1, gr=gr, dlid=peer.lid)
            self.qp.to_rts(attr)
        except BaseException:
            self.close()
            raise

    def info(self) -> rw.QpInfo:
        return rw.QpInfo(self.qp.qp_num, self.psn, self.dev.gid, self.dev.lid, self.mtu,
                         self.dev.responder_depth)

    def key(self, region: DramRegion) -> tuple[int, int]:
        """(base address, rkey) of this session's MR over ``region``; registered once."""
        cached = self.mrs.get(region.slab_id)
        if cached is not None and cached[0] == region.generation:
            return cached[2], cached[1].rkey
        if cached is not None:  # a recycled slab whose release we did not see: never reuse
            self.drop_slab(region.slab_id)
        pv = _verbs()
        base = buffer_address(region.mm)
        try:
            mr = pv.mr.MR(self.pd, region.size, self.access, address=base)
        except pv.pyverbs_error.PyverbsError as exc:
            raise Unavailable(
                f"registering DRAM slab {region.slab_id} ({region.size} bytes) for RDMA "
                f"session {self.session_id} failed: {exc}; {rw.verbs_hint(_errno(exc))}"
            ) from None
        self.mrs[region.slab_id] = (region.generation, mr, base)
        return base, mr.rkey

    def drop_slab(self, slab_id: int) -> None:
        entry = self.mrs.pop(slab_id, None)
        if entry is not None:
            entry[1].close()

    def close(self) -> None:
        """QP, CQ, MRs, PD — children before parents; safe to call twice."""
        for name in ("qp", "cq"):
            obj = getattr(self, name)
            if obj is not None:
                try:
                    obj.close()
                except Exception:
                    log.exception("RDMA session %d: closing its %s failed", self.session_id,
                                  name.upper())
                setattr(self, name, None)
        for slab_id in list(self.mrs):
            try:
                self.drop_slab(slab_id)
            except Exception:
                log.exception("RDMA session %d: deregistering slab %d failed",
                              self.session_id, slab_id)
        if self.pd is not None:
            try:
                self.pd.close()
            except Exception:
                log.exception("RDMA session %d: closing its PD failed", self.session_id)
            self.pd = None


class RdmaServer:
    """Serves the RDMA exchange (``Info``/``Attach``) and hands out per-session rkeys."""

    def __init__(self, store: BlockStore, listen: str, device: str = "", gid_index: int = -1
                 ) -> None:
        self.store = store
        host, sep, port = listen.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(f"service.rdma_listen: expected IP:PORT, got {listen!r}")
        self.ip = host.strip("[]") or "0.0.0.0"
        try:
            ipaddress.ip_address(self.ip)
        except ValueError:
            raise ConfigError(f"service.rdma_listen: {self.ip!r} is not an IP address (the "
                              f"RDMA device is found by its IP; names are not resolved)") from None
        self.device_name = device
        self.gid_index = gid_index
        self.dev: RdmaDevice | None = None
        self.endpoints: dict[int, SessionEndpoint] = {}
        self._closing = asyncio.Event()

    async def start(self) -> None:
        choice = rw.find_gid(self.ip, self.device_name, self.gid_index)
        self.dev = RdmaDevice(choice)
        self.store.dram.on_retire.append(self._slab_retired)
        log.info("RDMA transport on %s, MTU enum %d, responder depth %d", choice.describe(),
                 self.dev.mtu, self.dev.responder_depth)

    def rpc_handler(self) -> grpc.GenericRpcHandler:
        import grpc

        return grpc.method_handlers_generic_handler(rw.RDMA_SERVICE, {
            "Info": grpc.unary_unary_rpc_method_handler(self._info),
            "Attach": grpc.unary_stream_rpc_method_handler(self._attach),
        })

    # -- exchange --------------------------------------------------------------------
    def _auth(self, session_id: int, token: bytes) -> tuple[rw.RdmaStatus, Session | None]:
        if self._closing.is_set() or self.dev is None:
            return rw.RdmaStatus.SHUTTING_DOWN, None
        s = self.store.sessions.get(session_id)
        if s is None or not hmac.compare_digest(s.token, token):
            return rw.RdmaStatus.UNAUTHENTICATED, None
        if s.transport != "rdma":
            return rw.RdmaStatus.WRONG_TRANSPORT, None
        return rw.RdmaStatus.OK, s

    async def _info(self, request: bytes, context: Any) -> bytes:
        try:
            req = rw.InfoRequest.unpack(request)
        except rw.VersionMismatch as exc:
            return rw.InfoResponse(rw.RdmaStatus.VERSION_MISMATCH, message=str(exc)).pack()
        except ValueError as exc:
            return rw.InfoResponse(rw.RdmaStatus.BAD_REQUEST, message=str(exc)).pack()
        status, _s = self._auth(req.session_id, req.token)
        if status != rw.RdmaStatus.OK or self.dev is None:
            return rw.InfoResponse(status).pack()
        d = self.dev
        return rw.InfoResponse(rw.RdmaStatus.OK, d.gid, d.lid, d.mtu, d.responder_depth).pack()

    def open_endpoint(self, request: bytes) -> tuple[bytes, SessionEndpoint | None]:
        """Check an ATTACH request and build the session's endpoint: (reply, endpoint)."""
        try:
            req = rw.AttachRequest.unpack(request)
        except rw.VersionMismatch as exc:
            return rw.AttachResponse(rw.RdmaStatus.VERSION_MISMATCH, message=str(exc)).pack(), None
        except ValueError as exc:
            return rw.AttachResponse(rw.RdmaStatus.BAD_REQUEST, message=str(exc)).pack(), None
        status, s = self._auth(req.session_id, req.token)
        if status != rw.RdmaStatus.OK or s is None or self.dev is None:
            return rw.AttachResponse(status).pack(), None
        if s.id in self.endpoints:
            return rw.AttachResponse(rw.RdmaStatus.ALREADY_ATTACHED).pack(), None
        pv = _verbs()
        try:
            ep = SessionEndpoint(self.dev, s.id, s.tenant, req.qp)
        except pv.pyverbs_error.PyverbsError as exc:
            msg = (f"creating/connecting the queue pair for session {s.id} on "
                   f"{self.dev.choice.describe()} failed: {exc}; {rw.verbs_hint(_errno(exc))}")
            log.warning("%s", msg)
            return rw.AttachResponse(rw.RdmaStatus.DEVICE_ERROR, message=msg).pack(), None
        self.endpoints[s.id] = ep
        log.info("RDMA session %d (tenant %r) attached: QP %d <- peer QP %d", s.id, s.tenant,
                 ep.qp.qp_num, req.qp.qpn)
        return rw.AttachResponse(rw.RdmaStatus.OK, ep.info()).pack(), ep

    async def _attach(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        reply, ep = self.open_endpoint(request)
        if ep is not None:
            # A stream the client abandons without a clean cancel still ends its context.
            context.add_done_callback(lambda _ctx: self.drop_endpoint(ep))
        yield reply
        if ep is None:
            return
        try:
            await self._closing.wait()
        finally:
            self.drop_endpoint(ep)

    def drop_endpoint(self, ep: SessionEndpoint) -> None:
        if self.endpoints.get(ep.session_id) is ep:
            del self.endpoints[ep.session_id]
            log.info("RDMA session %d detached", ep.session_id)
        ep.close()

    # -- keys ------------------------------------------------------------------------
    def remote_key(self, s: Session, slab_id: int, offset: int) -> tuple[int, int]:
        """(remote address, rkey) of ``offset`` in slab ``slab_id`` for session ``s``.

        Only the servicer calls this, and only for slots of ``s``'s own allocations and
        leases, so a session never learns an address or key outside its tenant's slabs.
        """
        ep = self.endpoints.get(s.id)
        if ep is None:
            raise Unavailable(
                f"session {s.id} has no RDMA connection (its Attach call ended or never "
                f"happened); reconnect")
        dram = self.store.dram
        assert dram.region_tenant(slab_id) == s.tenant, (
            f"DRAM slab {slab_id} belongs to tenant {dram.region_tenant(slab_id)!r}, not "
            f"{s.tenant!r}: the allocator handed a slot across tenants")
        base, rkey = ep.key(dram.regions[slab_id])
        return base + offset, rkey

    def _slab_retired(self, slab_id: int, generation: int) -> None:
        for ep in self.endpoints.values():
            ep.drop_slab(slab_id)

    async def close(self) -> None:
        """End every Attach call and free every session's resources, then the context."""
        self._closing.set()
        for ep in list(self.endpoints.values()):
            self.drop_endpoint(ep)
        hooks = self.store.dram.on_retire
        if self._slab_retired in hooks:
            hooks.remove(self._slab_retired)
        if self.dev is not None:
            self.dev.close()
            self.dev = None
