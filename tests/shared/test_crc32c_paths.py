"""Every CRC32C path agrees: each of the native extension's paths this CPU runs (AVX-512
VPCLMULQDQ folding, SSE4.2 with and without AVX2 streaming stores, ARMv8 CRC, the portable
table path), forced in turn with ``set_implementation``, and the pure path (the
``crc32c`` package), each against the published vectors and against each other on random
lengths, alignments and initial CRCs; the fused copy copies exactly and refuses a wrong
size or a read-only destination; ``CTXMEM_CRC32C_IMPL`` picks the path at import.

The native extension must be built (``pip install -e .`` or ``python setup.py build_ext
--inplace``): its absence fails these tests rather than skipping them, unless
``CTXMEM_CRC32C_IMPL=pure`` says the pure path is meant.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ctxmem_common.codecs import crc as crc_mod
from tests.shared.test_codecs import CRC_VECTORS

CrcFn = Callable[..., int]

if os.environ.get(crc_mod.ENV) == "pure":
    pytest.skip(f"{crc_mod.ENV}=pure: the native extension is not under test",
                allow_module_level=True)

from ctxmem_common.codecs import _crc32c_native as native  # type: ignore[attr-defined]  # noqa: E402

# The paths of this machine: the tables always, each instruction path the CPU runs.
NATIVE_PATHS: list[str] = native.available()


@pytest.fixture(params=[*NATIVE_PATHS, "pure"])
def path(request: pytest.FixtureRequest) -> Iterator[tuple[CrcFn, CrcFn]]:
    """(crc32c, copy_crc32c) of one path; the native module's choice restored after."""
    before = native.implementation()
    if request.param == "pure":
        yield crc_mod._pure_crc32c, crc_mod._pure_copy_crc32c
        return
    native.set_implementation(request.param)
    try:
        yield native.crc32c, native.copy_crc32c
    finally:
        native.set_implementation(before)


def test_this_machine_has_the_hardware_path() -> None:
    """x86-64 and aarch64 CI machines have CRC32C instructions: a build that loses them
    (wrong target attribute, failed detection) must not pass as the table path."""
    if platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        pytest.skip(f"{platform.machine()}: no CRC32C instructions expected")
    assert native.hardware() is not None
    assert native.available()[-1] == native.hardware()
    if not os.environ.get(crc_mod.ENV):
        assert f"native/{native.hardware()}" == crc_mod.IMPLEMENTATION


@pytest.mark.parametrize(("data", "expected"), CRC_VECTORS)
def test_published_vectors(path: tuple[CrcFn, CrcFn], data: bytes, expected: int) -> None:
    crc, copy_crc = path
    assert crc(data) == expected
    dst = bytearray(len(data))
    assert copy_crc(data, dst) == expected
    assert bytes(dst) == data


def _cases(seed: int) -> Iterator[tuple[int, int, int, int]]:
    """(length, source offset, destination offset, initial CRC): the edges of each path's
    steps (8-byte words, 3 x 256 and 3 x 8192 stripes, the 1 KiB floor and 256-byte steps
    of the folding path, the 64 KiB streaming threshold) and
    random ones."""
    rng = np.random.default_rng(seed)
    edges = [0, 1, 7, 8, 9, 255, 767, 768, 769, 1023, 1024, 1025, 1087, 1279, 1280, 1343,
             24575, 24576, 24577, 65535, 65536, 65537,
             (2 << 20) + 3]
    for n in edges + rng.integers(0, 300_000, 40).tolist():
        yield (int(n), int(rng.integers(0, 64)), int(rng.integers(0, 64)),
               int(rng.integers(0, 1 << 32)))


