"""The clock of one process shifted (``ctxmem chaos pod``, kind ``clock_skew``).

Python imports ``sitecustomize`` at start-up from the first directory on its path that has
one; the campaign starts one node with this directory first on ``PYTHONPATH`` and
``CTXMEM_CHAOS_CLOCK_SKEW_S`` set. Its wall clock (``time.time``, ``time.time_ns``) then
reads that many seconds ahead (negative: behind); its monotonic clocks are unchanged, as
after a wall-clock jump on one host. Code that reads the clock in C (``datetime.now``,
OpenSSL, Redis's own TTLs) is not shifted. Nothing else in this process changes.
"""

import os
import time

_SKEW_S = float(os.environ.get("CTXMEM_CHAOS_CLOCK_SKEW_S", "0") or 0)
if _SKEW_S:
    _time, _time_ns = time.time, time.time_ns
    _SKEW_NS = int(_SKEW_S * 1e9)

    def _skewed_time() -> float:
        return _time() + _SKEW_S

    def _skewed_time_ns() -> int:
        return _time_ns() + _SKEW_NS

    setattr(time, "time", _skewed_time)  # noqa: B010 (assigning to a module function)
    setattr(time, "time_ns", _skewed_time_ns)  # noqa: B010
