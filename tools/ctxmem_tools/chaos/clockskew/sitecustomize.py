"""The clock of one process shifted (``ctxmem chaos pod``, kind ``clock_skew``).

Python imports ``sitecustomize`` at start-up from the first directory on its path that has
one; the campaign starts one node with this directory first on ``PYTHONPATH`` and
``CTXMEM_CHAOS_CLOCK_SKEW_S`` set. Its wall clock (``time.time``, ``time.time_ns``) then
reads that many seconds ahead (negative: behind); its monotonic clocks are unchanged, as
after a wall-clock jump on one host. Code that reads the clock in C (``datetime.now``,
OpenSSL, Redis's own TTLs) is not shifted. Nothing else in this process changes.

One exception keeps the emulation faithful: gRPC's asyncio server computes a call's
``time_remaining()`` as a deadline read from C's clock minus Python's ``time.time()``. On a
host whose clock really is off both read the same clock; shifting only Python's made every
call with a deadline look expired ahead of time (a shifted-ahead node refused every Connect
as "the caller's deadline passed": 98.5% of the put blocks a pod campaign counted as
refused). gRPC's extension module is given the unshifted clock.
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

    import types

    try:
        from grpc._cython import cygrpc
    except ImportError:  # no gRPC in this process: nothing to keep consistent
        pass
    else:
        _unshifted = types.ModuleType("time")
        _unshifted.__dict__.update(vars(time))
        _unshifted.time, _unshifted.time_ns = _time, _time_ns  # type: ignore[attr-defined]
        setattr(cygrpc, "time", _unshifted)  # noqa: B010
