"""Block groups: the blocks that together make one token range usable.

A hybrid model's cache of one token range is more than one block: the KV of each layer
group (vLLM's KV cache groups, LMCache's layer groups) and each state pool (Mamba/SSM
state, a sparse-attention indexer: SGLang's v2 pools), each of its own geometry, so each
in a namespace of its own. :class:`NamespaceGroup` names those namespaces (its
*members*) and moves a key's blocks in all of them as one unit:

* :meth:`~NamespaceGroup.put` writes every member's blocks, then commits them in one
  Commit: a key's blocks become visible in every member at once, or in none (a member
  whose block fails its CRC32C keeps the key out of all of them);
* :meth:`~NamespaceGroup.get` and :meth:`~NamespaceGroup.lookup` count a key only when
  every member holds it and (get) every member's block verifies: one member evicted,
  corrupt on flash or (pod) held by a node that died is a miss for the whole key, never
  a part of it.

Group calls go over gRPC (not the shared-memory control fast path); the bytes still move
over the session's data channel. A group of one namespace is that namespace's own calls
(fast path included): a model with one group behaves exactly as without groups.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ctxmem.buffers import DeferredStaged
from ctxmem.namespace import LookupResult, Namespace, PutResult, _lookup_request, _lookup_tiers
from ctxmem.transport.base import Grant
from ctxmem.transport.verified import ReadProgress
from ctxmem_common.errors import CtxmemError, InvalidArgument, Unavailable, UnknownSession
from ctxmem_common.keys import validate_keys
from ctxmem_common.proto import ctxmem_pb2 as pb

if TYPE_CHECKING:
    from ctxmem.client import _Session

__all__ = ["NamespaceGroup"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class NamespaceGroup:
    """The member namespaces of a block group, moved as one unit per key. Created by
    :meth:`Client.open_group`; every member is a namespace of that client and tenant."""

    def __init__(self, members: Sequence[Namespace]) -> None:
        if not members:
            raise InvalidArgument("a block group needs at least one member namespace")
        first = members[0]
        for m in members[1:]:
            if m.client is not first.client or m.tenant != first.tenant:
                raise InvalidArgument(
                    f"block group members must be namespaces of one client and tenant; "
                    f"{m.model_id!r} is of tenant {m.tenant!r}, {first.model_id!r} of "
                    f"{first.tenant!r}")
        if len({id(m) for m in members}) != len(members):
            raise InvalidArgument("a block group names a namespace twice")
        self.members = list(members)
        self.client = first.client

    @property
    def block_nbytes(self) -> list[int]:
        """Each member's block size, in member order."""
        return [m.block_nbytes for m in self.members]

    def _open(self, stale: _Session | None = None) -> _Session:
        s = self.members[0]._open(stale)
        for m in self.members[1:]:
            if m._open(stale) is not s:  # one tenant, one client: one session
                raise CtxmemError("block group members ended up in different sessions")
        return s

    def _retrying(self, op: Callable[[_Session], T]) -> T:
        s = self._open()
        try:
            return op(s)
        except (UnknownSession, Unavailable) as exc:
            log.info("ctxmem: %s; reconnecting and retrying once", exc)
            return op(self._open(stale=s))

    def _handles(self) -> list[int]:
        return [m.handle for m in self.members[1:]]

    def _batch(self, start: int, n: int) -> slice:
        per = max(1, self.client.max_batch_bytes // max(1, sum(self.block_nbytes)))
        return slice(start, min(start + per, n))

    # -- API -------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """How many leading ``keys`` every member holds, and each one's tier (the
        farthest of its members'). Side-effect free."""

        if len(self.members) == 1:
            return self.members[0].lookup(keys)

        def op(s: _Session) -> LookupResult:
            req = _lookup_request(s.id, self.members[0].handle, keys, True)
            req.group_namespace_handles.extend(self._handles())
            r = self.client._rpc("Lookup", req)
            return LookupResult(r.num_hits, _lookup_tiers(r))

        return self._retrying(op)

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Promote every member's flash blocks of ``keys`` ahead of need; returns how many
        blocks were queued, every member's."""
        return sum(m.prefetch(keys) for m in self.members)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Delete ``keys`` in every member (one Delete per member; the first makes the
        key a group miss at once). Returns the blocks these calls deleted: blocks the
        service reclaimed itself meanwhile, once the first member's went, are not
        counted."""
        return sum(m.delete(keys) for m in self.members)

    def put(self, keys: Sequence[bytes], buffers: Sequence[Sequence[Any]]) -> PutResult:
        """Store the group of each key: ``buffers[m][i]`` is member ``m``'s block of
        ``keys[i]`` (exactly that member's ``block_nbytes``). ``stored`` and ``existing``
        count blocks, every member's."""
        validate_keys(keys)
        if len(buffers) == len(self.members) == 1:
            return self.members[0].put(keys, buffers[0])
        if len(buffers) != len(self.members):
            raise InvalidArgument(f"group put got buffers for {len(buffers)} members; the "
                                  f"group has {len(self.members)}")
        for m, bufs in zip(self.members, buffers, strict=True):
            if len(bufs) != len(keys):
                raise InvalidArgument(f"group put: member {m.model_id!r} got {len(bufs)} "
                                      f"buffers for {len(keys)} keys; pass one per key")
        staged = [DeferredStaged(list(b), m.block_nbytes, writable=False)
                  for m, b in zip(self.members, buffers, strict=True)]
        stored = existing = 0
        start = 0
        while start < len(keys):
            sl = self._batch(start, len(keys))
            batch = list(keys[sl.start : sl.stop])
            st, ex = self._retrying(functools.partial(self._put_batch, keys=batch,
                                                      staged=staged, start=sl.start))
            stored += st
            existing += ex
            start = sl.stop
        for st_ in staged:
            st_.check()
        return PutResult(stored, existing)

    def _put_batch(self, s: _Session, keys: list[bytes], staged: list[DeferredStaged],
                   start: int) -> tuple[int, int]:
        rpc = self.client._rpc
        allocs: list[pb.AllocateResponse] = []
        crcs: list[list[int]] = []
        existing = 0

        def abort() -> None:
            if allocs:
                with contextlib.suppress(CtxmemError):
                    rpc("Commit", pb.CommitRequest(
                        session_id=s.id, allocation_id=allocs[0].allocation_id, abort=True,
                        group_allocation_ids=[a.allocation_id for a in allocs[1:]]))

        try:
            for m, st in zip(self.members, staged, strict=True):
                st.prepare()
                a = rpc("Allocate", pb.AllocateRequest(session_id=s.id,
                                                       namespace_handle=m.handle, keys=keys))
                allocs.append(a)
                new = [i for i, e in enumerate(a.exists) if not e]
                existing += len(keys) - len(new)
                every = st.views
                crcs.append(s.channel.write_grant(Grant.allocation(a.allocation_id, a.slots),
                                                  [every[start + i] for i in new]))
        except BaseException:  # a bad buffer, a failed write: nothing is committed
            abort()
            raise
        c = rpc("Commit", pb.CommitRequest(
            session_id=s.id, allocation_id=allocs[0].allocation_id, crc32c=crcs[0],
            group_allocation_ids=[a.allocation_id for a in allocs[1:]],
            group_crc32c=[c for part in crcs[1:] for c in part]))
        return c.committed, existing

    def get(self, keys: Sequence[bytes], buffers: Sequence[Sequence[Any]]) -> int:
        """Fill every member's buffers (``buffers[m][i]``: member ``m``'s block of
        ``keys[i]``) for the longest leading run of ``keys`` whose every member is
        stored and verifies; return its length. A key one member lacks, or whose block in
        one member fails its check, ends the run: a whole miss for that key. Buffers past
        the returned count may hold other members' (verified) bytes of the key that
        ended the run, or zeros; they are not part of the answer."""
        validate_keys(keys)
        if len(buffers) == len(self.members) == 1:
            return self.members[0].get(keys, buffers[0])
        if len(buffers) != len(self.members):
            raise InvalidArgument(f"group get got buffers for {len(buffers)} members; the "
                                  f"group has {len(self.members)}")
        for m, bufs in zip(self.members, buffers, strict=True):
            if len(bufs) != len(keys):
                raise InvalidArgument(f"group get: member {m.model_id!r} got {len(bufs)} "
                                      f"buffers for {len(keys)} keys; pass one per key")
        staged = [DeferredStaged(list(b), m.block_nbytes, writable=True)
                  for m, b in zip(self.members, buffers, strict=True)]
        total = 0
        while total < len(keys):
            sl = self._batch(total, len(keys))
            try:
                batch = list(keys[sl.start : sl.stop])
                n, go_on = self._retrying(functools.partial(
                    self._get_batch, keys=batch, staged=staged, start=sl.start))
            except Unavailable as exc:
                log.warning("ctxmem group get ends after %d keys (a miss from there): %s",
                            total, exc)
                break
            total += n
            if n == 0 or not go_on:
                break
        for st in staged:
            st.check()
            st.finish_get(total)
        return total

    def _get_batch(self, s: _Session, keys: list[bytes], staged: list[DeferredStaged],
                   start: int) -> tuple[int, bool]:
        rpc = self.client._rpc
        verify = self.client.verify_gets
        for st in staged:
            st.prepare()
        a = rpc("Acquire", pb.AcquireRequest(
            session_id=s.id, namespace_handle=self.members[0].handle, keys=keys,
            group_namespace_handles=self._handles()))
        n = a.num_acquired
        grants = [(a.lease_id, list(a.slots), list(a.crc32c))]
        grants += [(x.lease_id, list(x.slots), list(x.crc32c)) for x in a.members]
        if len(grants) != len(self.members) or any(len(g[1]) != n for g in grants):
            rpc("Release", pb.ReleaseRequest(session_id=s.id,
                                             lease_ids=[g[0] for g in grants]))
            raise CtxmemError(f"group Acquire answered {len(grants)} leases for "
                              f"{len(self.members)} members (a service without block "
                              f"groups ignores them): upgrade the service")
        done = n
        failed = False
        try:
            for (lease_id, slots, want), st in zip(grants, staged, strict=True):
                if not n:
                    break
                dst = st.views[start : start + n]
                grant = Grant.of_lease(lease_id, slots, want)
                progress = ReadProgress()
                s.channel.read_grant(grant, dst, verify, progress)
                grant.release()
                if verify:
                    if progress.bad is not None:
                        log.warning("ctxmem: block %d of group lease %s failed its CRC32C; "
                                    "the run ends there (a miss)", progress.bad,
                                    lease_id.hex())
                        failed = True
                    done = min(done, progress.done)
        finally:
            valid = rpc("Release", pb.ReleaseRequest(
                session_id=s.id, lease_ids=[g[0] for g in grants])).valid
        if not verify and s.channel.maps_slots and not all(valid):
            log.warning("ctxmem: a group lease expired during an unverified copy; "
                        "treating as a miss")
            return 0, False
        return done, not failed
