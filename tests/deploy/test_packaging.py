"""The distribution is ready to publish: ``python -m build`` makes an sdist and a wheel with
no deprecation warning, ``twine check --strict`` passes both, the wheel is one
``cp311-abi3`` wheel for this machine's architecture (Python code plus the native CRC32C
helper built against the limited API: one wheel per architecture serves Python >= 3.11)
named ``ctxmem-kv`` (``ctxmem`` on PyPI is an unrelated project) and installs into an
empty directory from which ``import ctxmem, ctxmem_dpu, ctxmem_common`` work, with the
native helper active. ``CTXMEM_BUILD_NATIVE=0`` (what the arm64 image build on an x86-64
host uses) makes one ``py3-none-any`` wheel without it.

The build runs ``--no-isolation`` (the test environment's setuptools, no download) on a
clean copy of the tree (git-tracked and untracked-not-ignored files, what a clone has), so
it never writes ``build/`` or ``*.egg-info`` into the checkout. About 3 s.
"""

from __future__ import annotations

import email.parser
import os
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DIST_NAME = "ctxmem-kv"
IMPORTS = ("ctxmem", "ctxmem_dpu", "ctxmem_common", "ctxmem_tools")


def copy_tree(dst: Path) -> Path:
    """What a clone of the checkout holds, copied to ``dst``."""
    src = dst / "src"
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        path = ROOT / name
        if path.is_file():  # deleted-but-tracked files are listed too
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name)
    return src


def build(src: Path, out: Path, native: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CTXMEM_BUILD_NATIVE": "1" if native else "0"}
    return subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir",
         str(out), str(src)], capture_output=True, text=True, timeout=300, env=env)


def deprecations(log: str) -> list[str]:
    """The lines of a build log that warn about something deprecated."""
    return [line for line in log.splitlines() if re.search(r"deprecat", line, re.I)]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    if shutil.which("git") is None:
        pytest.fail("git not found: the packaging test copies the tree with git ls-files")
    base = tmp_path_factory.mktemp("pkg")
    proc = build(copy_tree(base), base / "dist")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"python -m build failed:\n{log[-4000:]}"
    return base / "dist", log


def test_build_has_no_deprecation_warning(dist: tuple[Path, str]) -> None:
    _out, log = dist
    assert deprecations(log) == [], "\n".join(deprecations(log))


def test_old_license_table_is_caught(tmp_path: Path) -> None:
    """The check above can fail: the pre-PEP 639 ``license = {text = ...}`` table warns."""
    src = copy_tree(tmp_path)
    pp = src / "pyproject.toml"
    text = pp.read_text()
    assert 'license = "Apache-2.0"' in text
    pp.write_text(text.replace('license = "Apache-2.0"\nlicense-files = ["LICENSE"]',
                               'license = { text = "Apache-2.0" }'))
    proc = build(src, tmp_path / "dist")
    assert any("license" in line for line in deprecations(proc.stdout + proc.stderr))


def test_twine_check_passes(dist: tuple[Path, str]) -> None:
    out, _log = dist
    files = sorted(str(p) for p in out.iterdir())
    assert len(files) == 2, files
    proc = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *files],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASSED") == 2, proc.stdout


NATIVE = "ctxmem_common/codecs/_crc32c_native.abi3.so"


def test_one_abi3_wheel_with_the_native_helper(dist: tuple[Path, str]) -> None:
    out, _log = dist
    wheels = list(out.glob("*.whl"))
    tag = f"cp311-abi3-linux_{platform.machine()}"
    assert [w.name for w in wheels] == [f"ctxmem_kv-0.1.0-{tag}.whl"]
    assert (out / "ctxmem_kv-0.1.0.tar.gz").is_file()
    with zipfile.ZipFile(wheels[0]) as zf:
        names = zf.namelist()
        meta = email.parser.Parser().parsestr(
            zf.read("ctxmem_kv-0.1.0.dist-info/METADATA").decode())
        wheel = zf.read("ctxmem_kv-0.1.0.dist-info/WHEEL").decode()
        eps = zf.read("ctxmem_kv-0.1.0.dist-info/entry_points.txt").decode()
    assert "Root-Is-Purelib: false" in wheel and f"Tag: {tag}" in wheel, wheel
    assert [n for n in names if n.endswith((".so", ".pyd", ".dylib"))] == [NATIVE]
    assert meta["Name"] == DIST_NAME
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert "ctxmem_kv-0.1.0.dist-info/licenses/LICENSE" in names
    assert any(r.startswith("tqdm") for r in meta.get_all("Requires-Dist") or [])
    assert "ctxmem = ctxmem_common.cli:main" in eps
    for pkg in IMPORTS:
        assert f"{pkg}/__init__.py" in names, pkg
    # The data files the service needs at run time travel in the wheel.
    assert any(n.endswith(".proto") for n in names)


def test_wheel_installs_and_imports(dist: tuple[Path, str], tmp_path: Path) -> None:
    """Installed (--no-deps) into an empty directory that comes first on sys.path: the
    four packages import from there, not from the checkout."""
    out, _log = dist
    target = tmp_path / "site"
    wheel = next(out.glob("*.whl"))
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                           "--no-index", "--target", str(target), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    code = ("import sys, importlib, importlib.metadata as md\n"
            f"for name in {IMPORTS!r}:\n"
            "    mod = importlib.import_module(name)\n"
            "    assert mod.__file__.startswith(sys.argv[1]), (name, mod.__file__)\n"
            "from ctxmem_common.codecs import CRC32C_IMPLEMENTATION as impl\n"
            "assert impl.startswith('native/'), impl\n"
            f"print(md.version({DIST_NAME!r}))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path,
                          env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "0.1.0"


def test_pure_wheel_when_native_is_off(tmp_path: Path) -> None:
    """``CTXMEM_BUILD_NATIVE=0``: one ``py3-none-any`` wheel (the arm64 image's, built on
    an x86-64 host), whose CRC32C is the ``crc32c`` package's."""
    proc = build(copy_tree(tmp_path), tmp_path / "dist", native=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    wheels = list((tmp_path / "dist").glob("*.whl"))
    assert [w.name for w in wheels] == ["ctxmem_kv-0.1.0-py3-none-any.whl"]
    with zipfile.ZipFile(wheels[0]) as zf:
        assert not [n for n in zf.namelist() if n.endswith((".so", ".pyd", ".dylib"))]
        assert "Root-Is-Purelib: true" in zf.read("ctxmem_kv-0.1.0.dist-info/WHEEL").decode()


def test_image_build_finds_the_wheel(dist: tuple[Path, str]) -> None:
    """deploy/image/build.sh picks the project's wheel by a glob: it matches the wheel's
    real name (a rename of the distribution that the image build missed fails here)."""
    import fnmatch

    out, _log = dist
    script = (ROOT / "deploy" / "image" / "build.sh").read_text()
    m = re.search(r'^built=\("\$WORK"/wheels/([^)\s]+)\)$', script, re.M)
    assert m, "build.sh no longer sets built=(\"$WORK\"/wheels/GLOB)"
    wheel = next(out.glob("*.whl")).name
    assert fnmatch.fnmatch(wheel, m.group(1)), (wheel, m.group(1))
