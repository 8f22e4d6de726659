"""Refusal log lines are throttled per site, and the next line says how many were left out
(a hostile client must not be able to fill the log with one line per refusal)."""

from __future__ import annotations

import logging

import pytest

from ctxmem_dpu.logthrottle import LogThrottle, throttled


def test_a_flood_logs_a_burst_then_says_how_many_were_left_out(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    th = LogThrottle(burst=3, interval_s=10.0, clock=lambda: now[0])
    log = logging.getLogger("ctxmem_dpu.test_throttle")
    with caplog.at_level(logging.WARNING, logger=log.name):
        for i in range(1000):
            throttled(log, logging.WARNING, "tcp.refused", "refused %d", i, throttle=th)
        throttled(log, logging.WARNING, "other.site", "another site", throttle=th)
        now[0] = 10.5  # a quiet window later
        throttled(log, logging.WARNING, "tcp.refused", "refused again", throttle=th)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused 0", "refused 1", "refused 2", "another site",
                     "refused again (997 similar lines left out)"]
