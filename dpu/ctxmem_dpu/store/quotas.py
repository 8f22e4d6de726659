"""Per-tenant quotas and fair eviction (issue 12; docs/security.md, "Quotas and fair
eviction").

Why: tenants share one DRAM tier and one flash tier. Without limits one tenant can take
every DRAM slab, pin a block in each (a slab with one held slot can never be handed to
another namespace), or flood puts until every other tenant's blocks are evicted
(invariant 3: no tenant can starve another).

What is counted, and in what unit:

* DRAM in *slabs*: a slab belongs to one namespace (``ctxmem_dpu.blocks.slab_owner``), so
  a tenant's real footprint is the slabs its namespaces own, however full they are.
* flash in *bytes* (slot sizes of the tenant's blocks with a flash copy).
* *held* slabs: slabs in which the tenant has a leased block or an allocated slot; those
  slabs cannot be emptied, so they are capped apart from the footprint.
* grants (open leases, open allocations), sessions and namespaces by count.

Each tenant has a guaranteed share and a ceiling per tier (``quotas.tenants.NAME`` or
``quotas.default``). A guaranteed share of 0 (the default) is the *fair share*: the tier
divided by the number of tenants with an open session, so a config without quotas still
isolates tenants, and a tenant alone may use the whole tier. Eviction takes victims only
from tenants above their guaranteed share (the requester's own first); a tenant at or
under its guarantee loses nothing to another tenant's puts.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from ctxmem_common.config import TenantQuota
from ctxmem_common.errors import ConfigError, ResourceExhausted
from ctxmem_common.identity import check_identity_mode, tenant_scope
from ctxmem_dpu.blocks import Block, slab_owner
from ctxmem_dpu.store.ns_tenants import NamespaceTenants
from ctxmem_dpu.tiers.dram import owner_tenant

if TYPE_CHECKING:
    from ctxmem_dpu.blocks import Namespace, Session, SessionTables
    from ctxmem_dpu.store.context import StoreContext
    from ctxmem_dpu.store.index import BlockIndex

log = logging.getLogger("ctxmem_dpu.store")

#: Label under which tenants past ``quotas.stats_tenants`` are summed (bounded metrics).
OTHER = "_other"
#: Tenant of blocks whose namespace was not opened since the service started (found on
#: flash at rebuild) and whose tenant the namespace tenants file does not name
#: (:mod:`.ns_tenants`): it has no guarantee, so those blocks are the first victims.
UNKNOWN = ""


class Quotas:
    """Accounting per tenant, the checks that refuse a request over a limit, and the
    eviction filters that keep each tenant's guaranteed share."""

    def __init__(self, ctx: StoreContext, index: BlockIndex, tables: SessionTables) -> None:
        self._ctx = ctx
        self._index = index
        # The session registry's tables (it mutates them; the counts here read them).
        self._tables = tables
        self._qcfg = ctx.cfg.quotas
        # Bounded label per tenant name for stats: the first ``stats_tenants`` seen keep
        # their name, later ones share OTHER (a client cannot grow /metrics unbounded).
        self._labels: dict[str, str] = {}
        #: (label, counter) -> value: evictions_dram, evictions_flash, refusals.
        self.counters: Counter[tuple[str, str]] = Counter()
        # Flash bytes per tenant while a flash eviction walks (see flash_victims).
        self._flash_use: Counter[str] = Counter()
        # The tenant of each namespace, kept across restarts: blocks recovered from flash
        # are charged to their tenant before a session opens their namespace again. In
        # memory only until :meth:`load_ns_tenants` names its file.
        self._ns_tenants = NamespaceTenants(None)
        # Insecure mode (tenant names trusted, not authenticated): live names are capped.
        try:
            self._insecure = check_identity_mode(ctx.cfg) == "insecure"
        except ConfigError:  # no valid mode: the service refuses to start anyway
            self._insecure = False

    # -- who is who ---------------------------------------------------------------------
    def quota(self, tenant: str) -> TenantQuota:
        """The configured limits of ``tenant``."""
        return self._qcfg.of(tenant)

    def tenant_of(self, b: Block) -> str:
        """The tenant owning ``b``: its namespace's, or the one the namespace tenants file
        names for a namespace not opened since the start; UNKNOWN when neither knows."""
        ns = self._tables.namespaces.get(b.ns)
        if ns is not None:
            return ns.tenant
        return self._ns_tenants.known.get(b.ns, UNKNOWN)

    def namespace_opened(self, digest: bytes, tenant: str) -> None:
        """A namespace was opened for the first time since the start: remember its tenant
        across restarts (:mod:`.ns_tenants`)."""
        self._ns_tenants.record(digest, tenant)

    def load_ns_tenants(self, path: str | None, keep: Iterable[bytes]) -> None:
        """Read the namespace tenants file at ``path`` (None: none is kept), keeping the
        namespaces in ``keep``; from now on namespaces opened are appended to it.

        Called once, by ``BlockStore.start`` after the index rebuild: the file lies next
        to the first local flash file (``ns_tenants.default_path``, known once the
        devices are open), and the namespaces to keep are those with blocks after the
        rebuild. Before that, tenants are remembered in memory only."""
        tenants = NamespaceTenants(path)
        tenants.load(keep)
        self._ns_tenants = tenants

    def active_tenants(self) -> set[str]:
        """Tenants with an open session: the ones a fair share is divided among."""
        return {s.tenant for s in self._tables.sessions.values()}

    def label(self, tenant: str) -> str:
        """``tenant``'s name in stats, or OTHER once ``quotas.stats_tenants`` are named."""
        lab = self._labels.get(tenant)
        if lab is None:
            lab = tenant if len(self._labels) < self._qcfg.stats_tenants else OTHER
            if lab != OTHER:
                self._labels[tenant] = lab
        return lab

    def count(self, tenant: str, what: str, n: int = 1) -> None:
        """Add ``n`` to the per-tenant counter ``what``."""
        self.counters[(self.label(tenant), what)] += n

    def refuse(self, tenant: str, resource: str, message: str) -> ResourceExhausted:
        """A RESOURCE_EXHAUSTED for ``tenant`` over ``resource`` (counted, logged once
        per call at debug level): the caller raises it."""
        self.count(tenant, "refusals")
        self._ctx.counters["quota_refusals"] += 1
        log.debug("quota refusal: tenant %r, %s", tenant, resource)
        return ResourceExhausted(f"tenant {tenant!r}: quota {resource}: {message}")

    # -- DRAM, in slabs -----------------------------------------------------------------
    def dram_slabs(self) -> Counter[str]:
        """Tenant -> DRAM slabs its namespaces own now."""
        out: Counter[str] = Counter()
        dram = self._ctx.dram
        for slab in dram.alloc.slabs:
            if slab.klass is not None:
                owner = slab.klass[0] if isinstance(slab.klass, tuple) else None
                out[owner_tenant(owner) or UNKNOWN] += 1
        return out

    def _share(self, total: int, frac: float, active: set[str], tenant: str) -> int:
        if frac > 0:
            return int(total * frac)
        return total // max(1, len(active | {tenant}))

    def dram_guaranteed(self, tenant: str, active: set[str] | None = None) -> int:
        """Slabs ``tenant`` keeps whatever others put (0 for a tenant with no session and
        no configured share)."""
        active = self.active_tenants() if active is None else active
        q = self.quota(tenant)
        if tenant not in active and not q.dram_guaranteed:
            return 0
        return self._share(self._ctx.dram.num_slabs, q.dram_guaranteed, active, tenant)

    def dram_ceiling(self, tenant: str) -> int:
        """The most slabs ``tenant`` may own."""
        return max(1, int(self._ctx.dram.num_slabs * self.quota(tenant).dram_max))

    def held_cap(self, tenant: str) -> int:
        """The most slabs in which ``tenant`` may hold leased blocks or allocated slots:
        ``dram_held_max`` of the tier, or (0) the tier less the guaranteed shares of the
        other active tenants, so held slots never block another tenant's guarantee."""
        total = self._ctx.dram.num_slabs
        q = self.quota(tenant)
        if q.dram_held_max > 0:
            cap = int(total * q.dram_held_max)
        else:
            active = self.active_tenants() | {tenant}
            cap = total - sum(self.dram_guaranteed(t, active) for t in active if t != tenant)
        return max(1, min(cap, self.dram_ceiling(tenant)))

    def held_slabs(self, tenant: str) -> set[int]:
        """DRAM slabs in which ``tenant`` holds a leased block or an allocated slot."""
        held: set[int] = set()
        for lease in self._tables.leases.values():
            if lease.ns.tenant == tenant:
                held.update(b.dram.slab for b in lease.blocks if b.dram is not None)
        for a in self._tables.allocations.values():
            if a.ns.tenant == tenant:
                held.update(ref.slab for ref in a.slots)
        return held

    def check_held(self, tenant: str, slabs: set[int]) -> None:
        """Refuse a grant that would make ``tenant`` hold slots in more than its cap of
        slabs (``slabs``: the slabs the new grant touches)."""
        cap = self.held_cap(tenant)
        held = self.held_slabs(tenant) | slabs
        if len(held) > cap:
            raise self.refuse(
                tenant, "dram_held_slabs",
                f"leases and allocations would hold slots in {len(held)} DRAM slabs, limit "
                f"{cap}; release leases, commit or abort allocations, or raise "
                f"quotas.*.dram_held_max")

    def fit_lease(self, tenant: str, run: list[Block]) -> int:
        """How many leading blocks of ``run`` (in DRAM) ``tenant`` may lease without
        holding slots in more slabs than its cap; raises when not even the first fits."""
        cap = self.held_cap(tenant)
        if cap >= self._ctx.dram.num_slabs:
            # A cap of every slab is never reached: no scan of the tenant's leases and
            # allocations, nor of the run (≈ 30 µs of a 1,024-block Acquire, more with
            # many leases held).
            return len(run)
        held = self.held_slabs(tenant)
        for i, b in enumerate(run):
            if b.dram is not None and b.dram.slab not in held:
                if len(held) >= cap:
                    if i == 0:
                        raise self.refuse(
                            tenant, "dram_held_slabs",
                            f"leases and allocations already hold slots in {len(held)} "
                            f"DRAM slabs, limit {cap}; release leases, commit or abort "
                            f"allocations, or raise quotas.*.dram_held_max")
                    return i
                held.add(b.dram.slab)
        return len(run)

    def fits_ceiling(self, ns: Namespace, n: int) -> bool:
        """Whether ``n`` more slots of ``ns`` fit without ``ns.tenant`` owning more
        slabs than its ceiling (free slots in the namespace's own slabs first)."""
        dram = self._ctx.dram
        free = dram.alloc.free_slots(dram.klass(slab_owner(ns), ns.slot_size))
        if n <= free:
            return True
        per = max(1, dram.slab_size // ns.slot_size)
        new = math.ceil((n - free) / per)
        return self.dram_slabs()[ns.tenant] + new <= self.dram_ceiling(ns.tenant)

    def dram_victims(self, tenant: str, skip: Callable[[Block], bool]) -> Iterator[Block]:
        """DRAM eviction candidates for a request of ``tenant``: its own blocks first
        when it is at or over its guarantee; then blocks of tenants above their
        guaranteed share (rechecked per block, so a tenant evicted down to its share is
        left alone); its own last when it is under its guarantee. Never a block of
        another tenant at or under its guarantee."""
        lru, alloc = self._index.dram_lru, self._ctx.dram.alloc
        active = self.active_tenants()
        slabs, free_seen = self.dram_slabs(), alloc.free_slabs
        own_first = slabs[tenant] >= self.dram_guaranteed(tenant, active)
        if own_first:
            yield from (b for b in lru.victims(skip) if self.tenant_of(b) == tenant)
        if self.dram_slabs()[tenant] < self.dram_ceiling(tenant):
            for b in lru.victims(skip):
                if alloc.free_slabs != free_seen:  # a slab was released or assigned
                    slabs, free_seen = self.dram_slabs(), alloc.free_slabs
                t = self.tenant_of(b)
                if t != tenant and slabs[t] > self.dram_guaranteed(t, active):
                    yield b
        if not own_first:
            yield from (b for b in lru.victims(skip) if self.tenant_of(b) == tenant)

    # -- flash, in bytes ----------------------------------------------------------------
    def flash_bytes(self) -> Counter[str]:
        """Tenant -> bytes of flash extents its blocks hold (one pass over the flash
        index: called when flash must be freed, and by Stats)."""
        out: Counter[str] = Counter()
        for b in self._index.flash_lru.order():
            out[self.tenant_of(b)] += b.slot_size
        return out

    def flash_guaranteed(self, tenant: str, active: set[str]) -> int:
        """Flash bytes ``tenant`` keeps whatever others put."""
        q = self.quota(tenant)
        if tenant not in active and not q.flash_guaranteed:
            return 0
        return self._share(self._ctx.flash.capacity_bytes(), q.flash_guaranteed, active,
                           tenant)

    def flash_ceiling(self, tenant: str) -> int:
        """The most flash bytes ``tenant``'s blocks may hold."""
        return int(self._ctx.flash.capacity_bytes() * self.quota(tenant).flash_max)

    def flash_victims(self, tenant: str | None, skip: Callable[[Block], bool]
                      ) -> Iterator[Block]:
        """Flash eviction candidates for demoting blocks of ``tenant`` (None: mixed): its
        own first when it is at or over its guaranteed flash share, then blocks of tenants
        above theirs (usage updated as the caller evicts: it calls :meth:`flash_evicted`),
        its own last when it is under its share. A tenant at or over its flash ceiling
        evicts only its own, also when its ceiling is below its guaranteed share
        (``flash_max`` under the fair share; docs/security.md, "Fair eviction")."""
        self._flash_use = self.flash_bytes()
        active = self.active_tenants()
        lru = self._index.flash_lru
        if tenant is not None:
            over = self._flash_use[tenant] >= self.flash_guaranteed(tenant, active)
            if over:
                yield from (b for b in lru.victims(skip) if self.tenant_of(b) == tenant)
            if self._flash_use[tenant] >= self.flash_ceiling(tenant):
                if not over:  # at its ceiling while under its share: its own, only
                    yield from (b for b in lru.victims(skip) if self.tenant_of(b) == tenant)
                return
        for b in lru.victims(skip):
            t = self.tenant_of(b)
            if t != tenant and self._flash_use[t] > self.flash_guaranteed(t, active):
                yield b
        if tenant is not None and not over:
            # Under its guarantee (a tenant alone has the whole tier as its share, and
            # never reaches it: slab headers and partly used slabs): its own LRU blocks
            # go last, as for DRAM, so its puts still make room for themselves.
            yield from (b for b in lru.victims(skip) if self.tenant_of(b) == tenant)

    def flash_evicted(self, b: Block) -> None:
        """``b``'s flash copy was evicted: count it and update the usage being walked."""
        t = self.tenant_of(b)
        self._flash_use[t] -= b.slot_size
        self.count(t, "evictions_flash")

    # -- grants, sessions, namespaces ---------------------------------------------------
    def check_grants(self, s: Session, kind: str) -> None:
        """Refuse a new lease or allocation (``kind``) past the tenant's count."""
        q = self.quota(s.tenant)
        if kind == "leases":
            limit = q.max_leases
            n = sum(1 for x in self._tables.leases.values() if x.ns.tenant == s.tenant)
        else:
            limit = q.max_allocations
            n = sum(1 for x in self._tables.allocations.values()
                    if x.ns.tenant == s.tenant)
        if n >= limit:
            raise self.refuse(s.tenant, f"max_{kind}",
                              f"{n} open {kind}, limit {limit}; end some first")

    def check_session(self, tenant: str) -> None:
        """Refuse a session past the tenant's ``max_sessions`` cap."""
        limit = self.quota(tenant).max_sessions
        # Live sessions only: one being ended (Disconnect) no longer counts.
        n = sum(1 for s in self._tables.sessions.values()
                if s.tenant == tenant and not s.ending)
        if n >= limit:
            raise self.refuse(tenant, "max_sessions",
                              f"{n} open sessions, limit {limit}; close sessions "
                              f"(Client.close ends them; those of a client that went "
                              f"away end after service.session_orphan_s, idle ones of "
                              f"older clients after service.session_idle_s)")

    def check_tenants(self, tenant: str) -> None:
        """In insecure mode, refuse a session under a new tenant name when
        ``service.insecure_max_tenants`` names already have open sessions: the names are
        not authenticated, so without a cap one client could open sessions under
        thousands of them and shrink every tenant's fair share (and guarantee) to nothing.
        A name that already has a session is never refused by this cap. The names are
        counted per local user (``NAME@uidN`` are user N's, ``service.local_users``), so
        another user's names never keep the service's own user (or a third) out."""
        if not self._insecure:
            return
        scope = tenant_scope(tenant)
        live = {t for t in self.active_tenants() if tenant_scope(t) == scope}
        limit = self._ctx.cfg.service.insecure_max_tenants
        if tenant not in live and len(live) >= limit:
            self._ctx.counters["quota_refusals"] += 1
            log.debug("quota refusal: tenant %r, insecure_max_tenants", tenant)
            whose = f"local user {scope}" if scope else "this local user"
            raise ResourceExhausted(
                f"tenant {tenant!r} refused: {len(live)} tenant names of {whose} already "
                f"have open sessions, the limit in insecure mode (service.insecure_max_"
                f"tenants={limit}); tenant names are not authenticated in insecure mode, so their "
                f"number is capped to keep each tenant's fair share: reuse a tenant name "
                f"that has a session, close sessions of names no longer used (idle ones "
                f"end after service.session_idle_s), raise the limit, or authenticate "
                f"tenants (service.tenant_tokens or mutual TLS)")

    def check_namespace(self, s: Session, digest: bytes) -> None:
        """Refuse opening a namespace past the tenant's ``max_namespaces`` cap (counted
        over the namespaces its open sessions have open)."""
        open_ns = {ns.digest for x in self._tables.sessions.values()
                   if x.tenant == s.tenant for ns in x.namespaces.values()}
        limit = self.quota(s.tenant).max_namespaces
        if digest not in open_ns and len(open_ns) >= limit:
            raise self.refuse(s.tenant, "max_namespaces",
                              f"{len(open_ns)} open namespaces, limit {limit}; close "
                              f"sessions that no longer need theirs")

    # -- stats --------------------------------------------------------------------------
    def snapshot(self) -> dict[str, float]:
        """``tenant.LABEL.NAME`` gauges and counters (bounded by ``stats_tenants``)."""
        out: dict[str, float] = {}
        dram = self._ctx.dram
        per: Counter[tuple[str, str]] = Counter()
        for slab in dram.alloc.slabs:
            if slab.klass is not None:
                owner = slab.klass[0] if isinstance(slab.klass, tuple) else None
                t = owner_tenant(owner) or UNKNOWN
                per[(self.label(t), "dram_bytes")] += slab.used * slab.slot_size
                per[(self.label(t), "dram_slabs")] += 1
        for t, n in self.flash_bytes().items():
            per[(self.label(t), "flash_bytes")] += n
        per.update(self.counters)
        for (lab, name), v in per.items():
            out[f"tenant.{lab or '_unknown'}.{name}"] = float(v)
        return out
