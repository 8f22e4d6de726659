from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from ctxmem_tools.pod_launcher import LocalPod
from tests.pod.podtest import Clients


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[LocalPod]:
    """Redis and three real service processes on loopback."""
    with LocalPod(tmp_path / "pod", 3) as p:
        yield p


@pytest.fixture
def clients() -> Iterator[Clients]:
    c = Clients()
    yield c
    c.close()


@pytest.fixture(params=["redis-server", "valkey-server"])
def index_exe(request: pytest.FixtureRequest) -> str:
    """The index server the test runs against: Debian's redis-server, and Valkey (wire
    compatible; Debian 12 has valkey-server in bookworm-backports, which deploy/setup.sh
    installs through deploy/ci/valkey.sh). Valkey missing is a skip that says so (a
    failure under CTXMEM_REQUIRE_VALKEY=1, which CI sets); redis-server missing fails."""
    exe: str = request.param
    if exe == "valkey-server" and shutil.which(exe) is None:
        if os.environ.get("CTXMEM_REQUIRE_VALKEY") == "1":  # CI (deploy/setup.sh) found it
            pytest.fail("CTXMEM_REQUIRE_VALKEY=1 but valkey-server is not on PATH")
        pytest.skip("valkey-server not installed: on Debian 12 it is in bookworm-backports "
                    "(PATH=$(bash deploy/ci/valkey.sh):$PATH fetches it)")
    return exe
