"""``service.cpu_affinity``: a real service process, every thread of it, runs on exactly
the CPUs configured (issue 17: the service on cores of its own in the fallback mode)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

import ctxmem
from ctxmem_common.cpuset import format_cpulist, process_affinity
from tests.kit import blocks, model_layout

LAYOUT = model_layout(num_layers=4)


def test_every_thread_of_the_service_runs_on_the_configured_cpu(
        service_factory: Callable[..., Any]) -> None:
    cpu = max(os.sched_getaffinity(0))  # not CPU 0, where the machine has two
    svc = service_factory(service={"cpu_affinity": [cpu]})
    assert svc.proc is not None
    pid = svc.proc.pid
    # Traffic first, so the threads started on demand (executor, I/O) exist too.
    with ctxmem.Client(svc.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        keys = ctxmem.chain_hashes(range(16 * 4), 16)
        data = blocks(len(keys), LAYOUT.block_nbytes, 1)
        assert ns.put(keys, data).stored == 4
        out = [np.zeros_like(d) for d in data]
        assert ns.get(keys, out) == 4
        assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
        threads = process_affinity(pid)
    assert len(threads) > 1, threads  # the check covered more than the main thread
    assert threads == {tid: str(cpu) for tid in threads}
    assert f"pinned to CPUs {cpu}" in svc.log()


def test_without_cpu_affinity_the_service_keeps_the_mask_it_was_started_with(
        service_factory: Callable[..., Any]) -> None:
    svc = service_factory()
    assert svc.proc is not None
    mask = format_cpulist(os.sched_getaffinity(0))
    assert set(process_affinity(svc.proc.pid).values()) == {mask}
    assert "CPU affinity: not pinned" in svc.log()
