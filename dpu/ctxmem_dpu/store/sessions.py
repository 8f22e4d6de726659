"""Sessions, namespaces and grants: who may touch which slots, and for how long.

A *grant* is an allocation (slots a client writes before Commit) or a lease (blocks a
client reads before Release). Both end at commit/abort/release, at expiry (the reaper
calls :meth:`SessionRegistry.expire`) or when their session closes; when one ends, the
``on_grant_end`` hooks run first so transports revoke the client's access (RDMA memory
windows) before the slots can be freed or reused.

Revoking access differs by transport. TCP needs nothing: the data server looks the
allocation up (and holds it) for every write, so a late write is refused with EXPIRED.
RDMA revokes the grant's memory windows / regions in ``on_grant_end``, so a late one-sided
write fails on the client's QP. Shared memory cannot revoke: the client maps whole slabs
and can still write the slots of an allocation that expired. Those slots are therefore
*quarantined* with the session (never handed to anyone else) while the session has a
shared-memory connection open, and freed when its last one closes or the session ends;
an explicit abort is trusted (the client says it is done) and frees them at once.

Sessions end one way, :meth:`SessionRegistry.close_session` (grants ended, slots and
quarantine freed, the ``on_session_end`` hooks run), for one of four reasons:

* *disconnected*: the client said so (``Disconnect``, what ``Client.close`` sends);
* *orphaned*: its client holds the session (Connect's ``hold``: it keeps a ``Hold`` call
  open while it lives) and no Hold call has been open for ``service.session_orphan_s``:
  the client process died, its connection dropped, or it gave up on its Connect;
* *idle*: no call and no data-plane request for ``service.session_idle_s`` (the only rule
  for clients that do not hold: older shims, raw protocol clients);
* *abandoned*: its Connect's caller had given up by the time the session was made
  (ended by the servicer at once).

The reaper (:meth:`SessionRegistry.reap_sessions`) ends the first three, and never a
session that has a shared-memory connection open (its client can still write the slabs it
mapped) or an allocation being written or committed: such a session ends as soon as both
are over (a disconnected one from :meth:`shm_detached` at once, else at the reaper's next
pass). A session being ended is no longer live: calls and data connections naming it are
refused as an unknown session, and the per-tenant session cap does not count it. Its
client's next call gets UNKNOWN_SESSION and the shim reconnects. Per-tenant caps on
sessions and namespaces are checked here through ``quotas`` (``ctxmem_dpu.store.quotas``),
given at construction: the registry and the quotas share one
:class:`~ctxmem_dpu.blocks.SessionTables` (the registry mutates it, the quotas count it).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from ctxmem_common.config import Config
from ctxmem_common.errors import (
    Expired,
    InvalidArgument,
    PermissionDenied,
    UnknownNamespace,
    UnknownSession,
)
from ctxmem_common.keys import namespace_digest
from ctxmem_common.layout import KVLayout
from ctxmem_dpu.alloc import SlotRef
from ctxmem_dpu.blocks import Allocation, Block, Lease, Namespace, Session, SessionTables
from ctxmem_dpu.store.index import BlockIndex
from ctxmem_dpu.tiers.dram import DramTier, round_up

if TYPE_CHECKING:
    from ctxmem_dpu.store.quotas import Quotas

log = logging.getLogger("ctxmem_dpu.store")


class SessionRegistry:
    """Every open session, namespace, allocation and lease of this service instance.

    ``tables``: where they are kept, shared with ``quotas`` (built over the same
    instance), which caps sessions and namespaces per tenant."""

    def __init__(self, cfg: Config, dram: DramTier, index: BlockIndex,
                 unpin: Callable[[Block], None], tables: SessionTables,
                 quotas: Quotas) -> None:
        self.cfg = cfg
        self._dram = dram
        self._index = index
        self._unpin = unpin
        self.quotas = quotas
        self.sessions = tables.sessions
        self.namespaces = tables.namespaces
        self.allocations = tables.allocations
        self.leases = tables.leases
        # Session id -> DRAM slots of its expired allocations, held back while the
        # session's client may still write them (see the module doc).
        self.quarantine: dict[bytes, list[SlotRef]] = {}
        # Session id -> open shared-memory connections (through which it maps slabs).
        self.mapped: Counter[bytes] = Counter()
        # Called with an allocation's or lease's id when it ends, before its slots are
        # unpinned or freed: see grant_ended.
        self.on_grant_end: list[Callable[[bytes], None]] = []
        # Called with a session once it has ended (close_session): the servicer ends the
        # session's Hold calls there.
        self.on_session_end: list[Callable[[Session], None]] = []

    def new_id(self) -> bytes:
        """A fresh session, allocation or lease id: 16 random bytes.

        Never sequential: ids from one counter let a tenant find another's session one id
        away and name its allocations (issue 12). Random ids also never alias across a
        restart (a client holding an old id gets "unknown session" and reconnects).
        """
        while True:
            new = secrets.token_bytes(16)
            if new not in self.sessions and new not in self.allocations \
                    and new not in self.leases:
                return new

    # -- sessions and namespaces ------------------------------------------------------
    def connect(self, tenant: str, token: str, transport: str, client_name: str,
                hold: bool = False) -> Session:
        """A new session; ``hold``: its client keeps a Hold call open while it lives (the
        orphan rule applies, see the module doc)."""
        tokens = self.cfg.service.tenant_tokens
        if not tenant:
            raise InvalidArgument("tenant must not be empty")
        if tokens and not hmac.compare_digest(tokens.get(tenant, "").encode(), token.encode()):
            raise PermissionDenied(f"tenant {tenant!r}: missing or wrong tenant token")
        if transport not in self.cfg.service.transports:
            raise InvalidArgument(
                f"transport {transport!r} is not enabled on this service; it offers "
                f"{self.cfg.service.transports} (service.transports)"
            )
        self.quotas.check_tenants(tenant)
        self.quotas.check_session(tenant)
        s = Session(self.new_id(), tenant, transport, client_name, held_by_client=hold)
        self.sessions[s.id] = s
        return s

    def live(self, session_id: bytes) -> Session | None:
        """The session ``session_id`` unless it is unknown or being ended (what the call
        interceptor and the data servers authenticate against)."""
        s = self.sessions.get(session_id)
        return None if s is None or s.ending else s

    def session(self, session_id: bytes) -> Session:
        s = self.live(session_id)
        if s is not None:
            s.last_used = time.monotonic()
            return s
        raise UnknownSession(
            f"session {session_id.hex()} is unknown to this service instance (it restarted or "
            f"the session was closed); reconnect")

    def open_namespace(
        self, s: Session, model_id: str, layout: KVLayout, tags: dict[str, str],
        weights_revision: str = "",
    ) -> tuple[int, Namespace]:
        digest = namespace_digest(s.tenant, model_id, layout, tags, weights_revision)
        self.quotas.check_namespace(s, digest)
        ns = self.namespaces.get(digest)
        if ns is None:
            slot_size = round_up(layout.block_nbytes)
            if slot_size > self.cfg.dram.slab_size:
                raise InvalidArgument(
                    f"a block of this layout is {layout.block_nbytes} bytes, larger than one "
                    f"DRAM slab (dram.slab_size={self.cfg.dram.slab_size}); raise "
                    f"dram.slab_size or use fewer tokens_per_block"
                )
            ns = Namespace(digest, s.tenant, model_id, layout, dict(tags), layout.block_nbytes,
                           slot_size)
            self.namespaces[digest] = ns
            self._index.namespace(digest)
            self.quotas.namespace_opened(digest, s.tenant)
        for handle, existing in s.namespaces.items():
            if existing is ns:
                return handle, ns
        handle = len(s.namespaces) + 1
        s.namespaces[handle] = ns
        return handle, ns

    def namespace(self, s: Session, handle: int) -> Namespace:
        try:
            return s.namespaces[handle]
        except KeyError:
            raise UnknownNamespace(
                f"namespace handle {handle} is not open in session {s.id.hex()}; call "
                f"OpenNamespace first"
            ) from None

    def close_session(self, s: Session) -> None:
        """End ``s`` now: its allocations (slots freed), leases and quarantined slots; then
        the ``on_session_end`` hooks. Callers check :meth:`closable` first (the reaper,
        :meth:`disconnect`) or own a session no client has used yet (an abandoned
        Connect). Idempotent."""
        if self.sessions.get(s.id) is not s:
            return
        s.ending = True
        for a in list(s.allocations.values()):
            self.drop_allocation(a)
        for lease in list(s.leases.values()):
            self.end_lease(lease, valid=False)
        self.sessions.pop(s.id, None)
        self.mapped.pop(s.id, None)
        self.release_quarantine(s.id)
        for hook in self.on_session_end:
            try:
                hook(s)
            except Exception:
                log.exception("ending session %s: a session-end hook failed", s.id.hex())

    def closable(self, s: Session) -> bool:
        """Whether ``s`` can end now: no shared-memory connection open (its client could
        still write the slabs it mapped) and no allocation being written or committed."""
        return self.mapped.get(s.id, 0) <= 0 and not any(a.done for a in s.allocations.values())

    def disconnect(self, s: Session, counters: Counter[str]) -> bool:
        """The client ends ``s`` (Disconnect): it is no longer live at once, and ends now
        if :meth:`closable`, else as soon as it is (its last shared-memory connection
        closing, or the reaper's next pass). Returns whether it ended now."""
        if s.ending or s.id not in self.sessions:
            return False
        s.ending = True
        counters["sessions_disconnected"] += 1
        if not self.closable(s):
            return False
        self.close_session(s)
        return True

    # -- holds (the client's liveness: see the module doc) ----------------------------
    def hold_opened(self, s: Session) -> None:
        """A Hold call of ``s`` opened: the session is not orphaned while one is open (and
        is held from now on, whatever its Connect said)."""
        s.held_by_client = True
        s.holds += 1

    def hold_ended(self, s: Session) -> None:
        """A Hold call of ``s`` ended; with its last, the orphan clock starts."""
        s.holds = max(0, s.holds - 1)
        if s.holds == 0:
            s.orphan_since = time.monotonic()

    def held_sessions(self) -> int:
        """Sessions with a Hold call open now."""
        return sum(1 for s in self.sessions.values() if s.holds > 0)

    # -- shared-memory mappings and the quarantine -------------------------------------
    def shm_attached(self, session_id: bytes) -> None:
        """A shared-memory connection of ``session_id`` opened: its client can map slabs."""
        self.mapped[session_id] += 1

    def shm_detached(self, session_id: bytes) -> None:
        """A shared-memory connection of ``session_id`` closed; with its last one, the
        slots quarantined for the session go back to the free pool."""
        self.mapped[session_id] -= 1
        if self.mapped[session_id] <= 0:
            del self.mapped[session_id]
            self.release_quarantine(session_id)
            s = self.sessions.get(session_id)
            if s is not None and s.ending and self.closable(s):
                self.close_session(s)  # disconnected while this connection was open

    def release_quarantine(self, session_id: bytes) -> None:
        """Free the slots held back from ``session_id``'s expired allocations."""
        for ref in self.quarantine.pop(session_id, []):
            self._dram.free(ref)

    def quarantined_slots(self) -> int:
        """How many DRAM slots are held back from stale shared-memory writers."""
        return sum(len(v) for v in self.quarantine.values())

    # -- grants -------------------------------------------------------------------------
    def grant_ended(self, grant_id: bytes) -> None:
        """An allocation or lease ended: transports revoke the client's access to its
        slots (RDMA memory windows) before the slots can be freed or reused."""
        for hook in self.on_grant_end:
            try:
                hook(grant_id)
            except Exception:
                log.exception("revoking access to grant %s failed", grant_id.hex())

    def add_allocation(self, s: Session, a: Allocation) -> None:
        self.allocations[a.id] = a
        s.allocations[a.id] = a

    def allocation(self, s: Session, allocation_id: bytes) -> Allocation:
        a = s.allocations.get(allocation_id)
        if a is None:
            raise Expired(
                f"allocation {allocation_id.hex()} is unknown or expired (allocations live "
                f"{self.cfg.service.allocation_ttl_s:g} s); allocate again and rewrite"
            )
        return a

    @contextlib.contextmanager
    def held(self, a: Allocation) -> Iterator[None]:
        """While in this block the reaper leaves ``a`` alone (its slots are being written
        or checksummed), even past its expiry; afterwards it is as before."""
        done = a.done
        a.done = True
        try:
            yield
        finally:
            a.done = done

    def forget_allocation(self, a: Allocation) -> None:
        """Retire ``a`` (its slots now belong to the caller)."""
        self.grant_ended(a.id)
        self.allocations.pop(a.id, None)
        sess = self.sessions.get(a.session_id)
        if sess is not None:
            sess.allocations.pop(a.id, None)

    def drop_allocation(self, a: Allocation) -> None:
        """Retire ``a`` and return its slots."""
        self.forget_allocation(a)
        for ref in a.slots:
            self._dram.free(ref)
        a.slots = []

    def add_lease(self, s: Session, lease: Lease) -> None:
        self.leases[lease.id] = lease
        s.leases[lease.id] = lease

    def lease(self, s: Session, lease_id: bytes) -> Lease:
        lease = s.leases.get(lease_id)
        if lease is None or not lease.valid or time.monotonic() > lease.expires:
            raise Expired(
                f"lease {lease_id.hex()} is unknown or expired (leases live "
                f"{self.cfg.service.lease_ttl_s:g} s); acquire again"
            )
        return lease

    def release(self, s: Session, lease_ids: Sequence[bytes]) -> list[bool]:
        out = []
        for lid in lease_ids:
            lease = s.leases.get(lid)
            if lease is None:
                out.append(False)  # expired (and already unpinned) or never existed
                continue
            out.append(lease.valid and time.monotonic() <= lease.expires)
            self.end_lease(lease, valid=False)
        return out

    def end_lease(self, lease: Lease, valid: bool) -> None:
        """End ``lease``: revoke access, then unpin its blocks."""
        self.grant_ended(lease.id)
        lease.valid = valid
        self.leases.pop(lease.id, None)
        sess = self.sessions.get(lease.session_id)
        if sess is not None:
            sess.leases.pop(lease.id, None)
        for b in lease.blocks:
            self._unpin(b)
        lease.blocks = []

    def expire(self, counters: Counter[str], now: float) -> None:
        """End every allocation (not held) and lease past its expiry; count them.

        An expired allocation of a session with a shared-memory connection open is retired
        but its slots are quarantined (counted in ``stale_allocations``), not freed: the
        client can still write them through its mapping."""
        for a in [a for a in self.allocations.values() if a.expires < now and not a.done]:
            counters["expired_allocations"] += 1
            if a.session_id in self.sessions and self.mapped.get(a.session_id, 0) > 0:
                counters["stale_allocations"] += 1
                log.warning("allocation %s of session %s expired while its client maps "
                            "shared memory: %d slots held back until the session's "
                            "shared-memory connection closes", a.id.hex(), a.session_id.hex(),
                            len(a.slots))
                self.forget_allocation(a)
                self.quarantine.setdefault(a.session_id, []).extend(a.slots)
                a.slots = []
            else:
                self.drop_allocation(a)
        for lease in [lease for lease in self.leases.values() if lease.expires < now]:
            counters["expired_leases"] += 1
            self.end_lease(lease, valid=False)
        self.reap_sessions(counters, now)

    def reap_sessions(self, counters: Counter[str], now: float) -> None:
        """End every session that is disconnected, orphaned (its client held it and no Hold
        call has been open for ``service.session_orphan_s``) or idle for
        ``service.session_idle_s``, once :meth:`closable`; count each by its reason."""
        idle_s = self.cfg.service.session_idle_s
        orphan_s = self.cfg.service.session_orphan_s
        for s in list(self.sessions.values()):
            if s.ending:
                reason = ""  # counted when Disconnect came
            elif now - s.last_used > idle_s:
                reason = "idle"
            elif s.held_by_client and s.holds == 0 and now - s.orphan_since > orphan_s:
                reason = "orphaned"
            else:
                continue
            if not self.closable(s):
                continue
            if reason == "idle":
                log.info("session %s of tenant %r idle for %.0f s: closed with its %d "
                         "allocations and %d leases", s.id.hex(), s.tenant, now - s.last_used,
                         len(s.allocations), len(s.leases))
                counters["idle_sessions_closed"] += 1
            elif reason == "orphaned":
                log.info("session %s of tenant %r (client %r) orphaned: no Hold call open for "
                         "%.1f s (its client went away); closed with its %d allocations and "
                         "%d leases", s.id.hex(), s.tenant, s.client_name,
                         now - s.orphan_since, len(s.allocations), len(s.leases))
                counters["orphaned_sessions_closed"] += 1
            self.close_session(s)
