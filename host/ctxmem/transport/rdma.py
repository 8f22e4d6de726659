"""RDMA channel: one-sided RDMA WRITE (put) and READ (get) into the service's slots.

One RC queue pair per session, connected over the control plane (``RdmaInfo`` then a
long-lived ``RdmaAttach`` call of ``ctxmem.proto``; see :mod:`ctxmem_common.rdma_wire`).
Each slot that Allocate or Acquire returns carries the service's virtual address and an
rkey of the session's own memory region over that slab; the channel posts one work
request per slot, straight from (put) or into (get) the caller's buffer:

* **registration cache** — a caller buffer of at least ``reg_min_bytes`` is registered
  once, as the whole contiguous buffer that owns it (a KV pool registered once serves
  every block sliced out of it), and kept registered (LRU, ``reg_cache_bytes`` in all).
  The cache holds a reference to each registered buffer, so its memory can never be
  freed and reused under a live registration (the classic registration-cache hazard).
  Smaller buffers, or ones that cannot be registered (read-only mappings, memlock
  limit), are staged through a registered **bounce buffer** (one memcpy each way).
* **verified reads** (the default get) READ whole blocks into a private landing buffer
  (registered through the cache), check each block's CRC32C there and copy it into the
  caller's buffer only if it matches (:meth:`RdmaChannel.read_verified`).
* **batched, selectively signalled work requests** — up to ``signal_every`` WRs are
  linked into one chain and posted with one ``ibv_post_send``; only the chain's last WR
  asks for a completion (RC completes in order, so it retires the whole chain). At most
  ``sq_depth`` WRs are outstanding.
* **bounded completion waits** — the CQ is polled for a few microseconds, then the
  thread sleeps on the completion channel's fd with ``select``; every wait ends within
  ``timeout_s`` of the last progress, and also as soon as the service ends the
  ``RdmaAttach`` call (restart, crash).
* **failure** — a failed completion (remote access error, retry exceeded) or a timeout
  destroys the QP at once (no late DMA into the caller's buffers), and raises
  :class:`RdmaError`, a :class:`~ctxmem.transport.base.TransportError`: the client then
  reconnects with a new session and retries once; a get that still fails is a miss.

The shim's own memory is never exposed: its QP and MRs grant no remote access.
pyverbs is imported when the first channel opens, never by ``import ctxmem``.

This module is the channel (its queue pair's life and the transfers);
:mod:`~ctxmem.transport.rdma_exchange` holds the ``RdmaInfo`` and ``RdmaAttach`` exchange,
device choice and connecting the QP, :mod:`~ctxmem.transport.rdma_buffers` the
registration cache, bounce plan, slot checks, verified reads' landing and WR chains,
:mod:`~ctxmem.transport.rdma_verbs` the knobs, the pyverbs import and :class:`RdmaError`.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import secrets
import select
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from ctxmem.transport.base import DataChannel, Grant, TransportError
from ctxmem.transport.rdma_buffers import (
    Piece,
    Registration,
    RegistrationCache,
    Work,
    address_of,
    bounce_plan,
    chains,
    land_verified,
    owner_view,
    slot_items,
)
from ctxmem.transport.rdma_exchange import choose_device, connect_qp, rdma_attach, rdma_info
from ctxmem.transport.rdma_verbs import (
    ACK_TIMEOUT,
    ENV_BOUNCE_MB,
    ENV_DEVICE,
    ENV_GID_INDEX,
    ENV_REG_CACHE_MB,
    ENV_REG_MIN_KB,
    ENV_SIGNAL_EVERY,
    INITIATOR_DEPTH,
    MIN_RNR_TIMER,
    OP_READ,
    OP_WRITE,
    RETRY_CNT,
    RNR_RETRY,
    SPIN_S,
    SQ_DEPTH,
    RdmaError,
    _env_int,
    _errno,
    _verbs,
    wc_status_text,
)
from ctxmem.transport.verified import ReadProgress
from ctxmem_common import rdma_wire as rw
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.proto import ctxmem_pb2_grpc as pb_grpc

# The channel's pieces live in rdma_verbs (knobs, pyverbs, errors) and rdma_buffers
# (registration cache, bounce plan, WR chains); these names stay importable from here.
__all__ = [
    "ACK_TIMEOUT", "ENV_BOUNCE_MB", "ENV_DEVICE", "ENV_GID_INDEX", "ENV_REG_CACHE_MB",
    "ENV_REG_MIN_KB", "ENV_SIGNAL_EVERY", "INITIATOR_DEPTH", "MIN_RNR_TIMER", "OP_READ",
    "OP_WRITE", "RETRY_CNT", "RNR_RETRY", "SPIN_S", "SQ_DEPTH", "Piece", "RdmaChannel",
    "RdmaError", "Registration", "RegistrationCache", "Work", "address_of", "bounce_plan",
    "chains", "owner_view", "wc_status_text",
]

log = logging.getLogger(__name__)
LANDING_BYTES = 16 << 20  # a verified read's blocks per round of RDMA READs (>= one block)

# ---------------------------------------------------------------------------------------
# The channel
# ---------------------------------------------------------------------------------------

_LIVE: weakref.WeakSet[RdmaChannel] = weakref.WeakSet()
_INHERITED: list[Any] = []  # verbs objects a forked child must never destroy


def _orphan_in_child() -> None:
    # A forked child shares the parent's verbs context (the same uverbs file): destroying
    # "its" QP or MRs would destroy the parent's. Keep them referenced forever instead.
    for ch in list(_LIVE):
        ch._orphan()


os.register_at_fork(after_in_child=_orphan_in_child)


class RdmaChannel(DataChannel):
    name = "rdma"

    def __init__(self, grpc_channel: Any, session_id: bytes, token: bytes, timeout_s: float,
                 *, device: str = "", gid_index: int = -1) -> None:
        pv = _verbs()
        self._pv = pv
        self._lock = threading.Lock()
        self.timeout_s = timeout_s
        self.session_id = session_id
        self.signal_every = max(1, _env_int(ENV_SIGNAL_EVERY, 16))
        self._broken = ""
        self._closed = False
        self._pid = os.getpid()
        self._peer_gone = threading.Event()
        self._attach_call: Any = None
        self.ctx: Any = None
        self.pd: Any = None
        self.comp_channel: Any = None
        self.cq: Any = None
        self.qp: Any = None
        self._bounce_mr: Any = None
        self._bounce: mmap.mmap | None = None
        self._bounce_view: memoryview | None = None
        self._landing = np.empty(0, dtype=np.uint8)  # verified reads land here first
        self.cache = RegistrationCache(self._reg, self._dereg,
                                       min_bytes=_env_int(ENV_REG_MIN_KB, 256) << 10,
                                       max_bytes=_env_int(ENV_REG_CACHE_MB, 1024) << 20)
        self.stats = collections.Counter[str]()
        stub = pb_grpc.ContextMemoryStub(grpc_channel)
        try:
            server = self._info(stub, token)
            self.choice = self._choose_device(server, device, gid_index)
            self._open_verbs(server)
            self._attach(stub, token)
        except BaseException:
            self._teardown()
            raise
        _LIVE.add(self)

    # -- setup -----------------------------------------------------------------------
    def _info(self, stub: pb_grpc.ContextMemoryStub, token: bytes) -> pb.RdmaInfoResponse:
        return rdma_info(stub, self.session_id, token, self.timeout_s)

    def _choose_device(self, server: pb.RdmaInfoResponse, device: str, gid_index: int
                       ) -> rw.GidChoice:
        return choose_device(server, device, gid_index)

    def _open_verbs(self, server: pb.RdmaInfoResponse) -> None:
        pv = self._pv
        e = pv.libibverbs_enums
        c = self.choice
        try:
            self.ctx = pv.device.Context(name=c.device)
            port_attr = self.ctx.query_port(c.port)
            dev_attr = self.ctx.query_device()
            self.pd = pv.pd.PD(self.ctx)
            self.comp_channel = pv.cq.CompChannel(self.ctx)
            self.sq_depth = max(2, min(SQ_DEPTH, int(dev_attr.max_qp_wr)))
            self.signal_every = min(self.signal_every, self.sq_depth)
            self.cq = pv.cq.CQ(self.ctx, self.sq_depth + 16, None, self.comp_channel, 0)
            cap = pv.qp.QPCap(max_send_wr=self.sq_depth, max_recv_wr=1, max_send_sge=1,
                              max_recv_sge=1)
            init = pv.qp.QPInitAttr(qp_type=e.ibv_qp_type.IBV_QPT_RC, scq=self.cq,
                                    rcq=self.cq, cap=cap, sq_sig_all=0)
            attr = pv.qp.QPAttr(port_num=c.port)
            attr.qp_access_flags = 0  # nothing of ours is remotely accessible
            self.qp = pv.qp.QP(self.pd, init, attr)  # RESET -> INIT
            bounce_bytes = max(1, _env_int(ENV_BOUNCE_MB, 8)) << 20
            self._bounce = mmap.mmap(-1, bounce_bytes)
            self._bounce_view = memoryview(self._bounce)
            self._bounce_mr = pv.mr.MR(self.pd, bounce_bytes,
                                       e.ibv_access_flags.IBV_ACCESS_LOCAL_WRITE,
                                       address=address_of(self._bounce_view))
        except pv.pyverbs_error.PyverbsError as exc:
            raise RdmaError(f"setting up RDMA on {c.describe()} failed: {exc}",
                            _errno(exc)) from None
        self.lid = int(port_attr.lid)
        self.mtu = int(port_attr.active_mtu)
        self.psn = secrets.randbits(24)
        self.depth = max(1, min(INITIATOR_DEPTH, int(dev_attr.max_qp_init_rd_atom),
                                server.rd_atomic or 1))

    def _attach(self, stub: pb_grpc.ContextMemoryStub, token: bytes) -> None:
        mine = rw.QpInfo(self.qp.qp_num, self.psn, self.choice.gid, self.lid, self.mtu,
                         self.depth)
        self._attach_call, peer = rdma_attach(stub, self.session_id, token, self.timeout_s,
                                              mine)
        # The service ending the call (shutdown, restart, a broken QP) ends the connection.
        self._attach_call.add_done_callback(lambda _c: self._peer_gone.set())
        connect_qp(self._pv, self.qp, self.choice, peer, psn=self.psn, mtu=self.mtu,
                   depth=self.depth)
        log.info("ctxmem rdma: session %s on %s, QP %d -> service QP %d, MTU enum %d, "
                 "READ depth %d", self.session_id.hex(), self.choice.describe(), self.qp.qp_num,
                 peer.qpn, min(self.mtu, peer.mtu), self.depth)

    # -- registration (the cache's verbs calls) --------------------------------------
    def _reg(self, addr: int, nbytes: int, writable: bool) -> tuple[int, Any]:
        pv = self._pv
        access = pv.libibverbs_enums.ibv_access_flags.IBV_ACCESS_LOCAL_WRITE if writable else 0
        try:
            mr = pv.mr.MR(self.pd, nbytes, access, address=addr)
        except pv.pyverbs_error.PyverbsError as exc:
            raise RdmaError(f"registering {nbytes} bytes at {addr:#x}", _errno(exc)) from None
        return mr.lkey, mr

    @staticmethod
    def _dereg(handle: Any) -> None:
        handle.close()

    # -- DataChannel -----------------------------------------------------------------
    def _write_grant(self, grant: Grant, views: Sequence[memoryview]) -> list[int]:
        """One RDMA WRITE per slot (each ``pb.Slot`` carries its address and rkey)."""
        return self.write_crc(grant.id, grant.pb_slots(), views)

    def _read_grant(self, grant: Grant, views: Sequence[memoryview], verify: bool,
                    progress: ReadProgress) -> None:
        """RDMA READs into the landing buffer, checked (:meth:`read_verified`), or
        straight into ``views`` (:meth:`read`)."""
        n = len(views)
        slots = grant.pb_slots()[:n]
        if verify:
            self.read_verified(grant.id, slots, views, grant.crcs[:n], progress)
        else:
            self.read(grant.id, slots, views)

    def write(self, allocation_id: bytes, slots: Sequence[pb.Slot],
              views: Sequence[memoryview]) -> None:
        self._slots(OP_WRITE, slots, views, f"allocation {allocation_id.hex()}")

    def read(self, lease_id: bytes, slots: Sequence[pb.Slot],
             views: Sequence[memoryview]) -> None:
        self._slots(OP_READ, slots, views, f"lease {lease_id.hex()}")

    def read_verified(self, lease_id: bytes, slots: Sequence[pb.Slot],
                      views: Sequence[memoryview], crcs: Sequence[int],
                      progress: ReadProgress) -> None:
        """RDMA READ whole blocks into the channel's private landing buffer (registered
        once through the registration cache, up to :data:`LANDING_BYTES` of blocks per
        round), then CRC-check each block there and copy it into its view only if it
        matches; the first block that fails stops the read (it and later views untouched).
        Nothing else writes the landing buffer once the READs completed, so the bytes
        copied are the bytes checked."""
        what = f"lease {lease_id.hex()}"

        def fetch(start: int, stop: int, parts: list[memoryview]) -> None:
            self.transfer(OP_READ, slot_items(OP_READ, slots[start:stop], parts, what))

        land_verified(views, crcs, progress, LANDING_BYTES, self._landing_view, fetch)

    def _landing_view(self, nbytes: int) -> memoryview:
        if self._landing.nbytes < nbytes:
            self._landing = np.empty(nbytes, dtype=np.uint8)
        return self._landing.data[:nbytes]

    def _slots(self, op: str, slots: Sequence[pb.Slot], views: Sequence[memoryview],
               what: str) -> None:
        self.transfer(op, slot_items(op, slots, views, what))

    def transfer(self, op: str, items: Sequence[tuple[memoryview, int, int]]) -> None:
        """RDMA ``op`` (``"write"``: local -> remote, ``"read"``: remote -> local) of each
        ``(local view, remote address, rkey)``; returns when all completed.

        Raises:
            RdmaError: a completion failed (e.g. remote access error) or none came within
                ``timeout_s``; the channel is then broken (its QP destroyed).
            TransportError: the channel was already broken or closed.
        """
        with self._lock:
            self._check_usable()
            need_write = op == OP_READ
            direct: list[Work] = []
            staged: list[tuple[memoryview, int, int]] = []
            for view, raddr, rkey in items:
                hit = self.cache.lookup(view, need_write)
                if hit is None:
                    staged.append((view, raddr, rkey))
                else:
                    direct.append(Work(hit[0], view.nbytes, hit[1], raddr, rkey))
            self._run(op, direct)
            if staged:
                self._run_staged(op, staged)
            self.stats[f"{op}_ops"] += len(items)
            self.stats[f"{op}_bytes"] += sum(v.nbytes for v, _a, _k in items)
            self.stats[f"{op}_staged"] += len(staged)

    def _run_staged(self, op: str, staged: list[tuple[memoryview, int, int]]) -> None:
        assert self._bounce_view is not None and self._bounce_mr is not None
        bounce = self._bounce_view
        base, lkey = address_of(bounce), self._bounce_mr.lkey
        for rnd in bounce_plan([v.nbytes for v, _a, _k in staged], bounce.nbytes):
            work = []
            for p in rnd:
                view, raddr, rkey = staged[p.item]
                if op == OP_WRITE:
                    bounce[p.bounce_offset : p.bounce_offset + p.length] = \
                        view[p.offset : p.offset + p.length]
                work.append(Work(base + p.bounce_offset, p.length, lkey, raddr + p.offset, rkey))
            self._run(op, work)
            if op == OP_READ:
                for p in rnd:
                    view = staged[p.item][0]
                    view[p.offset : p.offset + p.length] = \
                        bounce[p.bounce_offset : p.bounce_offset + p.length]

    def _run(self, op: str, work: Sequence[Work]) -> None:
        """Post ``work`` in signalled chains, at most ``sq_depth`` WRs outstanding."""
        if not work:
            return
        pv = self._pv
        e = pv.libibverbs_enums
        opcode = (e.ibv_wr_opcode.IBV_WR_RDMA_WRITE if op == OP_WRITE
                  else e.ibv_wr_opcode.IBV_WR_RDMA_READ)
        signaled = e.ibv_send_flags.IBV_SEND_SIGNALED
        plan = chains(len(work), self.signal_every)
        inflight: dict[int, int] = {}
        outstanding = 0
        nxt = 0
        deadline = time.monotonic() + self.timeout_s
        while nxt < len(plan) or inflight:
            while nxt < len(plan):
                start, stop = plan[nxt]
                if outstanding + (stop - start) > self.sq_depth:
                    break
                wrs: list[Any] = []
                follow = None
                for j in range(stop - 1, start - 1, -1):  # build back to front to link
                    w = work[j]
                    sge = pv.wr.SGE(w.laddr, w.length, w.lkey)
                    wr = pv.wr.SendWR(wr_id=nxt, opcode=opcode, num_sge=1, sg=[sge],
                                      send_flags=signaled if j == stop - 1 else 0,
                                      next_wr=follow)
                    wr.set_wr_rdma(w.rkey, w.raddr)
                    wrs.append(wr)
                    follow = wr
                try:
                    self.qp.post_send(follow)
                except pv.pyverbs_error.PyverbsError as exc:
                    self._break(f"posting {stop - start} RDMA {op} WRs failed: {exc}")
                    raise RdmaError(f"RDMA {op}: post_send failed", _errno(exc)) from None
                inflight[nxt] = stop - start
                outstanding += stop - start
                nxt += 1
            for wc in self._wait(deadline, op):
                if wc.status != e.ibv_wc_status.IBV_WC_SUCCESS:
                    text = wc_status_text(int(wc.status))
                    self._break(f"RDMA {op} completion failed: {text}")
                    raise RdmaError(f"RDMA {op} failed: {text}", wc_status=int(wc.status))
                outstanding -= inflight.pop(int(wc.wr_id), 0)
                deadline = time.monotonic() + self.timeout_s  # progress: a fresh bound

    def _wait(self, deadline: float, op: str) -> list[Any]:
        """Completions, polling briefly then sleeping on the completion channel."""
        cq = self.cq
        spin_until = time.monotonic() + SPIN_S
        armed = False
        while True:
            n, wcs = cq.poll(16)
            if n:
                return list(wcs[:n])
            now = time.monotonic()
            if now < spin_until:
                continue
            if self._peer_gone.is_set():
                self._break("the service ended the RDMA session mid-transfer")
                raise RdmaError(f"RDMA {op} aborted: the service ended the session (it "
                                f"restarted, crashed or is shutting down)")
            if now >= deadline:
                self._break(f"no RDMA {op} completion within {self.timeout_s:g} s")
                raise RdmaError(f"RDMA {op}: no completion within {self.timeout_s:g} s; check "
                                f"the port state (`rdma link show`), the GID index and the MTU")
            if not armed:
                cq.req_notify()
                armed = True
                continue  # poll once more: a completion may have landed before arming
            ready, _, _ = select.select([self.comp_channel.fd], [], [],
                                        min(deadline - now, 0.25))
            if ready:
                self.comp_channel.get_cq_event(cq)
                cq.ack_events(1)
                armed = False

    # -- state -----------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise TransportError("RDMA channel is closed")
        if self._broken:
            raise TransportError(f"RDMA channel is broken ({self._broken}); reconnect")
        if self._peer_gone.is_set():
            self._break("the service ended the RDMA session")
            raise TransportError("the service ended the RDMA session (it restarted, crashed or "
                                 "is shutting down); reconnect")

    def _break(self, why: str) -> None:
        """Destroy the QP now: nothing may land in the caller's buffers after we return."""
        self._broken = why
        log.warning("ctxmem rdma: session %s: %s", self.session_id.hex(), why)
        if self.qp is not None:
            try:
                self.qp.close()
            except Exception:
                log.exception("closing a broken QP failed")
            self.qp = None

    def _orphan(self) -> None:
        _INHERITED.extend(o for o in (self.qp, self.cq, self._bounce_mr, self.cache, self.pd,
                                      self.comp_channel, self.ctx, self._bounce) if o is not None)
        self.qp = self.cq = self._bounce_mr = self.pd = self.comp_channel = self.ctx = None
        self._bounce = None
        self._bounce_view = None
        self.cache = RegistrationCache(self._reg, self._dereg, min_bytes=0, max_bytes=0)
        self._attach_call = None
        self._closed = True

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _LIVE.discard(self)
            if os.getpid() != self._pid:  # a forked child: not ours to destroy
                return
            self._teardown()

    def _teardown(self) -> None:
        """End the RdmaAttach call, then QP, CQ, MRs, PD, completion channel, context."""
        if self._attach_call is not None:
            self._attach_call.cancel()
            self._attach_call = None
        for name in ("qp", "cq"):
            obj = getattr(self, name)
            setattr(self, name, None)
            if obj is not None:
                try:
                    obj.close()
                except Exception:
                    log.exception("ctxmem rdma: closing %s failed", name.upper())
        try:
            self.cache.clear()
        except Exception:
            log.exception("ctxmem rdma: deregistering cached buffers failed")
        for name in ("_bounce_mr", "pd", "comp_channel", "ctx"):
            obj = getattr(self, name)
            setattr(self, name, None)
            if obj is not None:
                try:
                    obj.close()
                except Exception:
                    log.exception("ctxmem rdma: closing %s failed", name.strip("_"))
        if self._bounce_view is not None:
            self._bounce_view.release()
            self._bounce_view = None
        if self._bounce is not None:
            self._bounce.close()
            self._bounce = None
