"""RDMA transport, service side: per-session protection domains, per-grant access.

The client moves the bytes itself, with one-sided RDMA WRITE (put) and READ (get) into
the slots that Allocate and Acquire name; the service's CPU never touches them. What the
service does here is *exposure and isolation*:

* one verbs device context, opened at start on the device/port/GID chosen by
  ``service.rdma_listen`` (its IP), ``service.rdma_device`` and ``service.rdma_gid_index``;
* per session that attaches over RDMA (the ``RdmaInfo``/``RdmaAttach`` calls of
  ``ctxmem.proto``, served by :class:`~ctxmem_dpu.control.servicer.ContextMemoryServicer`
  with :meth:`RdmaServer.info` and :meth:`RdmaServer.open_endpoint`): its own
  protection domain (PD) and an RC queue pair in it. Nothing registered in a session's
  PD is reachable from any other session's QP;
* per *grant* — an allocation (write access to its slots) or a lease (read access to its
  blocks) — an rkey for exactly the granted bytes: each run of adjacent granted slots
  becomes one type-2 memory window bound on the session's QP (``rdma_access: mw``) or one
  memory region registered in the session's PD (``mr``). A window is usable only through
  the QP it was bound on. When the grant ends (commit — before the service computes the
  CRC —, abort, release, expiry, session close; :attr:`BlockStore.on_grant_end`) its
  windows are deallocated or its regions deregistered, synchronously, before the store
  can free or reuse the slots. The client never gets a key that reaches a byte outside
  its own slots, nor one that lasts past the grant;
* in ``mw`` mode windows are bound over a per-session MR of the whole slab that grants
  no remote access itself (``LOCAL_WRITE | MW_BIND``); when a slab's memory leaves its
  tenant the DRAM tier's ``on_retire`` hook deregisters those MRs before the memory is
  unmapped;
* when the client's ``RdmaAttach`` call ends (close, crash, lost connection) the session's
  grants, QP, CQ, MRs and PD are destroyed, in that order.

Everything here runs on the service's event-loop thread (the gRPC handlers and the
store's hooks), like the rest of the store's state. pyverbs is imported only when an
:class:`RdmaServer` starts, so a service without RDMA never needs it.
"""

from __future__ import annotations

import asyncio
import ctypes
import hmac
import logging
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ctxmem_common import rdma_wire as rw
from ctxmem_common.config import rdma_ip
from ctxmem_common.errors import ConfigError, InvalidArgument, PermissionDenied, Unavailable

if TYPE_CHECKING:
    from ctxmem_dpu.alloc import SlotRef
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
        import pyverbs.wr
    except ImportError as exc:
        raise ConfigError(
            f"'rdma' is in service.transports but pyverbs cannot be imported ({exc}); install "
            f"it with `pip install ctxmem[rdma]` (see deploy/ci/pyverbs-wheel.sh) or drop "
            f"'rdma' from service.transports") from None
    return pyverbs


def _wc_name(status: int) -> str:
    try:
        return str(_verbs().libibverbs_enums.ibv_wc_status(status).name)
    except Exception:
        return f"work completion status {status}"


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
        caps = int(dev_attr.device_cap_flags)
        type2 = int(pv.libibverbs_enums.ibv_device_cap_flags.IBV_DEVICE_MEM_WINDOW_TYPE_2B)
        self.max_mw = int(dev_attr.max_mw)
        self.has_mw2 = bool(caps & type2) and self.max_mw > 0
        self.window_bounds_checked = int(dev_attr.vendor_id) != RXE_VENDOR_ID
        self.bind_depth = max(1, min(BIND_DEPTH, self.max_qp_wr))

    def close(self) -> None:
        self.ctx.close()


Span = tuple[int, int, int]  # (slab id, offset in the slab, length in bytes)


def coalesce(spans: Sequence[Span]) -> tuple[list[Span], list[int]]:
    """Merge granted byte spans that overlap or touch, within one slab.

    Returns the merged runs and, for each input span, the index of the run that holds it.
    Only exactly adjacent spans merge (a block shorter than its slot leaves a gap that
    stays outside every run), so a run never covers a byte that no granted slot holds.
    """
    runs: list[Span] = []
    which = [0] * len(spans)
    for i in sorted(range(len(spans)), key=lambda i: (spans[i][0], spans[i][1])):
        slab, off, length = spans[i]
        if runs and runs[-1][0] == slab and off <= runs[-1][1] + runs[-1][2]:
            r_slab, r_off, r_len = runs[-1]
            runs[-1] = (r_slab, r_off, max(r_off + r_len, off + length) - r_off)
        else:
            runs.append((slab, off, length))
        which[i] = len(runs) - 1
    return runs, which


