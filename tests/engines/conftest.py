"""Fixtures for the engine tests: a tiny Llama built locally with seeded random weights."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_model() -> Any:
    """4 layers, hidden 128, 4 query / 2 KV heads, vocab 1000; float32, eval mode."""
    pytest.importorskip("transformers")
    from ctxmem_tools.models import build_model

    return build_model("tiny", dtype="float32", seed=0, max_positions=4096)


@pytest.fixture(scope="session")
def tiny_model_bf16() -> Any:
    pytest.importorskip("transformers")
    from ctxmem_tools.models import build_model

    return build_model("tiny", dtype="bfloat16", seed=0, max_positions=4096)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """One intra-op thread: on a small shared CI machine, a second thread waits on a busy
    core and makes timings (and the suite) slower and noisier, not faster."""
    try:
        import torch
    except ImportError:  # the pure-Python tests here run without torch
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _no_leaked_prometheus_dir() -> Iterator[None]:
    """LMCache's Prometheus logger sets ``PROMETHEUS_MULTIPROC_DIR`` (a shared
    ``/tmp/lmcache_prometheus``) in this process's environment; every engine process
    started after it would then add its counters to those of all earlier runs. Each test
    gets the environment back as it found it."""
    before = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    yield
    if before is None:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    else:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = before