def test_agrees_with_the_pure_path(path: tuple[CrcFn, CrcFn]) -> None:
    crc, copy_crc = path
    rng = np.random.default_rng(1)
    pool = rng.integers(0, 256, (2 << 20) + 200, dtype=np.uint8)
    out = np.full(pool.nbytes, 0x5A, dtype=np.uint8)
    for n, so, do, init in _cases(2):
        src = memoryview(pool)[so : so + n]
        want = crc_mod._pure_crc32c(src, init)
        assert crc(src, init) == want, (n, so, init)
        out[:] = 0x5A
        dst = memoryview(out)[do : do + n]
        assert copy_crc(src, dst, init) == want, (n, so, do, init)
        assert np.array_equal(out[do : do + n], pool[so : so + n]), (n, so, do)
        assert (out[:do] == 0x5A).all() and (out[do + n :] == 0x5A).all(), "wrote outside dst"


def test_continues_across_calls(path: tuple[CrcFn, CrcFn]) -> None:
    crc, copy_crc = path
    data = np.random.default_rng(3).integers(0, 256, 300_001, dtype=np.uint8).tobytes()
    dst = bytearray(len(data))
    cut = 100_003
    part = copy_crc(data[:cut], memoryview(dst)[:cut])
    assert copy_crc(data[cut:], memoryview(dst)[cut:], part) == crc(data) == crc(
        data[cut:], crc(data[:cut]))
    assert bytes(dst) == data


@pytest.mark.parametrize("which", ["size", "readonly"])
def test_copy_refuses_a_wrong_destination(path: tuple[CrcFn, CrcFn], which: str) -> None:
    _crc, copy_crc = path
    src = bytes(range(256)) * 4
    dst: Any = bytearray(len(src) + 1) if which == "size" else bytes(len(src))
    with pytest.raises(ValueError, match="read-only" if which == "readonly" else "bytes but"):
        copy_crc(src, dst)
    if which == "size":
        assert dst == bytearray(len(src) + 1), "nothing copied on a refused call"


def test_native_argument_errors() -> None:
    with pytest.raises(ValueError, match=r"2\*\*32"):
        native.crc32c(b"x", 1 << 32)
    with pytest.raises(ValueError, match=r"2\*\*32"):
        native.crc32c(b"x", -1)
    with pytest.raises(TypeError, match="contiguous buffer"):
        native.crc32c("text")
    with pytest.raises(TypeError, match="contiguous buffer"):
        native.crc32c(memoryview(bytes(16))[::2])
    buf = bytearray(64)
    with pytest.raises(ValueError, match="overlap"):
        native.copy_crc32c(memoryview(buf)[:32], memoryview(buf)[8:40])
    with pytest.raises(ValueError, match="unknown implementation"):
        native.set_implementation("fast")
    if "sse4.2" in native.available() and "armv8-crc" not in native.available():
        with pytest.raises(ValueError, match="unknown implementation"):
            native.set_implementation("armv8-crc")


@pytest.fixture(params=[*NATIVE_PATHS, "pure"])
def many(request: pytest.FixtureRequest) -> Iterator[CrcFn]:
    """``crc32c_many`` of one path (the native call under each forced implementation, or
    the pure fallback); the native module's choice restored after."""
    before = native.implementation()
    if request.param == "pure":
        yield crc_mod._pure_crc32c_many
        return
    native.set_implementation(request.param)
    try:
        yield native.crc32c_many
    finally:
        native.set_implementation(before)


def test_many_agrees_with_one_call_per_range(many: CrcFn) -> None:
    """Random offsets and lengths (overlapping, empty, up to 300 KB, at the buffer's end),
    as a list of lengths and as one length for all: each CRC is the one-range CRC."""
    rng = np.random.default_rng(7)
    buf = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    lens = [int(n) for n in rng.integers(0, 300_000, 60)] + [0, 1, 65536, 300]
    offs = [int(rng.integers(0, buf.nbytes - n + 1)) for n in lens]
    offs[-1], lens[-1] = buf.nbytes - 300, 300  # a range ending at the buffer's end
    want = [crc_mod._pure_crc32c(memoryview(buf)[o:o + n])
            for o, n in zip(offs, lens, strict=True)]
    assert many(buf, offs, lens) == want
    assert many(memoryview(buf), tuple(offs), tuple(lens)) == want
    one = 65536
    starts = [int(o) for o in rng.integers(0, buf.nbytes - one + 1, 40)]
    assert many(buf, starts, one) == [native.crc32c(buf[o:o + one]) for o in starts]
    assert many(buf, [], one) == []


