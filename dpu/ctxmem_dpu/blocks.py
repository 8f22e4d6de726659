"""Index records: blocks, namespaces, sessions, allocations and leases.

Everything here is plain state owned by the :class:`~ctxmem_dpu.store.BlockStore` and only
mutated on the service's event-loop thread; I/O threads get copies of what they need.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field

from ctxmem_common.layout import KVLayout
from ctxmem_dpu.alloc import SlotRef
from ctxmem_dpu.tiers.flash import Extent


@dataclass(eq=False, slots=True)
class Block:
    """One committed block. ``eq=False``: identity hashing, so policy lists hold it cheaply.

    A block lives in DRAM (``dram``), on flash (``flash``), or both. ``pins`` counts
    leases and in-flight I/O: a pinned block's slots are never evicted or reused.
    ``durable`` means its flash record and header are on stable storage.
    """

    ns: bytes
    key: bytes
    length: int
    slot_size: int
    crc: int
    seq: int
    dram: SlotRef | None = None
    flash: Extent | None = None
    durable: bool = False
    pins: int = 0
    hits: int = 0
    deleted: bool = False
    io: asyncio.Future[None] | None = None
    # Promoted ahead of a get's next Acquire (flash.cold_piece_bytes): that
    # Acquire still counts it a flash hit, as it was before the get began.
    read_ahead: bool = False
    # A copy fetched from another node of a pod: the index entry (packed, as the cluster
    # index held it) it was fetched under. Served only while the index still names that
    # entry; never demoted to flash, published or served to peers (docs/pod.md, "Deletes
    # and re-puts across nodes"). ``None``: this node's own block.
    origin: bytes | None = None
    # A copy not yet read: the source its first Acquire reports, ``"remote"`` (fetched
    # on demand by a get) or ``"remote→dram"`` (pulled ahead by a Prefetch); then "".
    fetched: str = ""


@dataclass(slots=True)
class Namespace:
    """An open namespace: one (tenant, model, layout, tags) cache, named by ``digest``.

    It holds no cipher: a record's cipher depends on the device it lands on too (a device
    that encrypts in hardware gets plaintext), so the store's keyring picks it per record.
    """

    digest: bytes
    tenant: str
    model_id: str
    layout: KVLayout
    tags: dict[str, str]
    block_nbytes: int
    slot_size: int


def slab_owner(ns: Namespace) -> tuple[str, bytes]:
    """The DRAM slab owner of ``ns``'s blocks: the namespace, not just its tenant, so two
    namespaces (e.g. differing only in ``cache_salt``) never share a slab, and the
    shared-memory transport grants a slab's fd only to sessions with that namespace open.
    """
    return (ns.tenant, ns.digest)


@dataclass(eq=False, slots=True)
class Allocation:
    """DRAM slots a client writes before Commit. ``done``: the reaper must leave it alone
    (Commit is checksumming it, or a data-plane server is writing into it)."""

    id: bytes
    session_id: bytes
    ns: Namespace
    keys: list[bytes]
    slots: list[SlotRef]
    expires: float
    done: bool = False


@dataclass(eq=False, slots=True)
class Lease:
    """Pinned blocks a client reads before Release; ``valid`` turns false at expiry."""

    id: bytes
    session_id: bytes
    ns: Namespace
    blocks: list[Block]
    expires: float
    valid: bool = True


@dataclass(eq=False)
class Session:
    """One client connection's state. ``id`` (16 random bytes) names it; ``token``
    authenticates every call after Connect and its data connections. ``last_used``
    (monotonic) is refreshed by every call and data-plane request: a session idle for
    ``service.session_idle_s`` is closed by the reaper. A session whose client said it
    holds (``held_by_client``: Connect's ``hold``) is also closed once it has had no Hold
    call open (``holds``) since ``orphan_since`` (monotonic) for
    ``service.session_orphan_s``. ``ending``: the session is being ended (Disconnect, or
    closed): no call or data connection may use it any more."""

    id: bytes
    tenant: str
    transport: str
    client_name: str
    token: bytes = field(default_factory=lambda: secrets.token_bytes(16))
    namespaces: dict[int, Namespace] = field(default_factory=dict)
    allocations: dict[bytes, Allocation] = field(default_factory=dict)
    leases: dict[bytes, Lease] = field(default_factory=dict)
    last_used: float = field(default_factory=time.monotonic)
    # Mutual TLS: the client certificate (PEM) of the Connect that opened it; the session
    # ends when a rotated client CA no longer trusts it (ctxmem_dpu.tls).
    peer_cert: bytes = b""
    held_by_client: bool = False
    ending: bool = False
    holds: int = 0
    orphan_since: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class SessionTables:
    """Every open session, namespace, allocation and lease of this service instance, by id
    (a namespace by digest). Mutated only by the session registry
    (``ctxmem_dpu.store.sessions``); the quotas (``ctxmem_dpu.store.quotas``) read them to
    count a tenant's grants, so both are built over one instance and neither needs the
    other late."""

    sessions: dict[bytes, Session] = field(default_factory=dict)
    namespaces: dict[bytes, Namespace] = field(default_factory=dict)
    allocations: dict[bytes, Allocation] = field(default_factory=dict)
    leases: dict[bytes, Lease] = field(default_factory=dict)
