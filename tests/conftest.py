"""Fixtures shared by the whole suite.

``service_factory`` starts the REAL service (``python -m ctxmem_dpu serve``) as a
subprocess on loopback with its own config, flash file and key file under ``tmp_path``,
and stops it after the test. Nothing here is a mock.
"""

from __future__ import annotations

import os
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


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[Any]:
    """A real 3-master Redis Cluster on loopback (``RedisClusterServers``), one password."""
    from ctxmem_tools.redis_server import RedisClusterServers

    with RedisClusterServers(tmp_path / "cluster") as c:
        yield c


@pytest.fixture(scope="session")
def spdk_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real ``spdk_tgt`` for the whole session, the DPU's storage stack (QEMU guest).

    Its build comes from ``CTXMEM_SPDK_PREFIX`` (``deploy/ci/spdk-build.sh``; run.sh
    passes it in). Inside the guest a missing build is a failure, not a skip: CI always
    builds it. Callers skip outside the guest themselves.
    """
    from ctxmem_tools.spdk_app import PREFIX_ENV, SpdkApp, spdk_prefix

    if spdk_prefix() is None:
        pytest.fail(f"{PREFIX_ENV}={os.environ.get(PREFIX_ENV, '')!r} holds no bin/spdk_tgt: "
                    "build SPDK with `bash deploy/ci/spdk-build.sh` before tests/vm/run.sh")
    app = SpdkApp(tmp_path_factory.mktemp("spdk"))
    try:
        app.start()
    except RuntimeError as ex:
        pytest.fail(str(ex))
    try:
        yield app
    finally:
        rc = app.stop()
        out = os.environ.get("CTXMEM_VM_OUT")
        if out and app.log_path.exists():
            Path(out, "spdk_tgt.log").write_text(app.log_path.read_text(errors="replace"))
        assert rc in (0, None), f"spdk_tgt exited with status {rc}:\n{app.log()}"
