"""Fixtures shared by the whole suite.

``service_factory`` starts the REAL service (``python -m ctxmem_dpu serve``) as a
subprocess on loopback with its own config, flash file and key file under ``tmp_path``,
and stops it after the test. Nothing here is a mock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ctxmem_tools.launcher import ServiceProcess, local_config

REPO = Path(__file__).resolve().parent.parent


class ServiceHandle(ServiceProcess):
    """The test view of a running service: adds ``stats()``."""

    def metrics_url_for(self, path: str) -> str:
        return f"http://{self.metrics_listen}{path}"

    def stats(self) -> dict[str, float]:
        import ctxmem

        with ctxmem.Client(self.endpoint) as c:
            return c.stats()


@pytest.fixture
def service_factory(tmp_path: Path) -> Iterator[Callable[..., ServiceHandle]]:
    handles: list[ServiceHandle] = []

    def factory(**overrides: Any) -> ServiceHandle:
        workdir = tmp_path / f"svc{len(handles)}"
        h = ServiceHandle(workdir, local_config(workdir, **overrides))
        handles.append(h)
        return h

    yield factory
    for h in handles:
        h.stop()


@pytest.fixture
def service(service_factory: Callable[..., ServiceHandle]) -> ServiceHandle:
    return service_factory()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Any]:
    """A real ``redis-server`` on a free loopback port with a password (no persistence)."""
    from ctxmem_tools.redis_server import RedisServer

    with RedisServer(tmp_path / "redis") as r:
        yield r
