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
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ctxmem_common import rdma_wire as rw
from ctxmem_common.config import rdma_ip
from ctxmem_common.errors import ConfigError, InvalidArgument, PermissionDenied, Unavailable
from ctxmem_dpu.transport.base import DataServer
from ctxmem_dpu.transport.rdma_device import (
    ACK_TIMEOUT,
    BIND_DEPTH,
    BIND_SPIN_S,
    BIND_TIMEOUT_S,
    MIN_RNR_TIMER,
    RESPONDER_DEPTH,
    RETRY_CNT,
    RNR_RETRY,
    RXE_VENDOR_ID,
    RdmaDevice,
    buffer_address,
)
from ctxmem_dpu.transport.rdma_endpoint import SessionEndpoint, Span, coalesce

if TYPE_CHECKING:
    from ctxmem_dpu.alloc import SlotRef
    from ctxmem_dpu.blocks import Session
    from ctxmem_dpu.store import BlockStore

# The pieces live in rdma_device (device context, verbs helpers, tuning) and
# rdma_endpoint (a session's PD/QP and its grants' keys); these names stay importable here.
__all__ = [
    "ACK_TIMEOUT", "BIND_DEPTH", "BIND_SPIN_S", "BIND_TIMEOUT_S", "MIN_RNR_TIMER",
    "RESPONDER_DEPTH", "RETRY_CNT", "RNR_RETRY", "RXE_VENDOR_ID", "RdmaDevice", "RdmaServer",
    "SessionEndpoint", "Span", "buffer_address", "coalesce",
]

log = logging.getLogger(__name__)