class SessionEndpoint:
    """One RDMA session's verbs resources: PD, CQ, QP, and the keys of its live grants.

    Built by :meth:`RdmaServer.open_endpoint`; torn down by :meth:`close` in the order
    verbs requires (grants' windows/regions, QP, CQ, slab MRs, PD). The QP answers the
    client's READs and WRITEs; its send queue carries only memory-window binds.

    Raises:
        RdmaDeviceError: a verbs call failed; the message names the session, both QPs'
            ends and the device, and says what to check.
    """

    def __init__(self, dev: RdmaDevice, session_id: int, tenant: str, peer: rw.QpInfo,
                 access: str) -> None:
        pv = _verbs()
        e = pv.libibverbs_enums
        self.session_id = session_id
        self.tenant = tenant
        self.dev = dev
        self.access = access  # "mw" or "mr"
        # mw mode: slab id -> (generation, MR over the slab, base address); the MRs grant
        # no remote access themselves, only the right to bind windows over them.
        self.slab_mrs: dict[int, tuple[int, Any, int]] = {}
        # grant id -> the windows (mw) or regions (mr) that carry its rkeys
        self.grants: dict[int, list[Any]] = {}
        self.closed = False
        self.ended = asyncio.Event()  # set by close(): ends the client's RdmaAttach call
        self._bind_lock = asyncio.Lock()
        self.qp: Any = None
        self.cq: Any = None
        self.pd: Any = None
        try:
            self.pd = pv.pd.PD(dev.ctx)
            depth = dev.bind_depth
            self.cq = pv.cq.CQ(dev.ctx, depth)
            cap = pv.qp.QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1,
                              max_recv_sge=1)
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
        except pv.pyverbs_error.PyverbsError as exc:
            self.close()
            raise rw.RdmaDeviceError(
                f"creating/connecting the queue pair of RDMA session {session_id} (towards "
                f"the client's QP {peer.qpn}, GID {rw.gid_to_str(peer.gid)}) on "
                f"{dev.choice.describe()} failed: {exc}; {rw.verbs_hint(_errno(exc))}",
                _errno(exc)) from None
        except BaseException:
            self.close()
            raise

    def info(self) -> rw.QpInfo:
        return rw.QpInfo(self.qp.qp_num, self.psn, self.dev.gid, self.dev.lid, self.mtu,
                         self.dev.responder_depth)

    # -- grants ----------------------------------------------------------------------
    async def grant(self, grant_id: int, runs: Sequence[tuple[DramRegion, int, int]],
                    write: bool) -> list[int]:
        """Keys for ``runs`` ((region, offset, length) each) until :meth:`revoke`.

        ``write``: remote WRITE only (an allocation); else remote READ only (a lease).
        Returns one rkey per run. Raises :class:`Unavailable` when the device refuses (the
        session is unusable afterwards in ``mw`` mode: a failed bind breaks its QP).
        """
        if self.closed:
            raise Unavailable(f"RDMA session {self.session_id} is closed; reconnect")
        e = _verbs().libibverbs_enums.ibv_access_flags
        remote = int(e.IBV_ACCESS_REMOTE_WRITE if write else e.IBV_ACCESS_REMOTE_READ)
        if self.access == "mr":  # a region that is remotely writable must be locally so too
            local = int(e.IBV_ACCESS_LOCAL_WRITE) if write else 0
            return self._register(grant_id, runs, remote | local)
        return await self._bind(grant_id, runs, remote)

    def _register(self, grant_id: int, runs: Sequence[tuple[DramRegion, int, int]],
                  flags: int) -> list[int]:
        pv = _verbs()
        held = self.grants.setdefault(grant_id, [])
        keys = []
        for region, off, length in runs:
            try:
                mr = pv.mr.MR(self.pd, length, flags, address=buffer_address(region.mm) + off)
            except pv.pyverbs_error.PyverbsError as exc:
                self.revoke(grant_id)
                raise Unavailable(
                    f"registering {length} bytes of DRAM slab {region.slab_id} for RDMA "
                    f"session {self.session_id} failed: {exc}; "
                    f"{rw.verbs_hint(_errno(exc))}") from None
            held.append(mr)
            keys.append(int(mr.rkey))
        return keys

    async def _bind(self, grant_id: int, runs: Sequence[tuple[DramRegion, int, int]],
                    flags: int) -> list[int]:
        pv = _verbs()
        e = pv.libibverbs_enums
        async with self._bind_lock:  # one chain in flight: its completion is ours
            held = self.grants.setdefault(grant_id, [])
            keys: list[int] = []
            for start in range(0, len(runs), self.dev.bind_depth):
                chunk = runs[start : start + self.dev.bind_depth]
                follow = None
                wrs = []
                try:
                    for j in range(len(chunk) - 1, -1, -1):  # back to front, to link
                        region, off, length = chunk[j]
                        mr, base = self._slab_mr(region)
                        mw = pv.mr.MW(self.pd, e.ibv_mw_type.IBV_MW_TYPE_2)
                        held.append(mw)
                        info = pv.mr.MWBindInfo(mr, base + off, length, flags)
                        wr = pv.wr.SendWR(
                            wr_id=grant_id, opcode=e.ibv_wr_opcode.IBV_WR_BIND_MW,
                            send_flags=(e.ibv_send_flags.IBV_SEND_SIGNALED
                                        if j == len(chunk) - 1 else 0),
                            next_wr=follow)
                        wr.set_bind_wr(mw, info)
                        wrs.append(wr)
                        follow = wr
                    self.qp.post_send(follow)
                except pv.pyverbs_error.PyverbsError as exc:
                    self.revoke(grant_id)
                    raise Unavailable(
                        f"binding {len(chunk)} memory windows for RDMA session "
                        f"{self.session_id} failed: {exc}; {rw.verbs_hint(_errno(exc))} "
                        f"(windows in use by this session: {self.windows()}, device max "
                        f"{self.dev.max_mw}; or set service.rdma_access: mr)") from None
                await self._wait_bind(grant_id, len(chunk))
                if self.grants.get(grant_id) is not held:  # revoked while binding
                    for handle in held:
                        handle.close()
                    raise Unavailable(f"grant {grant_id} of RDMA session {self.session_id} "
                                      f"ended while its memory windows were being bound")
                keys.extend(int(wr.rkey) for wr in reversed(wrs))
            return keys

    async def _wait_bind(self, grant_id: int, n: int) -> None:
        pv = _verbs()
        ok = pv.libibverbs_enums.ibv_wc_status.IBV_WC_SUCCESS
        deadline = time.monotonic() + BIND_TIMEOUT_S
        spin_until = time.monotonic() + BIND_SPIN_S
        while True:
            if self.cq is None:
                raise Unavailable(f"RDMA session {self.session_id} ended while binding "
                                  f"memory windows; reconnect")
            got, wcs = self.cq.poll(1)
            if got:
                wc = wcs[0]
                if wc.status != ok:
                    self.close()
                    raise Unavailable(
                        f"binding {n} memory windows for RDMA session {self.session_id} "
                        f"failed: {_wc_name(int(wc.status))}; the session's QP is in the "
                        f"error state and the session is closed; reconnect")
                return
            now = time.monotonic()
            if now >= deadline:
                self.close()
                raise Unavailable(
                    f"binding {n} memory windows for RDMA session {self.session_id}: no "
                    f"completion within {BIND_TIMEOUT_S:g} s; check the device "
                    f"(`rdma link show`, dmesg)")
            if now >= spin_until:
                await asyncio.sleep(0.0005)

    def revoke(self, grant_id: int) -> None:
        """End a grant's keys now: deallocated windows and deregistered regions refuse
        every later access (the NIC answers with a remote access error)."""
        for handle in self.grants.pop(grant_id, ()):
            handle.close()

    def windows(self) -> int:
        return sum(len(h) for h in self.grants.values())

    def _slab_mr(self, region: DramRegion) -> tuple[Any, int]:
        """(MR, base address) of this session's bind-only MR over ``region``."""
        cached = self.slab_mrs.get(region.slab_id)
        if cached is not None and cached[0] == region.generation:
            return cached[1], cached[2]
        if cached is not None:  # a recycled slab whose release we did not see: never reuse
            self.drop_slab(region.slab_id)
        pv = _verbs()
        e = pv.libibverbs_enums.ibv_access_flags
        base = buffer_address(region.mm)
        mr = pv.mr.MR(self.pd, region.size, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_MW_BIND,
                      address=base)
        self.slab_mrs[region.slab_id] = (region.generation, mr, base)
        return mr, base

    def drop_slab(self, slab_id: int) -> None:
        entry = self.slab_mrs.pop(slab_id, None)
        if entry is not None:
            entry[1].close()

    def close(self) -> None:
        """Grants, QP, CQ, slab MRs, PD — children before parents; safe to call twice."""
        self.closed = True
        self.ended.set()
        for grant_id in list(self.grants):
            try:
                self.revoke(grant_id)
            except Exception:
                log.exception("RDMA session %d: revoking grant %d failed", self.session_id,
                              grant_id)
        for name in ("qp", "cq"):
            obj = getattr(self, name)
            if obj is not None:
                try:
                    obj.close()
                except Exception:
                    log.exception("RDMA session %d: closing its %s failed", self.session_id,
                                  name.upper())
                setattr(self, name, None)
        for slab_id in list(self.slab_mrs):
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
    """Serves the RDMA exchange (``RdmaInfo``/``RdmaAttach``, through the servicer) and
    grants per-slot, per-lease keys."""

    def __init__(self, store: BlockStore, listen: str, device: str = "", gid_index: int = -1,
                 access: str = "auto") -> None:
        self.store = store
        self.ip = rdma_ip(listen)
        self.device_name = device
        self.gid_index = gid_index
        if access not in ("auto", "mw", "mr"):
            raise ConfigError(f"service.rdma_access: {access!r} is not one of auto, mw, mr")
        self.access_wanted = access
        self.access = ""  # resolved at start
        self.dev: RdmaDevice | None = None
        self.endpoints: dict[int, SessionEndpoint] = {}
        self._grant_owner: dict[int, SessionEndpoint] = {}
        self._closing = asyncio.Event()

    async def start(self) -> None:
        choice = rw.find_gid(self.ip, self.device_name, self.gid_index)
        dev = RdmaDevice(choice)
        if self.access_wanted == "mw" and not dev.has_mw2:
            dev.close()
            raise ConfigError(
                f"service.rdma_access: mw, but {choice.device} has no type-2 memory windows "
                f"(max_mw {dev.max_mw}); set rdma_access: mr (or auto)")
        self.access = self.access_wanted if self.access_wanted != "auto" else (
            "mw" if dev.has_mw2 and dev.window_bounds_checked else "mr")
        if self.access == "mw" and not dev.window_bounds_checked:
            log.warning("service.rdma_access: mw on %s (Soft-RoCE): this driver does not "
                        "check a memory window's bounds, so a key reaches its whole slab "
                        "(still only this session's, still revoked with the grant); use mr "
                        "or auto for per-slot bounds", choice.device)
        self.dev = dev
        self.store.dram.on_retire.append(self._slab_retired)
        self.store.on_grant_end.append(self.revoke)
        log.info("RDMA transport on %s, MTU enum %d, responder depth %d, access %s "
                 "(memory windows: %s, max %d)", choice.describe(), dev.mtu,
                 dev.responder_depth, self.access, "type 2" if dev.has_mw2 else "no",
                 dev.max_mw)

    # -- exchange (the servicer's RdmaInfo and RdmaAttach) ----------------------------
    def _session(self, call: str, session_id: int, token: bytes) -> Session:
        """The RDMA session ``session_id`` if ``token`` is its token, else the error
        ``call`` (``"RdmaInfo"``, ``"RdmaAttach"``) answers with."""
        if self._closing.is_set() or self.dev is None:
            raise Unavailable(
                f"{call} for session {session_id}: the service's RDMA transport is shutting "
                f"down; reconnect (a new Connect) once the service is back")
        s = self.store.session(session_id)  # UnknownSession, as for every other call
        if not hmac.compare_digest(s.token, token):
            raise PermissionDenied(
                f"{call} for session {session_id}: wrong session token; send the "
                f"session_token that Connect returned for this session")
        if s.transport != "rdma":
            raise InvalidArgument(
                f"{call} for session {session_id}: the session was opened with transport "
                f"{s.transport!r}, not 'rdma'; Connect with transport TRANSPORT_RDMA to use "
                f"RdmaInfo/RdmaAttach")
        return s

    def info(self, session_id: int, token: bytes) -> RdmaDevice:
        """The device a client of RDMA session ``session_id`` connects to (its GID, LID,
        MTU and responder depth). Raises the :class:`CtxmemError` to answer with."""
        self._session("RdmaInfo", session_id, token)
        assert self.dev is not None
        return self.dev

    def open_endpoint(self, session_id: int, token: bytes, peer: rw.QpInfo) -> SessionEndpoint:
        """Authenticate an attach, build the session's endpoint and connect its QP to
        ``peer`` (the client's QP). The caller answers with :meth:`SessionEndpoint.info`
        and must :meth:`drop_endpoint` when the ``RdmaAttach`` call ends.

        Raises:
            Unavailable: no device (shutting down), or a verbs call failed
                (:class:`~ctxmem_common.rdma_wire.RdmaDeviceError`).
            UnknownSession, PermissionDenied: unknown session, wrong token.
            InvalidArgument: not an RDMA session, already attached, or a malformed ``peer``.
        """
        s = self._session("RdmaAttach", session_id, token)
        if s.id in self.endpoints:
            raise InvalidArgument(
                f"RdmaAttach for session {s.id}: the session already has an RDMA connection "
                f"(an earlier RdmaAttach call of it is still open); end that call first, or "
                f"Connect a new session")
        peer.check(f"RdmaAttach for session {s.id}: RdmaAttachRequest.qp")
        assert self.dev is not None
        try:
            ep = SessionEndpoint(self.dev, s.id, s.tenant, peer, self.access)
        except rw.RdmaDeviceError as exc:
            log.warning("%s", exc.message)
            raise
        self.endpoints[s.id] = ep
        log.info("RDMA session %d (tenant %r) attached: QP %d <- peer QP %d", s.id, s.tenant,
                 ep.qp.qp_num, peer.qpn)
        return ep

    def drop_endpoint(self, ep: SessionEndpoint) -> None:
        if self.endpoints.get(ep.session_id) is ep:
            del self.endpoints[ep.session_id]
            log.info("RDMA session %d detached", ep.session_id)
        ep.close()

    # -- keys ------------------------------------------------------------------------
    async def grant(self, s: Session, grant_id: int, refs: Sequence[SlotRef],
                    lengths: Sequence[int], write: bool) -> list[tuple[int, int]]:
        """(remote address, rkey) for each slot of an allocation (``write``) or a lease.

        The keys reach exactly ``lengths[i]`` bytes of each slot, for WRITE only or READ
        only, on ``s``'s connection only, until :meth:`revoke` (the store's grant-end
        hook). Only the servicer calls this, for ``s``'s own allocations and leases.
        """
        ep = self.endpoints.get(s.id)
        if ep is None or ep.closed:
            raise Unavailable(
                f"session {s.id} has no RDMA connection (its RdmaAttach call ended or never "
                f"happened); reconnect")
        dram = self.store.dram
        spans = []
        for ref, length in zip(refs, lengths, strict=True):
            assert dram.region_tenant(ref.slab) == s.tenant, (
                f"DRAM slab {ref.slab} belongs to tenant {dram.region_tenant(ref.slab)!r}, "
                f"not {s.tenant!r}: the allocator handed a slot across tenants")
            spans.append((ref.slab, dram.offset(ref), length))
        runs, which = coalesce(spans)
        self._grant_owner[grant_id] = ep
        try:
            keys = await ep.grant(grant_id, [(dram.regions[slab], off, n)
                                             for slab, off, n in runs], write)
        except BaseException:
            self.revoke(grant_id)
            raise
        if grant_id not in self._grant_owner:  # ended while the binds were in flight
            ep.revoke(grant_id)
            raise Unavailable(f"grant {grant_id} of session {s.id} ended before its keys "
                              f"were ready (expired or the session closed); retry")
        base = {slab: buffer_address(dram.regions[slab].mm) for slab, _o, _n in runs}
        return [(base[slab] + off, keys[which[i]])
                for i, (slab, off, _n) in enumerate(spans)]

    def revoke(self, grant_id: int) -> None:
        """The store's grant-end hook: the grant's keys stop working now."""
        ep = self._grant_owner.pop(grant_id, None)
        if ep is not None:
            ep.revoke(grant_id)

    def _slab_retired(self, slab_id: int, generation: int) -> None:
        for ep in self.endpoints.values():
            ep.drop_slab(slab_id)

    async def close(self) -> None:
        """End every RdmaAttach call and free every session's resources, then the context."""
        self._closing.set()
        for ep in list(self.endpoints.values()):
            self.drop_endpoint(ep)
        hooks = self.store.dram.on_retire
        if self._slab_retired in hooks:
            hooks.remove(self._slab_retired)
        if self.revoke in self.store.on_grant_end:
            self.store.on_grant_end.remove(self.revoke)
        self._grant_owner.clear()
        if self.dev is not None:
            self.dev.close()
            self.dev = None
