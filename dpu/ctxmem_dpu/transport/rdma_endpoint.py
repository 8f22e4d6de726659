"""RDMA transport, service side: one session's verbs resources and its grants' keys.

A :class:`SessionEndpoint` is one RDMA session's protection domain, completion queue and
RC queue pair, and the memory windows (``mw``) or regions (``mr``) that carry the rkeys
of its live grants, torn down in the order verbs requires. :func:`coalesce` merges a
grant's slots into the runs that get one key each. See :mod:`ctxmem_dpu.transport.rdma`
for the isolation model.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ctxmem_common import rdma_wire as rw
from ctxmem_common.errors import Unavailable
from ctxmem_dpu.transport.rdma_device import (
    ACK_TIMEOUT,
    BIND_SPIN_S,
    BIND_TIMEOUT_S,
    MIN_RNR_TIMER,
    RETRY_CNT,
    RNR_RETRY,
    RdmaDevice,
    buffer_address,
    load_verbs,
    verbs_errno,
    wc_status_name,
)

if TYPE_CHECKING:
    from ctxmem_dpu.tiers.dram import DramRegion

__all__ = ["SessionEndpoint", "Span", "coalesce"]

log = logging.getLogger(__name__)


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

    def __init__(self, dev: RdmaDevice, session_id: bytes, tenant: str, peer: rw.QpInfo,
                 access: str) -> None:
        pv = load_verbs()
        e = pv.libibverbs_enums
        self.session_id = session_id
        self.tenant = tenant
        self.dev = dev
        self.access = access  # "mw" or "mr"
        # mw mode: slab id -> (generation, MR over the slab, base address); the MRs grant
        # no remote access themselves, only the right to bind windows over them.
        self.slab_mrs: dict[int, tuple[int, Any, int]] = {}
        # grant id -> the windows (mw) or regions (mr) that carry its rkeys
        self.grants: dict[bytes, list[Any]] = {}
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
                f"creating/connecting the queue pair of RDMA session {session_id.hex()} (towards "
                f"the client's QP {peer.qpn}, GID {rw.gid_to_str(peer.gid)}) on "
                f"{dev.choice.describe()} failed: {exc}; {rw.verbs_hint(verbs_errno(exc))}",
                verbs_errno(exc)) from None
        except BaseException:
            self.close()
            raise

    def info(self) -> rw.QpInfo:
        return rw.QpInfo(self.qp.qp_num, self.psn, self.dev.gid, self.dev.lid, self.mtu,
                         self.dev.responder_depth)

    # -- grants ----------------------------------------------------------------------
    async def grant(self, grant_id: bytes, runs: Sequence[tuple[DramRegion, int, int]],
                    write: bool) -> list[int]:
        """Keys for ``runs`` ((region, offset, length) each) until :meth:`revoke`.

        ``write``: remote WRITE only (an allocation); else remote READ only (a lease).
        Returns one rkey per run. Raises :class:`Unavailable` when the device refuses (the
        session is unusable afterwards in ``mw`` mode: a failed bind breaks its QP).
        """
        if self.closed:
            raise Unavailable(f"RDMA session {self.session_id.hex()} is closed; reconnect")
        e = load_verbs().libibverbs_enums.ibv_access_flags
        remote = int(e.IBV_ACCESS_REMOTE_WRITE if write else e.IBV_ACCESS_REMOTE_READ)
        if self.access == "mr":  # a region that is remotely writable must be locally so too
            local = int(e.IBV_ACCESS_LOCAL_WRITE) if write else 0
            return self._register(grant_id, runs, remote | local)
        return await self._bind(grant_id, runs, remote)

    def _register(self, grant_id: bytes, runs: Sequence[tuple[DramRegion, int, int]],
                  flags: int) -> list[int]:
        pv = load_verbs()
        held = self.grants.setdefault(grant_id, [])
        keys = []
        for region, off, length in runs:
            try:
                mr = pv.mr.MR(self.pd, length, flags, address=buffer_address(region.mm) + off)
            except pv.pyverbs_error.PyverbsError as exc:
                self.revoke(grant_id)
                raise Unavailable(
                    f"registering {length} bytes of DRAM slab {region.slab_id} for RDMA "
                    f"session {self.session_id.hex()} failed: {exc}; "
                    f"{rw.verbs_hint(verbs_errno(exc))}") from None
            held.append(mr)
            keys.append(int(mr.rkey))
        return keys

    async def _bind(self, grant_id: bytes, runs: Sequence[tuple[DramRegion, int, int]],
                    flags: int) -> list[int]:
        pv = load_verbs()
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
                            wr_id=int.from_bytes(grant_id[:8], "little"),  # u64 tag
                            opcode=e.ibv_wr_opcode.IBV_WR_BIND_MW,
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
                        f"{self.session_id.hex()} failed: {exc}; {rw.verbs_hint(verbs_errno(exc))} "
                        f"(windows in use by this session: {self.windows()}, device max "
                        f"{self.dev.max_mw}; or set service.rdma_access: mr)") from None
                await self._wait_bind(grant_id, len(chunk))
                if self.grants.get(grant_id) is not held:  # revoked while binding
                    for handle in held:
                        handle.close()
                    raise Unavailable(f"grant {grant_id.hex()} of RDMA session "
                                      f"{self.session_id.hex()} ended while its memory "
                                      f"windows were being bound")
                keys.extend(int(wr.rkey) for wr in reversed(wrs))
            return keys

    async def _wait_bind(self, grant_id: bytes, n: int) -> None:
        pv = load_verbs()
        ok = pv.libibverbs_enums.ibv_wc_status.IBV_WC_SUCCESS
        deadline = time.monotonic() + BIND_TIMEOUT_S
        spin_until = time.monotonic() + BIND_SPIN_S
        while True:
            if self.cq is None:
                raise Unavailable(f"RDMA session {self.session_id.hex()} ended while binding "
                                  f"memory windows; reconnect")
            got, wcs = self.cq.poll(1)
            if got:
                wc = wcs[0]
                if wc.status != ok:
                    self.close()
                    raise Unavailable(
                        f"binding {n} memory windows for RDMA session {self.session_id.hex()} "
                        f"failed: {wc_status_name(int(wc.status))}; the session's QP is in the "
                        f"error state and the session is closed; reconnect")
                return
            now = time.monotonic()
            if now >= deadline:
                self.close()
                raise Unavailable(
                    f"binding {n} memory windows for RDMA session {self.session_id.hex()}: no "
                    f"completion within {BIND_TIMEOUT_S:g} s; check the device "
                    f"(`rdma link show`, dmesg)")
            if now >= spin_until:
                await asyncio.sleep(0.0005)

    def revoke(self, grant_id: bytes) -> None:
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
        pv = load_verbs()
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
                log.exception("RDMA session %s: revoking grant %s failed", self.session_id.hex(),
                              grant_id.hex())
        for name in ("qp", "cq"):
            obj = getattr(self, name)
            if obj is not None:
                try:
                    obj.close()
                except Exception:
                    log.exception("RDMA session %s: closing its %s failed", self.session_id.hex(),
                                  name.upper())
                setattr(self, name, None)
        for slab_id in list(self.slab_mrs):
            try:
                self.drop_slab(slab_id)
            except Exception:
                log.exception("RDMA session %s: deregistering slab %d failed",
                              self.session_id.hex(), slab_id)
        if self.pd is not None:
            try:
                self.pd.close()
            except Exception:
                log.exception("RDMA session %s: closing its PD failed", self.session_id.hex())
            self.pd = None
