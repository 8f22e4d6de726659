"""The contract every data channel meets (shared memory, TCP, RDMA).

:class:`Namespace <ctxmem.namespace.Namespace>` and :class:`~ctxmem.group.Group` move a
batch's bytes through two calls only, whatever the transport: :meth:`DataChannel.write_grant`
(a put's blocks into the slots of an allocation) and :meth:`DataChannel.read_grant` (a
get's blocks out of the slots of a lease), each given a :class:`Grant`: what the service
granted the batch, in the form its answer came in. A transport implements
:meth:`DataChannel._write_grant` and :meth:`DataChannel._read_grant` in its own module, and
says through class attributes what the callers must know of it (:attr:`DataChannel.ops`,
:attr:`DataChannel.packed_slots`, :attr:`DataChannel.maps_slots`); nothing outside its
module names it (docs/architecture.md, "Data channels").
"""

from __future__ import annotations

import abc
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ctxmem.transport.verified import ReadProgress, check_landed
from ctxmem_common.codecs import crc32c
from ctxmem_common.errors import InvalidArgument, Unavailable
from ctxmem_common.packed_slots import PackedSlots, unpack_acquire
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.shm_ops import decode_error, decode_release_reply, encode_release
from ctxmem_common.wire import SHM_OP_NAMES, SHM_OP_RELEASE, Status

#: ``CTXMEM_FAST_OPS=0`` keeps every control call on gRPC, on every channel (A/B runs, an
#: escape hatch); ``CTXMEM_SHM_OPS=0``, its older name, does the same.
FAST_OPS_ENV = "CTXMEM_FAST_OPS"
_FAST_OPS_ENVS = (FAST_OPS_ENV, "CTXMEM_SHM_OPS")


def fast_ops_wanted() -> bool:
    """Whether this process may use the control fast path (neither variable is 0)."""
    return all(os.environ.get(name, "1").strip() != "0" for name in _FAST_OPS_ENVS)


class TransportError(Unavailable):
    """The data channel failed (peer gone, refused, expired); the request can be retried."""


class FastPathUnsupported(Exception):
    """The service does not serve this op on the fast path (pod mode): use gRPC."""


def op_answer(where: str, name: str, status: int, body: bytes) -> bytes:
    """The body of a fast-path answer with ``status``, or the error it carries: the
    service's CtxmemError (same class as over gRPC), :class:`FastPathUnsupported`, or
    InvalidArgument for a status this client does not know. ``where`` names the channel
    ("TCP", "shared-memory") in that last error."""
    if status == Status.OK:
        return body
    if status == Status.ERROR:
        raise decode_error(body)
    if status == Status.UNSUPPORTED:
        raise FastPathUnsupported(name)
    raise InvalidArgument(f"{where} fast path {name}: unexpected status {status}")


@dataclass(eq=False)
class Grant:
    """What the service granted one batch: an allocation (a put: its blocks go into
    ``slots``) or a lease (a get: its blocks come out of ``slots``, each checked against
    ``crcs``), in the form the answer came in: :class:`PackedSlots` (a fast-path answer,
    a packed Acquire) or the ``pb.Slot`` messages of a gRPC answer (RDMA needs their
    addresses and rkeys). TCP names blocks by index and reads neither.

    A grant is used for one batch: once its Commit (or abort) or Release is sent the
    caller marks it :meth:`released`, and every channel refuses it from then on, before
    any byte moves (on shared memory nothing else would: the slots stay mapped)."""

    id: bytes
    """The allocation id (put) or lease id (get)."""
    slots: PackedSlots | Sequence[pb.Slot]
    crcs: Sequence[int] = ()
    """Per block, the CRC32C committed with it (a lease; empty for an allocation)."""
    lease: bool = False
    """A lease (read) rather than an allocation (write)."""
    done = False
    """Set by :meth:`release`: the grant's Commit, abort or Release was sent."""

    @classmethod
    def allocation(cls, allocation_id: bytes, slots: PackedSlots | Sequence[pb.Slot]
                   ) -> Grant:
        """An Allocate's answer (fast path or gRPC) as a grant to write."""
        return cls(allocation_id, slots)

    @classmethod
    def of_lease(cls, lease_id: bytes, slots: PackedSlots | Sequence[pb.Slot],
                 crcs: Sequence[int]) -> Grant:
        """An Acquire's lease (or a group member's) as a grant to read."""
        return cls(lease_id, slots, crcs, lease=True)

    @classmethod
    def of_acquire(cls, a: pb.AcquireResponse, requested: int, block_nbytes: int,
                   packed: bool) -> Grant:
        """A gRPC Acquire's first ``num_acquired`` slots as a grant to read. ``packed``
        (the channel's :attr:`DataChannel.packed_slots`): as :class:`PackedSlots`, read
        and checked by :func:`~ctxmem_common.packed_slots.unpack_acquire` (either form of
        the answer; ValueError names what is malformed); else the ``pb.Slot`` messages."""
        if packed:
            p = unpack_acquire(a, requested, block_nbytes)
            return cls.of_lease(a.lease_id, p, p.crcs)
        n = a.num_acquired
        return cls.of_lease(a.lease_id, a.slots[:n], a.crc32c[:n])

    def __len__(self) -> int:
        return len(self.slots)

    def what(self) -> str:
        """``allocation <hex>`` or ``lease <hex>``, for messages."""
        return f"{'lease' if self.lease else 'allocation'} {self.id.hex()}"

    def release(self) -> None:
        """Mark the grant used up (its Commit, abort or Release was sent)."""
        self.done = True

    def pb_slots(self) -> Sequence[pb.Slot]:
        """The slots as ``pb.Slot`` messages (converted from packed ones if need be)."""
        return self.slots.slots() if isinstance(self.slots, PackedSlots) else self.slots


