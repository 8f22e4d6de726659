"""Shared fixtures for the deploy tests: repository paths and the project version."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def deploy_dir() -> Path:
    return DEPLOY


@pytest.fixture(scope="session")
def project_version() -> str:
    # tomllib is 3.11+; the project supports 3.10, and the version line is simple.
    text = (ROOT / "pyproject.toml").read_text()
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]
    match = re.search(r'^version\s*=\s*"([^"]+)"', project, re.M)
    assert match, "no version in [project] of pyproject.toml"
    return match.group(1)
