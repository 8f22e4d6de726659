"""deploy/ci/spdk-build.sh's cache contract, without building: the cache key follows the
vendored tarballs' contents, a cached prefix is found without rebuilding, and a missing
vendor folder fails with what to do. (The build itself runs in CI's guest stage; the SPDK
guest tests fail when it is missing.)"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "ci" / "spdk-build.sh"
VENDOR = REPO.parent / "shared" / "vendor"
TARBALLS = ("spdk/spdk-3230130e.tar.xz", "isa-l_crypto/isa-l_crypto-2.26-5-gad5aab1.tar.xz")


def print_prefix(vendor: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CTXMEM_VENDOR_DIR=str(vendor), CTXMEM_CACHE=str(cache))
    return subprocess.run(["bash", str(SCRIPT), "--print"], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


def key_of(result: subprocess.CompletedProcess[str]) -> str:
    found = re.search(r"for key ([0-9a-f]{16})", result.stderr)
    assert found, result.stderr
    return found.group(1)


def test_missing_vendor_folder_says_what_to_do(tmp_path: Path) -> None:
    r = print_prefix(tmp_path / "nowhere", tmp_path / "cache")
    assert r.returncode == 2
    assert "CTXMEM_VENDOR_DIR" in r.stderr and "spdk-3230130e.tar.xz" in r.stderr


def test_cache_key_follows_the_tarballs(tmp_path: Path) -> None:
    if not all((VENDOR / t).is_file() for t in TARBALLS):
        pytest.skip(f"the vendored SPDK tarballs are not at {VENDOR} (the folder beside the repo)")
    vendor, cache = tmp_path / "vendor", tmp_path / "cache"
    for t in TARBALLS:
        (vendor / t).parent.mkdir(parents=True, exist_ok=True)
        (vendor / t).symlink_to(VENDOR / t)
    first = print_prefix(vendor, cache)
    assert first.returncode == 1 and first.stdout == ""  # nothing cached: --print builds nothing
    key = key_of(first)
    assert key_of(print_prefix(vendor, cache)) == key  # stable
    (cache / "spdk" / key).mkdir(parents=True)
    (cache / "spdk" / key / ".ok").touch()
    cached = print_prefix(vendor, cache)
    assert cached.returncode == 0 and cached.stdout.strip() == str(cache / "spdk" / key)
    changed = vendor / TARBALLS[1]
    changed.unlink()
    changed.write_bytes((VENDOR / TARBALLS[1]).read_bytes() + b"\0")  # another source
    other = print_prefix(vendor, cache)
    assert other.returncode == 1 and key_of(other) != key
