"""Peer fetch over RDMA: the verbs resources of both ends (docs/pod.md).

The exchange (attach, request, grant, done) rides the authenticated, encrypted peer
connection (:mod:`ctxmem_common.peer_wire`); only the block bytes move over RDMA, by
one-sided READ from the holder's DRAM slots into the fetcher's registered landing
buffer. Those bytes are not encrypted (the same documented exception as the host RDMA
transport); every block is checked against its index entry's CRC32C before it is stored.

* :func:`open_device`: this node's verbs device for peer fetch (``pod.rdma_listen``), or
  ``None`` when it cannot be opened (logged, counted: peer fetch is TCP only then).
* :class:`FetchLink`: the fetcher's PD, CQ, RC queue pair and landing MR for one peer
  connection; :meth:`FetchLink.read` READs a batch of granted blocks, bounded.
* the holder reuses the service's RDMA transport pieces: a
  :class:`~ctxmem_dpu.transport.rdma_endpoint.SessionEndpoint` per connection (PD, CQ,
  QP, and per-grant memory regions, ``mr`` mode) and :func:`grant_blocks` for the keys
  of one request's pinned blocks.

pyverbs is imported on first use only (through ``rdma_device``), so a node without RDMA
never needs it.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import secrets
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ctxmem_common import rdma_wire as rw
from ctxmem_common.config import PodConfig
from ctxmem_common.errors import CtxmemError
from ctxmem_dpu.transport.rdma_device import (
    ACK_TIMEOUT,
    MIN_RNR_TIMER,
    RESPONDER_DEPTH,
    RETRY_CNT,
    RNR_RETRY,
    RdmaDevice,
    buffer_address,
    load_verbs,
    verbs_errno,
    wc_status_name,
)
from ctxmem_dpu.transport.rdma_endpoint import SessionEndpoint, coalesce

if TYPE_CHECKING:
    from ctxmem_dpu.blocks import Block
    from ctxmem_dpu.tiers.dram import DramTier

__all__ = ["FetchLink", "RdmaTransferError", "grant_blocks", "holder_endpoint", "open_device"]

log = logging.getLogger(__name__)

SQ_DEPTH = 64  # READs posted at once per link (each signalled)
SPIN_S = 0.0002  # busy-poll this long for completions before yielding between polls
POLL_SLEEP_S = 0.0005
# The landing buffer grows to the largest round a request needs, up to this; a request
# bigger than it is read in rounds (one grant, several rounds of READs).
LANDING_MAX = 64 << 20


class RdmaTransferError(Exception):
    """An RDMA READ of peer blocks failed or timed out (what and why, in the message);
    the link is closed and its blocks are misses."""


def open_device(pod: PodConfig, counters: Counter[str]) -> RdmaDevice | None:
    """The verbs device for peer fetch on ``pod.rdma_listen``, or ``None`` (not set, or it
    cannot be opened: pyverbs missing, no device carrying that IP; logged and counted as
    ``pod_rdma_setup_errors``, peer fetch then runs over TCP only)."""
    if not pod.rdma_listen:
        return None
    try:
        return RdmaDevice(rw.find_gid(pod.rdma_listen.strip("[]"), pod.rdma_device))
    except (CtxmemError, OSError) as exc:
        counters["pod_rdma_setup_errors"] += 1
        log.warning("pod.rdma_listen %s: no RDMA for peer fetch (%s); peer fetch uses TCP",
                    pod.rdma_listen, getattr(exc, "message", exc))
        return None


def holder_endpoint(dev: RdmaDevice, peer: rw.QpInfo) -> SessionEndpoint:
    """The holder's end of one peer connection: its own PD and an RC QP connected to the
    fetcher's ``peer``, granting per-request memory regions (``mr``: per-run keys, READ
    only, deregistered when the request's lease ends). Raises ``RdmaDeviceError``."""
    return SessionEndpoint(dev, b"pod-peer-" + secrets.token_bytes(7), "pod", peer, "mr")


async def grant_blocks(ep: SessionEndpoint, dram: DramTier, grant_id: bytes,
                       blocks: Sequence[Block]) -> list[tuple[int, int]]:
    """(remote address, rkey) per pinned DRAM block, READ only on ``ep``'s QP until
    ``ep.revoke(grant_id)``; adjacent slots share one region. Raises ``Unavailable``."""
    spans = []
    for b in blocks:
        assert b.dram is not None
        spans.append((b.dram.slab, dram.offset(b.dram), b.length))
    runs, which = coalesce(spans)
    regions = dram.regions
    keys = await ep.grant(grant_id, [(regions[s], off, n) for s, off, n in runs], False)
    return [(buffer_address(regions[s].mm) + off, keys[which[i]])
            for i, (s, off, _n) in enumerate(spans)]


