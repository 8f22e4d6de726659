from __future__ import annotations

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