@pytest.mark.parametrize(("offsets", "lengths", "match"), [
    ([0, 1 << 20], 1, "range 1 is"),               # starts at the end, one byte long
    ([0, (1 << 20) - 10], [5, 11], "range 1 is"),  # runs one byte past the end
    ([0, -1], 8, r"offsets\[1\] must be|range 1 is"),
    ([0, 8], [8, -8], r"lengths\[1\] must be|range 1 is"),
    ([0, 8], [8], "2 offsets but 1 lengths"),
])
def test_many_refuses_ranges_outside_the_buffer(many: CrcFn, offsets: list[int],
                                                lengths: int | list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        many(bytes(1 << 20), offsets, lengths)


def test_native_many_argument_errors() -> None:
    with pytest.raises(TypeError, match="sequence of ints"):
        native.crc32c_many(b"x" * 8, 5, 1)
    with pytest.raises(TypeError, match="contiguous buffer"):
        native.crc32c_many("text", [0], 1)
    with pytest.raises(ValueError, match=r"offsets\[0\] must be"):
        native.crc32c_many(b"x" * 8, [1 << 70], 1)


def test_copy_takes_numpy_arrays_of_any_dtype() -> None:
    src = np.arange(1000, dtype=np.float32)
    dst = np.zeros(1000, dtype=np.float32)
    assert native.copy_crc32c(src, dst) == crc_mod._pure_crc32c(src.tobytes())
    assert np.array_equal(src, dst)


@pytest.mark.parametrize("choice", ["hardware", "table", "pure", "bogus"])
def test_the_env_switch_picks_the_path(choice: str) -> None:
    code = ("from ctxmem_common.codecs import CRC32C_IMPLEMENTATION as i, crc32c, copy_crc32c,"
            " crc32c_many;"
            "d = bytearray(9); assert copy_crc32c(b'123456789', d) == crc32c(d) == 0xE3069283;"
            "assert crc32c_many(b'x123456789', [1, 0], [9, 0]) == [0xE3069283, 0];"
            "print(i)")
    env = {**os.environ, crc_mod.ENV: choice,
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60, check=False)
    if choice == "bogus":
        assert r.returncode != 0 and "use one of hardware, table, pure" in r.stderr
        return
    assert r.returncode == 0, r.stderr
    want = {"pure": "pure", "table": "native/table"}.get(choice, f"native/{native.hardware()}")
    assert r.stdout.strip() == want



HARNESS = Path(__file__).with_name("crc32c_harness.c")
SOURCE_DIR = Path(crc_mod.__file__).parent


def _run_harness(cc: str, runner: list[str], tmp_path: Path) -> str:
    exe = tmp_path / f"harness-{Path(cc).name}"
    subprocess.run([cc, "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-static",
                    f"-I{SOURCE_DIR}", "-o", str(exe), str(HARNESS)],
                   check=True, capture_output=True, timeout=120)
    r = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_c_core_every_path_of_this_cpu(tmp_path: Path) -> None:
    """The C core alone (no Python), as the compiler of this machine builds it."""
    if shutil.which("gcc") is None:
        pytest.fail("gcc not found (deploy/setup.sh installs it)")
    out = _run_harness("gcc", [], tmp_path)
    for name in native.available():
        assert f"{name} " in out and "FAIL" not in out, out


def test_c_core_armv8_crc_path_under_qemu(tmp_path: Path) -> None:
    """BlueField's path (ARMv8 CRC32C instructions), cross-compiled and run under
    qemu-aarch64-static: vectors and agreement with the table path, copy and CRC."""
    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64-static")
    if cc is None or qemu is None:
        pytest.skip("needs gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and qemu-user-static")
    out = _run_harness(cc, [qemu], tmp_path)
    assert "armv8-crc            ok" in out, out