class RdmaServer(DataServer):
    """Serves the RDMA exchange (``RdmaInfo``/``RdmaAttach``, through the servicer) and
    grants per-slot, per-lease keys.

    A :class:`~ctxmem_dpu.transport.base.DataServer` whose connections are the sessions'
    :class:`SessionEndpoint` (one per open ``RdmaAttach`` call, in :attr:`endpoints`):
    start opens the verbs device, close ends every ``RdmaAttach`` call, frees every
    session's resources, then closes the device.
    """

    transport = "rdma"

    def __init__(self, store: BlockStore, listen: str, device: str = "", gid_index: int = -1,
                 access: str = "auto") -> None:
        super().__init__(store)
        self.ip = rdma_ip(listen)
        self.device_name = device
        self.gid_index = gid_index
        if access not in ("auto", "mw", "mr"):
            raise ConfigError(f"service.rdma_access: {access!r} is not one of auto, mw, mr")
        self.access_wanted = access
        self.access = ""  # resolved at start
        self.dev: RdmaDevice | None = None
        self.endpoints: dict[bytes, SessionEndpoint] = {}
        self._grant_owner: dict[bytes, SessionEndpoint] = {}
        self._closing = asyncio.Event()

    @property
    def address(self) -> str:
        """The RDMA device's IP (``service.rdma_listen``): it picks the device and GID."""
        return self.ip

    def connection_count(self) -> int:
        return len(self.endpoints)

    async def _open(self) -> None:
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
    def _session(self, call: str, session_id: bytes, token: bytes) -> Session:
        """The RDMA session ``session_id`` if ``token`` is its token, else the error
        ``call`` (``"RdmaInfo"``, ``"RdmaAttach"``) answers with."""
        if self._closing.is_set() or self.dev is None:
            raise Unavailable(
                f"{call} for session {session_id.hex()}: the service's RDMA transport is shutting "
                f"down; reconnect (a new Connect) once the service is back")
        s = self.store.session(session_id)  # UnknownSession, as for every other call
        if self.authenticate(session_id, token) is None:
            raise PermissionDenied(
                f"{call} for session {session_id.hex()}: wrong session token; send the "
                f"session_token that Connect returned for this session")
        if s.transport != "rdma":
            raise InvalidArgument(
                f"{call} for session {session_id.hex()}: the session was opened with transport "
                f"{s.transport!r}, not 'rdma'; Connect with transport TRANSPORT_RDMA to use "
                f"RdmaInfo/RdmaAttach")
        return s

    def info(self, session_id: bytes, token: bytes) -> RdmaDevice:
        """The device a client of RDMA session ``session_id`` connects to (its GID, LID,
        MTU and responder depth). Raises the :class:`CtxmemError` to answer with."""
        self._session("RdmaInfo", session_id, token)
        assert self.dev is not None
        return self.dev

    def open_endpoint(self, session_id: bytes, token: bytes, peer: rw.QpInfo) -> SessionEndpoint:
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
                f"RdmaAttach for session {s.id.hex()}: the session already has an RDMA connection "
                f"(an earlier RdmaAttach call of it is still open); end that call first, or "
                f"Connect a new session")
        peer.check(f"RdmaAttach for session {s.id.hex()}: RdmaAttachRequest.qp")
        assert self.dev is not None
        try:
            ep = SessionEndpoint(self.dev, s.id, s.tenant, peer, self.access)
        except rw.RdmaDeviceError as exc:
            log.warning("%s", exc.message)
            raise
        self.endpoints[s.id] = ep
        log.info("RDMA session %s (tenant %r) attached: QP %d <- peer QP %d", s.id.hex(), s.tenant,
                 ep.qp.qp_num, peer.qpn)
        return ep

    def drop_endpoint(self, ep: SessionEndpoint) -> None:
        if self.endpoints.get(ep.session_id) is ep:
            del self.endpoints[ep.session_id]
            log.info("RDMA session %s detached", ep.session_id.hex())
        ep.close()

    # -- keys ------------------------------------------------------------------------
    async def grant(self, s: Session, grant_id: bytes, refs: Sequence[SlotRef],
                    lengths: Sequence[int], write: bool) -> list[tuple[int, int]]:
        """(remote address, rkey) for each slot of an allocation (``write``) or a lease.

        The keys reach exactly ``lengths[i]`` bytes of each slot, for WRITE only or READ
        only, on ``s``'s connection only, until :meth:`revoke` (the store's grant-end
        hook). Only the servicer calls this, for ``s``'s own allocations and leases.
        """
        ep = self.endpoints.get(s.id)
        if ep is None or ep.closed:
            raise Unavailable(
                f"session {s.id.hex()} has no RDMA connection (its RdmaAttach call ended or never "
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
            raise Unavailable(f"grant {grant_id.hex()} of session {s.id.hex()} ended before "
                              f"its keys were ready (expired or the session closed); retry")
        base = {slab: buffer_address(dram.regions[slab].mm) for slab, _o, _n in runs}
        return [(base[slab] + off, keys[which[i]])
                for i, (slab, off, _n) in enumerate(spans)]

    def revoke(self, grant_id: bytes) -> None:
        """The store's grant-end hook: the grant's keys stop working now."""
        ep = self._grant_owner.pop(grant_id, None)
        if ep is not None:
            ep.revoke(grant_id)

    def _slab_retired(self, slab_id: int, generation: int) -> None:
        for ep in self.endpoints.values():
            ep.drop_slab(slab_id)

    async def _stop_accepting(self) -> None:
        self._closing.set()  # RdmaInfo/RdmaAttach answer UNAVAILABLE from now on

    async def _drop_connections(self) -> None:
        """End every RdmaAttach call and free every session's verbs resources."""
        for ep in list(self.endpoints.values()):
            self.drop_endpoint(ep)

    async def _release(self) -> None:
        hooks = self.store.dram.on_retire
        if self._slab_retired in hooks:
            hooks.remove(self._slab_retired)
        if self.revoke in self.store.on_grant_end:
            self.store.on_grant_end.remove(self.revoke)
        self._grant_owner.clear()
        if self.dev is not None:
            self.dev.close()
            self.dev = None
