"""Refusal log lines, throttled per site: a hostile client can make the service refuse
thousands of requests a second, and one WARNING line each would let it fill the disk and
bury everything else in the log. Each site logs at most ``burst`` lines per
``interval_s``; the first line after a quiet window says how many were left out."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["LogThrottle", "throttled"]


class LogThrottle:
    """At most ``burst`` lines per ``interval_s`` for each site name (thread-safe: the
    metrics endpoint logs from its own threads)."""

    def __init__(self, burst: int = 50, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst = burst
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._sites: dict[str, list[float]] = {}  # site -> [window start, logged, dropped]

    def allow(self, site: str) -> tuple[bool, int]:
        """Whether a line of ``site`` may be logged now, and how many of its lines were
        left out since the last one logged (to be said in this one)."""
        now = self._clock()
        with self._lock:
            st = self._sites.get(site)
            if st is None or now - st[0] >= self.interval_s:
                dropped = int(st[2]) if st is not None else 0
                self._sites[site] = [now, 1, 0]
                return True, dropped
            if st[1] < self.burst:
                st[1] += 1
                return True, 0
            st[2] += 1
            return False, 0


_THROTTLE = LogThrottle()


def throttled(logger: logging.Logger, level: int, site: str, msg: str, *args: Any,
              throttle: LogThrottle | None = None) -> None:
    """``logger.log(level, msg, *args)`` unless ``site`` has logged its share lately; the
    next line that gets through ends with how many were left out."""
    ok, dropped = (throttle or _THROTTLE).allow(site)
    if not ok:
        return
    if dropped:
        msg += f" ({dropped} similar lines left out)"
    logger.log(level, msg, *args)
