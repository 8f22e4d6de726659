"""Bounds every listener keeps before a connection is authenticated (docs/security.md).

A connection is *unauthenticated* from accept until its hello (or, on the metrics port,
its request head) has arrived and checked out; only then may it hold anything for long.
:class:`Unauthenticated` counts those connections per listener, in total and per
source (a peer IP; "local" for a Unix socket), and when a cap is reached it closes the
OLDEST unauthenticated connection to make room (of that source for the per-source cap,
of any for the total): a flood of connections that never say hello then only churns
among itself, while a client that sends its hello at once (a tenant, a health probe,
even one sharing 127.0.0.1 with the flood) is through before it could be the oldest.
Each listener also has a deadline for the whole handshake (TLS and hello), so nothing
unauthenticated lives longer than that.

:class:`FdReserve` keeps file descriptors for the authenticated: while fewer than
``reserve`` descriptors are free under the process's ``RLIMIT_NOFILE`` (which
:func:`raise_nofile_limit` lifts to its hard limit at start), a listener admits a new
unauthenticated connection only by closing its oldest one, and refuses it (closes it at
once) when it has none.
"""

from __future__ import annotations

import logging
import os
import resource
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

from ctxmem_dpu.logthrottle import throttled

__all__ = ["FdReserve", "Ticket", "Unauthenticated", "raise_nofile_limit"]

log = logging.getLogger(__name__)


def raise_nofile_limit() -> tuple[int, int]:
    """Lift the soft ``RLIMIT_NOFILE`` to the hard limit; returns (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError) as exc:
            log.warning("could not raise the open-files limit from %d to %d (%s); the "
                        "listeners' fd reserve is counted against %d", soft, hard, exc, soft)
    return soft, hard


class FdReserve:
    """Whether free file descriptors have fallen below ``reserve``.

    Counts ``/proc/self/fd`` at most every ``recount_s`` (an accept flood does not pay a
    directory listing per connection); without ``/proc`` it never reports low."""

    def __init__(self, reserve: int, recount_s: float = 0.05) -> None:
        self.reserve = reserve
        self._recount_s = recount_s
        self._lock = threading.Lock()
        self._at = 0.0
        self._free = 1 << 30

    def free(self) -> int:
        now = time.monotonic()
        with self._lock:
            if now - self._at >= self._recount_s:
                self._at = now
                try:
                    used = len(os.listdir("/proc/self/fd"))
                except OSError:
                    return self._free
                soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
                self._free = (1 << 30) if soft == resource.RLIM_INFINITY else soft - used
            return self._free

    def low(self, share: float = 1.0) -> bool:
        """Whether fewer than ``share`` of the reserve are free (the metrics endpoint
        uses a quarter: probes still get fds after the data listeners stop admitting)."""
        return self.reserve > 0 and self.free() < self.reserve * share


class Ticket:
    """One unauthenticated connection's place; :meth:`done` gives it back (idempotent)."""

    __slots__ = ("_close", "_owner", "source")

    def __init__(self, owner: Unauthenticated, source: str, close: Callable[[], None]) -> None:
        self._owner = owner
        self.source = source
        self._close = close

    def done(self) -> None:
        self._owner._release(self)


class Unauthenticated:
    """The unauthenticated connections of one listener, capped in total and per source.

    :meth:`admit` returns a :class:`Ticket` (the connection may proceed; call
    ``ticket.done()`` once it is authenticated or closed), or None when the connection
    must be closed at once (fds below the reserve). Over a cap, the oldest
    unauthenticated connection (of the same source for ``per_source``) is closed through
    the ``close`` callback it was admitted with. Thread-safe (the metrics endpoint
    admits from its accept thread)."""

    def __init__(self, name: str, cap: int, per_source: int,
                 fds: FdReserve | None = None, reserve_share: float = 1.0) -> None:
        self.name = name  # for the log: "TCP data", "metrics", ...
        self.cap = max(1, cap)
        self.per_source = max(1, min(per_source, self.cap))
        self.fds = fds
        self.reserve_share = reserve_share
        self._lock = threading.Lock()
        self._order: OrderedDict[Ticket, None] = OrderedDict()
        self._per_source: Counter[str] = Counter()
        self.evicted = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self._order)

    def admit(self, source: str, close: Callable[[], None]) -> Ticket | None:
        fds_low = self.fds is not None and self.fds.low(self.reserve_share)
        if fds_low and not self._order:
            self.refused += 1
            throttled(log, logging.WARNING, f"{self.name}.fd_reserve",
                      "%s connection from %s refused before authentication: fewer than %d "
                      "file descriptors free (kept for authenticated clients); raise the "
                      "open-files limit (LimitNOFILE) or lower the listeners' caps",
                      self.name, source, self.fds.reserve if self.fds else 0)
            return None
        victims: list[Ticket] = []
        reason = ""
        with self._lock:
            if fds_low and self._order:  # no fd to spare: the oldest one makes room
                victims.append(next(iter(self._order)))
                reason = "fewer file descriptors free than service.fd_reserve"
            elif self._per_source[source] >= self.per_source:
                victims.append(next(t for t in self._order if t.source == source))
                reason = f"{self.per_source} unauthenticated from that source"
            elif len(self._order) >= self.cap:
                victims.append(next(iter(self._order)))
                reason = f"{self.cap} unauthenticated connections open"
            for v in victims:
                self._drop(v)
            t = Ticket(self, source, close)
            self._order[t] = None
            self._per_source[source] += 1
        for v in victims:
            self.evicted += 1
            throttled(log, logging.WARNING, f"{self.name}.evicted",
                      "%s connection from %s closed before authentication: %s (oldest "
                      "unauthenticated one closed to admit a new one)", self.name, v.source,
                      reason)
            try:
                v._close()
            except Exception:  # closing a socket that is already gone
                log.debug("closing an evicted %s connection failed", self.name,
                          exc_info=True)
        return t

    def _drop(self, t: Ticket) -> None:
        if self._order.pop(t, 0) is None:
            self._per_source[t.source] -= 1
            if self._per_source[t.source] <= 0:
                del self._per_source[t.source]

    def _release(self, t: Ticket) -> None:
        with self._lock:
            self._drop(t)