class FetchLink:
    """The fetcher's verbs resources for one peer connection; ``with FetchLink(dev)``.

    Built in INIT (:meth:`info` goes to the holder), then :meth:`connect` moves the QP to
    RTS towards the holder's. Nothing of ours is remotely accessible (QP access flags 0,
    the landing MR is LOCAL_WRITE only). :meth:`close` (also on any failed read) destroys
    QP, CQ, MR, PD in that order, so nothing can land in the buffer afterwards.
    """

    def __init__(self, dev: RdmaDevice) -> None:
        pv = load_verbs()
        e = pv.libibverbs_enums
        self.dev = dev
        self.qp: Any = None
        self.cq: Any = None
        self.pd: Any = None
        self.mr: Any = None
        self.landing: mmap.mmap | None = None
        self.closed = False
        try:
            dev_attr = dev.ctx.query_device()
            self.sq_depth = max(1, min(SQ_DEPTH, int(dev_attr.max_qp_wr)))
            self.depth = max(1, min(RESPONDER_DEPTH, int(dev_attr.max_qp_init_rd_atom)))
            self.pd = pv.pd.PD(dev.ctx)
            self.cq = pv.cq.CQ(dev.ctx, self.sq_depth)
            cap = pv.qp.QPCap(max_send_wr=self.sq_depth, max_recv_wr=1, max_send_sge=1,
                              max_recv_sge=1)
            init = pv.qp.QPInitAttr(qp_type=e.ibv_qp_type.IBV_QPT_RC, scq=self.cq,
                                    rcq=self.cq, cap=cap, sq_sig_all=0)
            attr = pv.qp.QPAttr(port_num=dev.port)
            attr.qp_access_flags = 0
            self.qp = pv.qp.QP(self.pd, init, attr)  # RESET -> INIT
        except pv.pyverbs_error.PyverbsError as exc:
            self.close()
            raise rw.RdmaDeviceError(
                f"creating the peer-fetch queue pair on {dev.choice.describe()} failed: "
                f"{exc}; {rw.verbs_hint(verbs_errno(exc))}", verbs_errno(exc)) from None
        self.psn = secrets.randbits(24)

    def info(self) -> rw.QpInfo:
        return rw.QpInfo(self.qp.qp_num, self.psn, self.dev.gid, self.dev.lid, self.dev.mtu,
                         self.depth)

    def connect(self, peer: rw.QpInfo) -> None:
        """INIT -> RTS towards the holder's QP (path MTU and READ depth: the smaller of
        both ends'). Raises ``RdmaDeviceError``."""
        pv = load_verbs()
        attr = pv.qp.QPAttr(port_num=self.dev.port)
        attr.qp_access_flags = 0
        attr.path_mtu = min(self.dev.mtu, peer.mtu) if peer.mtu else self.dev.mtu
        attr.dest_qp_num = peer.qpn
        attr.rq_psn = self.psn
        attr.sq_psn = peer.psn
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = self.depth = min(self.depth, peer.rd_atomic or 1)
        attr.min_rnr_timer = MIN_RNR_TIMER
        attr.timeout = ACK_TIMEOUT
        attr.retry_cnt = RETRY_CNT
        attr.rnr_retry = RNR_RETRY
        try:
            gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(rw.gid_to_str(peer.gid)),
                                     sgid_index=self.dev.gid_index, hop_limit=64)
            attr.ah_attr = pv.addr.AHAttr(port_num=self.dev.port, is_global=1, gr=gr,
                                          dlid=peer.lid)
            self.qp.to_rts(attr)
        except pv.pyverbs_error.PyverbsError as exc:
            self.close()
            raise rw.RdmaDeviceError(
                f"connecting peer-fetch QP to the holder's QP {peer.qpn} (GID "
                f"{rw.gid_to_str(peer.gid)}) on {self.dev.choice.describe()} failed: {exc}; "
                f"{rw.verbs_hint(verbs_errno(exc))}", verbs_errno(exc)) from None

    def _landing(self, nbytes: int) -> tuple[mmap.mmap, int]:
        """The landing buffer (at least ``nbytes``) and its lkey; grown by re-registering."""
        if self.landing is None or len(self.landing) < nbytes:
            pv = load_verbs()
            if self.mr is not None:
                self.mr.close()
                self.mr = None
            if self.landing is not None:
                self.landing.close()
                self.landing = None
            size = max(nbytes, 1 << 20)
            self.landing = mmap.mmap(-1, size)
            try:
                self.mr = pv.mr.MR(self.pd, size,
                                   pv.libibverbs_enums.ibv_access_flags.IBV_ACCESS_LOCAL_WRITE,
                                   address=buffer_address(self.landing))
            except pv.pyverbs_error.PyverbsError as exc:
                raise RdmaTransferError(f"registering a {size}-byte landing buffer failed: "
                                        f"{exc}; {rw.verbs_hint(verbs_errno(exc))}") from None
        assert self.mr is not None
        return self.landing, int(self.mr.lkey)

    async def read(self, items: Sequence[tuple[int, int, int]], timeout_s: float
                   ) -> list[bytes]:
        """The bytes of each (remote address, rkey, length), by RDMA READ, in rounds of
        at most :data:`LANDING_MAX` bytes, each bounded by ``timeout_s``. The link is
        closed on any failure (:class:`RdmaTransferError`, or cancellation), so a READ
        still in flight can never land in a buffer that is reused."""
        try:
            out: list[bytes] = []
            start = 0
            while start < len(items):
                stop, used = start + 1, items[start][2]
                while stop < len(items) and used + items[stop][2] <= LANDING_MAX:
                    used += items[stop][2]
                    stop += 1
                out.extend(await self._round(items[start:stop], used, timeout_s))
                start = stop
            return out
        except BaseException:
            self.close()
            raise

    async def _round(self, items: Sequence[tuple[int, int, int]], nbytes: int,
                     timeout_s: float) -> list[bytes]:
        if self.closed:
            raise RdmaTransferError("the peer-fetch RDMA link is closed")
        pv = load_verbs()
        e = pv.libibverbs_enums
        buf, lkey = self._landing(nbytes)
        laddr = buffer_address(buf)
        offs = []
        off = 0
        for _a, _k, n in items:
            offs.append(off)
            off += n
        deadline = time.monotonic() + timeout_s
        for first in range(0, len(items), self.sq_depth):
            chunk = range(first, min(first + self.sq_depth, len(items)))
            follow = None
            wrs = []
            for i in reversed(chunk):  # back to front, to link
                raddr, rkey, n = items[i]
                sge = pv.wr.SGE(laddr + offs[i], n, lkey)
                wr = pv.wr.SendWR(wr_id=i, opcode=e.ibv_wr_opcode.IBV_WR_RDMA_READ,
                                  num_sge=1, sg=[sge],
                                  send_flags=e.ibv_send_flags.IBV_SEND_SIGNALED,
                                  next_wr=follow)
                wr.set_wr_rdma(rkey, raddr)
                wrs.append(wr)
                follow = wr
            try:
                self.qp.post_send(follow)
            except pv.pyverbs_error.PyverbsError as exc:
                raise RdmaTransferError(f"posting {len(chunk)} RDMA READs failed: {exc}; "
                                        f"{rw.verbs_hint(verbs_errno(exc))}") from None
            await self._wait(len(chunk), deadline, timeout_s)
        return [buf[o : o + n] for o, (_a, _k, n) in zip(offs, items, strict=True)]

    async def _wait(self, n: int, deadline: float, timeout_s: float) -> None:
        pv = load_verbs()
        ok = pv.libibverbs_enums.ibv_wc_status.IBV_WC_SUCCESS
        spin_until = time.monotonic() + SPIN_S
        left = n
        while left:
            got, wcs = self.cq.poll(min(left, 16))
            for wc in wcs[:got]:
                if wc.status != ok:
                    raise RdmaTransferError(
                        f"RDMA READ from the holder failed: {wc_status_name(int(wc.status))} (the "
                        f"holder died or ended the lease, or the path is down)")
            left -= got
            if not left:
                return
            now = time.monotonic()
            if now >= deadline:
                raise RdmaTransferError(f"RDMA READ from the holder: no completion within "
                                        f"{timeout_s:g} s; check `rdma link show` on both "
                                        f"nodes")
            if now >= spin_until:
                await asyncio.sleep(POLL_SLEEP_S)

    def close(self) -> None:
        """QP, CQ, MR, PD, then the buffer — children before parents; idempotent."""
        self.closed = True
        for name in ("qp", "cq", "mr", "pd"):
            obj = getattr(self, name)
            if obj is not None:
                try:
                    obj.close()
                except Exception:
                    log.exception("peer-fetch RDMA link: closing its %s failed", name.upper())
                setattr(self, name, None)
        if self.landing is not None:
            self.landing.close()
            self.landing = None

    def __enter__(self) -> FetchLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
