"""Shared-memory transport: give same-host clients the memfds of their namespaces' slabs.

The client copies straight into and out of the slots Allocate and Acquire name; the
service only checks, on every MAP, that the region currently belongs to a namespace the
session has open and is of the generation asked for. Bytes never cross this socket.

The socket is shared by clients that do not trust each other, so (issue 12):

* the slab memfds are sealed against resizing (:mod:`ctxmem_dpu.tiers.dram`);
* a reply is never sent with a blocking call: each connection has a bounded queue of MAP
  replies, flushed with non-blocking ``sendmsg`` (SCM_RIGHTS); a client that lets it
  overflow (``service.shm_reply_queue``) or reads nothing of it for
  ``service.shm_reply_deadline_s`` is disconnected, logged and counted
  (``shm_slow_readers``), and every other connection is served meanwhile;
* the control fast path (OP frames: :mod:`ctxmem_dpu.transport.shm_fastpath`) shares
  that queue, so its replies keep their order with MAP replies and the same limits hold;
  queued reply bytes are capped too (:data:`MAX_QUEUED_BYTES`); a malformed OP frame
  (bad op, a body over ``service.shm_op_max_bytes``, a body that does not decode) is
  answered BAD_REQUEST, counted (``shm_ops_refused``) and the connection closed; a body
  that stalls is dropped after ``data_plane.read_timeout_s``;
* staging regions (STAGE_CREATE, STAGE_PUT, STAGE_FREE: :mod:`.shm_staging`,
  :mod:`ctxmem_dpu.store.staging`) are OP frames too; a STAGE_CREATE's answer carries
  the region's memfd (a dup owned by the queued reply, closed once sent or when the
  connection ends, so a client that does not read holds at most its queue's worth);
* with ``service.shm_allowed_uids`` / ``shm_allowed_gids`` set, a peer whose SO_PEERCRED
  uid and gid are in neither list is answered PEER_NOT_ALLOWED at accept and closed
  (``shm_peers_refused``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, NoReturn

from ctxmem_common import safepaths
from ctxmem_common.staging_wire import decode_create_reply
from ctxmem_common.wire import (
    SHM_HELLO,
    SHM_MAP,
    SHM_MAP_REPLY,
    SHM_OP_NAMES,
    SHM_OP_REPLY,
    SHM_OP_STAGE_CREATE,
    SHM_STATUS,
    Status,
)
from ctxmem_dpu.blocks import slab_owner
from ctxmem_dpu.transport.socket_server import Dropped, SocketDataServer, recv_exact

if TYPE_CHECKING:
    from ctxmem_dpu.blocks import Session
    from ctxmem_dpu.store import BlockStore
    from ctxmem_dpu.tiers.dram import DramTier

__all__ = ["ShmServer", "SlowReader"]

log = logging.getLogger(__name__)

_recv_exact = recv_exact  # the name this module always had
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_REFUSED_HELLO_WAIT_S = 1.0  # how long a refused peer's hello is waited for
#: Reply bytes one connection may have queued unread (fast-path answers; a MAP reply is
#: 20 bytes): several of the largest legal answers (~7.6 MB for 262,144 leased blocks).
MAX_QUEUED_BYTES = 64 << 20
_OP_COUNTERS = (*(f"shm_ops_{name}" for name in SHM_OP_NAMES.values()), "shm_ops_refused")


class SlowReader(ConnectionError):
    """A client did not read its MAP replies (queue overflow or deadline): disconnect."""


class _Replies:
    """One connection's MAP replies, sent without ever blocking the event loop.

    A queued reply names its region and generation, not an fd: the fd is looked up when
    the reply is actually sent, and if the slab changed hands meanwhile the client gets
    STALE instead (a slab's fd is never held open for a client that is not reading).
    """

    def __init__(self, conn: socket.socket, dram: DramTier, limit: int,
                 deadline_s: float) -> None:
        self._conn = conn
        self._dram = dram
        self._limit = limit
        self._deadline_s = deadline_s
        # (status, region, generation, None) for a MAP reply; (status, op, 0, body) for a
        # fast-path reply
        self._queue: deque[tuple[int, int, int, bytes | None]] = deque()
        # A queued fast-path reply's fd (a STAGE_CREATE's region, dup'd; closed once sent
        # or when the connection ends), by the reply's identity in the queue.
        self._fds: dict[int, int] = {}
        self._queued_bytes = 0
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()

    def push(self, status: Status, region: int = 0, generation: int = 0) -> None:
        """Queue a MAP reply; SlowReader when ``limit`` replies are already waiting."""
        self._append((status, region, generation, None), 0)

    def push_op(self, status: Status, op: int, body: bytes, fd: int = -1) -> None:
        """Queue a fast-path reply (with ``fd``, which it then owns, sent as SCM_RIGHTS
        with its first byte); SlowReader when ``limit`` replies or
        :data:`MAX_QUEUED_BYTES` are already waiting."""
        item = (int(status), op, 0, body)
        try:
            if self._queued_bytes + len(body) > MAX_QUEUED_BYTES:
                raise SlowReader(f"{self._queued_bytes} bytes of replies unread (at most "
                                 f"{MAX_QUEUED_BYTES} may wait)")
            self._append(item, len(body))
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        if fd >= 0:
            self._fds[id(item)] = fd

    def close_fds(self) -> None:
        """Close the fds of replies never sent (the connection ended)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _append(self, item: tuple[int, int, int, bytes | None], nbytes: int) -> None:
        if len(self._queue) >= self._limit:
            raise SlowReader(f"{len(self._queue)} replies unread "
                             f"(service.shm_reply_queue={self._limit})")
        self._queue.append(item)
        self._queued_bytes += nbytes
        self._drained.clear()
        self._wake.set()

    async def drain(self) -> None:
        """Wait until every queued reply was sent (the caller bounds the wait)."""
        await self._drained.wait()

    def _message(self, status: int, region: int, generation: int, body: bytes | None
                 ) -> tuple[bytes, list[int]]:
        """The reply's bytes and the fd it carries (none unless OK and still current)."""
        if body is not None:  # a fast-path reply: region is the op
            fd = self._fds.get(id(self._queue[0])) if self._queue else None
            return (SHM_OP_REPLY.pack(b"CXSP", status, region, len(body)) + body,
                    [] if fd is None else [fd])
        r = self._dram.regions.get(region) if status == Status.OK else None
        if status == Status.OK and (r is None or r.generation != generation):
            status = Status.STALE  # recycled while the reply waited
        if status != Status.OK or r is None:
            return SHM_MAP_REPLY.pack(b"CXSR", status, 0, 0), []
        return SHM_MAP_REPLY.pack(b"CXSR", Status.OK, r.generation, r.size), [r.fd]

    async def run(self) -> None:
        """Send queued replies until cancelled; SlowReader when none of the pending bytes
        could be sent for ``deadline_s``."""
        loop = asyncio.get_running_loop()
        pending = b""  # the tail of a reply whose first bytes (and fd) are sent
        while True:
            if not pending and not self._queue:
                self._drained.set()
                self._wake.clear()
                await self._wake.wait()  # idle: the client has asked for nothing
                continue
            if not pending:
                # Built at each try: the fd is looked up when it can actually be sent.
                msg, fds = self._message(*self._queue[0])
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                        struct.pack(f"{len(fds)}i", *fds))] if fds else []
                try:
                    sent = self._conn.sendmsg([msg], anc)
                except BlockingIOError:
                    await self._writable(loop)
                    continue
                item = self._queue.popleft()
                body = item[3]
                self._queued_bytes -= len(body) if body is not None else 0
                sent_fd = self._fds.pop(id(item), None)
                if sent_fd is not None:  # the peer has its own copy now
                    os.close(sent_fd)
                pending = msg[sent:]  # the fd went with the first byte
                continue
            try:
                sent = self._conn.send(pending)
            except BlockingIOError:
                await self._writable(loop)
                continue
            pending = pending[sent:]

    async def _writable(self, loop: asyncio.AbstractEventLoop) -> None:
        fd = self._conn.fileno()
        ready: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_writer(fd, wake)
        try:
            await asyncio.wait_for(ready, self._deadline_s)
        except TimeoutError:
            raise SlowReader(f"no MAP reply read for {self._deadline_s:g} s "
                             f"(service.shm_reply_deadline_s)") from None
        finally:
            loop.remove_writer(fd)