class DataChannel(abc.ABC):
    """Moves the bytes of one allocation or lease. Blocking; the client runs it on a
    worker thread. ``views`` are flat byte views, one per slot, each ``slot.length`` long.

    The contract the callers use is :meth:`write_grant` and :meth:`read_grant` (and
    :meth:`call` for the control fast path); a transport implements
    :meth:`_write_grant`, :meth:`_read_grant`, :meth:`write`, :meth:`read` and
    :meth:`close`, and overrides :meth:`write_crc` / :meth:`read_verified` where it can
    fuse the CRC32C with its copy."""

    name: str
    ops = False
    """Whether :meth:`call` carries the control fast path on this channel (shared memory
    and TCP, when the service offers it: Health ``shm_ops`` / ``tcp_ops``)."""
    packed_slots = False
    """Whether the channel reads a lease's slots best packed (a gRPC Acquire then asks
    ``want_packed``; :meth:`Grant.of_acquire` unpacks and checks them): shared memory."""
    maps_slots = False
    """Whether the shim copies out of the service's memory itself, with nothing on the
    service's side checking the lease during the copy (shared memory): an unverified get
    (``verify_gets=False``) then counts only if its lease was still valid at Release."""

    def write_grant(self, grant: Grant, views: Sequence[memoryview]) -> list[int]:
        """Write ``views[i]`` into the grant's slot ``i`` (the batch's new blocks) and
        return each view's CRC32C, what Commit carries: fused with the copy where the
        channel can (shared memory), else computed beside it. Refuses (InvalidArgument,
        nothing written) a lease, a released grant, or a view count other than the slot
        count; raises
        TransportError when the channel fails or the answer is malformed."""
        self._check_grant(grant, views, lease=False)
        return self._write_grant(grant, views)

    def read_grant(self, grant: Grant, views: Sequence[memoryview], verify: bool,
                   progress: ReadProgress) -> None:
        """Read the grant's first ``len(views)`` blocks into ``views``; with ``verify``
        each is checked against ``grant.crcs`` and the first that fails is scrubbed and
        ends the read (:mod:`ctxmem.transport.verified`; ``progress.done`` /
        ``progress.bad``, kept up to date also when this raises). Without it the copy is
        unchecked and ``progress`` is left alone. Refuses (InvalidArgument, nothing read)
        an allocation, a released grant, or more views than slots; raises TransportError
        when the channel fails or the answer is malformed."""
        self._check_grant(grant, views, lease=True)
        self._read_grant(grant, views, verify, progress)

    def _check_grant(self, grant: Grant, views: Sequence[memoryview], lease: bool) -> None:
        verb = "read" if lease else "write"
        if grant.lease != lease:
            raise InvalidArgument(
                f"cannot {verb} {grant.what()} on the {self.name} channel: "
                f"{'only a lease is readable' if lease else 'only an allocation is writable'}")
        if grant.done:
            raise InvalidArgument(f"{grant.what()} was already "
                                  f"{'released' if lease else 'committed or aborted'}: it "
                                  f"cannot be used again; ask the service for a new one")
        if len(views) > len(grant) or (not lease and len(views) != len(grant)):
            raise InvalidArgument(f"{len(views)} buffers for the {len(grant)} slots of "
                                  f"{grant.what()}; pass one buffer per slot"
                                  f"{' (or fewer: the leading blocks)' if lease else ''}")

    @abc.abstractmethod
    def _write_grant(self, grant: Grant, views: Sequence[memoryview]) -> list[int]:
        """:meth:`write_grant` once the grant is checked: the transport's own write."""

    @abc.abstractmethod
    def _read_grant(self, grant: Grant, views: Sequence[memoryview], verify: bool,
                    progress: ReadProgress) -> None:
        """:meth:`read_grant` once the grant is checked: the transport's own read."""

    def call(self, op: int, parts: Sequence[bytes], reply: bool = True,
             meanwhile: Callable[[], None] | None = None) -> bytes:
        """Send fast-path op ``op`` (``ctxmem_common.wire.SHM_OP_*``) with body ``parts``
        and return its answer's body (b"" with ``reply`` False: nothing is read). Raises
        the service's error as the same CtxmemError class as over gRPC,
        :class:`FastPathUnsupported`, or Unavailable when the channel fails (it is then
        broken). Only called when :attr:`ops` is true. ``meanwhile`` runs once the
        request is sent and before its answer is read: client work that does not depend
        on the answer, overlapped with the service's (it must not raise; if it does, the
        answer is never read and the channel is broken)."""
        raise FastPathUnsupported(f"the {self.name} channel carries no control fast path")

    _broken = ""
    """Why the channel is unusable ("" while it is fine; the channels with a fast path
    set it when a call fails midway)."""

    # -- the control fast path's call, for the channels that carry one (shm, TCP) -------
    _lock: threading.Lock
    where = ""
    """The channel's kind in error messages ("shared-memory", "TCP")."""
    endpoint = ""
    """Where the channel goes, in error messages (a socket path, host:port)."""

    def _fast_call(self, op: int, parts: Sequence[bytes], reply: bool,
                   meanwhile: Callable[[], None] | None) -> bytes:
        """:meth:`call` on a channel with a fast path: under the channel's lock, refuse a
        broken channel, send the frame (:meth:`_send_op`), run ``meanwhile``, read and
        check the answer (:meth:`_read_answer`); a socket or framing failure breaks the
        channel and raises Unavailable (the client reconnects)."""
        name = SHM_OP_NAMES[op]
        with self._lock:
            if self._broken:
                raise Unavailable(f"{self.where} data channel {self.endpoint} is broken "
                                  f"({self._broken}); reconnecting")
            try:
                self._send_op(op, parts)
                if meanwhile is not None:
                    self._meanwhile(name, meanwhile)
                if not reply:
                    self.unanswered = True
                    return b""
                self.unanswered = False
                status, body = self._read_answer(op, name)
                if status == Status.BAD_REQUEST:  # the service closes the connection
                    raise TransportError(f"the service refused {name} as malformed")
            except (OSError, TransportError) as exc:
                self._broken = f"{name}: {exc}"
                raise Unavailable(f"{self.where} fast path {name} on {self.endpoint} "
                                  f"failed: {exc}; reconnecting") from None
        return op_answer(self.where, name, status, body)

    def _send_op(self, op: int, parts: Sequence[bytes]) -> None:
        """Send one fast-path frame (header, then ``parts``)."""
        raise FastPathUnsupported(f"the {self.name} channel carries no control fast path")

    def _read_answer(self, op: int, name: str) -> tuple[int, bytes]:
        """Read the answer to ``op`` (its status and body); TransportError when it does
        not answer ``op`` or is too long."""
        raise FastPathUnsupported(f"the {self.name} channel carries no control fast path")

    def _meanwhile(self, name: str, meanwhile: Callable[[], None]) -> None:
        """Run a :meth:`call`'s ``meanwhile`` (its request sent, its answer not read). If
        it raises, the answer stays unread in the stream, so the channel is broken."""
        try:
            meanwhile()
        except BaseException:
            self._broken = f"{name}: interrupted before its answer was read"
            raise

    unanswered = False
    """Whether fast-path frames flagged no-reply (a verified get's RELEASE) were sent since
    the last answered call: what they do may not have happened yet."""

    def flush(self) -> None:
        """Wait until the service has served every frame sent flagged no-reply: one
        answered RELEASE of no leases behind them (a connection's frames are served in
        order). The client calls it before a gRPC call of the same session and at close,
        so nothing overtakes a release. Raises Unavailable if the channel fails."""
        if self.unanswered:
            decode_release_reply(self.call(SHM_OP_RELEASE, [encode_release([], False)]), 0)

    @abc.abstractmethod
    def write(self, allocation_id: bytes, slots: Sequence[pb.Slot],
              views: Sequence[memoryview]) -> None: ...

    def write_crc(self, allocation_id: bytes, slots: Sequence[pb.Slot],
                  views: Sequence[memoryview]) -> list[int]:
        """:meth:`write`, returning each view's CRC32C (what Commit carries: the put's
        end-to-end check). This default CRCs the views, then writes them; shared memory
        fuses the CRC with its copy into the slot."""
        crcs = [crc32c(v) for v in views]
        self.write(allocation_id, slots, views)
        return crcs

    @abc.abstractmethod
    def read(self, lease_id: bytes, slots: Sequence[pb.Slot],
             views: Sequence[memoryview]) -> None:
        """Copy each slot into its view, unchecked (what ``verify_gets=False`` uses)."""

    def read_verified(self, lease_id: bytes, slots: Sequence[pb.Slot],
                      views: Sequence[memoryview], crcs: Sequence[int],
                      progress: ReadProgress) -> None:
        """Read each block into its view and check its CRC32C against ``crcs[i]``; stop
        at the first block that fails (recorded in ``progress.bad``; its view is zeroed,
        later views stay untouched). ``progress.done`` counts the blocks delivered so far,
        also when this raises.

        This default reads one block per :meth:`read` call, then CRCs it in place;
        channels override it to fuse the check with their copy (see
        :mod:`ctxmem.transport.verified`)."""
        for i, (slot, dst, want) in enumerate(zip(slots, views, crcs, strict=True)):
            self.read(lease_id, [slot], [dst])
            if not check_landed(dst, crc32c(dst), want):
                progress.bad = i
                return
            progress.done = i + 1

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> DataChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