class ShmServer(SocketDataServer):
    """Serves MAP requests on the Unix socket at ``path`` (created 0660 at start, removed
    at close)."""

    transport = "shm"
    connection_kind = "shared-memory"
    staging_ops = True

    def __init__(self, store: BlockStore, path: str) -> None:
        super().__init__(store)
        self.path = path
        for name in _OP_COUNTERS:  # reported from the start, like the store's own
            store.counters.setdefault(name, 0)

    @property
    def address(self) -> str:
        return self.path

    def _listen(self) -> socket.socket:
        # Created 0750 (the socket's group must reach the 0660 socket) if absent; refused
        # if another user owns it or anyone else can write it (a planted socket or link).
        safepaths.ensure_dir(os.path.dirname(os.path.abspath(self.path)),
                             safepaths.SOCKET_DIR_MODE, "shm socket directory")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)
            os.chmod(self.path, 0o660)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    def _source(self, conn: socket.socket, addr: Any) -> str:
        """A Unix-socket peer counts against its user (SO_PEERCRED's uid): one local
        user's flood of silent connections evicts only its own."""
        try:
            _pid, uid, _gid = _PEERCRED.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except OSError:
            return "local"
        return f"uid {uid}"

    async def _serve(self, conn: socket.socket) -> None:
        if not await self._peer_allowed(conn):
            return
        s = await self._hello(conn, SHM_HELLO, b"CXS1",
                              lambda status: SHM_STATUS.pack(b"CXSA", status))
        if s is None:
            return
        cfg = self.store.cfg.service
        replies = _Replies(conn, self.store.dram, cfg.shm_reply_queue, cfg.shm_reply_deadline_s)
        # While this connection is open its client may map (and keep writing) the
        # session's slabs: slots of its allocations that expire are quarantined, not
        # reused, until its last connection closes (store.sessions).
        self.store.shm_attached(s)
        reader = asyncio.create_task(self._maps(conn, s, replies))
        writer = asyncio.create_task(replies.run())
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # the error that ended the connection, if any
        except SlowReader as exc:
            self.store.counters["shm_slow_readers"] += 1
            log.warning("shared-memory connection of session %s (tenant %r) closed: %s; a "
                        "client must read each MAP reply before it sends many more",
                        s.id.hex(), s.tenant, exc)
        finally:
            for t in (reader, writer):
                t.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)
            replies.close_fds()
            self.store.shm_detached(s)

    async def _maps(self, conn: socket.socket, s: Session, replies: _Replies) -> None:
        """Read MAP requests and queue their answers (never waits on the client reading)."""
        loop = asyncio.get_running_loop()
        dram = self.store.dram
        while True:
            magic, region, generation = SHM_MAP.unpack(
                await recv_exact(loop, conn, SHM_MAP.size))
            if magic == b"CXSO":  # a fast-path op: op code, body length (SHM_OP)
                await self._op(conn, s, replies, region, generation)
                continue
            if magic != b"CXSM":  # framing is lost: answer and close
                await self._refuse(s, replies, f"bad request magic {magic!r}",
                                   lambda: replies.push(Status.BAD_REQUEST))
            status = Status.OK
            if not 0 <= region < dram.num_slabs:
                status = Status.BAD_REQUEST
            elif self.store.live_session(s.id) is None:
                status = Status.UNAUTHENTICATED
            elif region not in dram.regions or not self._may_map(s, dram.region_owner(region)):
                status = Status.DENIED
            elif dram.generation(region) != generation:
                status = Status.STALE
            replies.push(status, region, generation)

    async def _op(self, conn: socket.socket, s: Session, replies: _Replies, op: int,
                  length: int) -> None:
        """Read one fast-path op's body (within ``read_timeout_s``), run it and queue its
        reply. A malformed frame is answered BAD_REQUEST, and the connection closed."""
        def refuse(reason: str) -> Awaitable[NoReturn]:
            return self._refuse_op(s, replies, op, reason)

        out = await self._run_op(conn, s, op, length, "shm_ops", refuse)
        if out is not None:
            fd = -1
            if op == SHM_OP_STAGE_CREATE and out[0] == Status.OK:
                # The new region's memfd goes with the answer (a dup: the region may be
                # freed before the reply is sent).
                region = decode_create_reply(out[1]).region_id
                fd = os.dup(self.store.staging.regions[region].fd)
            replies.push_op(out[0], op, out[1], fd)

    async def _refuse_op(self, s: Session, replies: _Replies, op: int, reason: str
                         ) -> NoReturn:
        """Answer a malformed op BAD_REQUEST and close (:meth:`_refuse`)."""
        self.store.counters["shm_ops_refused"] += 1
        await self._refuse(s, replies, reason,
                           lambda: replies.push_op(Status.BAD_REQUEST, op, b""))

    async def _refuse(self, s: Session, replies: _Replies, reason: str,
                      answer: Callable[[], None]) -> NoReturn:
        """Queue ``answer``, send what is queued (within ``read_timeout_s``), and close
        the connection: after a malformed frame nothing more is read from it."""
        with contextlib.suppress(SlowReader):
            answer()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(replies.drain(), self.limits.read_timeout_s)
        raise Dropped(f"session {s.id.hex()} (tenant {s.tenant!r}): {reason}; a client must "
                      f"send well-formed requests (ctxmem_common.wire, shm_ops)")

    @staticmethod
    def _may_map(s: Session, owner: object) -> bool:
        """Whether ``s`` has the namespace that owns the slab open (the owner is the
        namespace, so another namespace of the same tenant, e.g. another cache_salt, is
        refused)."""
        return any(slab_owner(ns) == owner for ns in s.namespaces.values())

    async def _peer_allowed(self, conn: socket.socket) -> bool:
        """Check the peer's SO_PEERCRED against service.shm_allowed_uids/gids (both empty:
        allowed). A refused peer gets PEER_NOT_ALLOWED, after its hello is read so the
        status reaches it, and is logged and counted."""
        cfg = self.store.cfg.service
        if not cfg.shm_allowed_uids and not cfg.shm_allowed_gids:
            return True
        pid, uid, gid = _PEERCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        if uid in cfg.shm_allowed_uids or gid in cfg.shm_allowed_gids:
            return True
        self.store.counters["shm_peers_refused"] += 1
        log.warning("shared-memory peer pid %d uid %d gid %d refused: not in "
                    "service.shm_allowed_uids %s nor shm_allowed_gids %s", pid, uid, gid,
                    cfg.shm_allowed_uids, cfg.shm_allowed_gids)
        loop = asyncio.get_running_loop()
        with contextlib.suppress(TimeoutError, OSError):
            await asyncio.wait_for(recv_exact(loop, conn, SHM_HELLO.size),
                                   _REFUSED_HELLO_WAIT_S)
        with contextlib.suppress(TimeoutError, OSError):
            await asyncio.wait_for(
                loop.sock_sendall(conn, SHM_STATUS.pack(b"CXSA", Status.PEER_NOT_ALLOWED)),
                _REFUSED_HELLO_WAIT_S)
        return False

    async def _release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
