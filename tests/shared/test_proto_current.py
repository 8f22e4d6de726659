"""The committed generated code must be what grpc_tools makes from the committed .proto."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "shared" / "ctxmem_common" / "proto"


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
            f"{name} is stale: regenerate with `python -m grpc_tools.protoc -I shared "
            f"--python_out=shared --pyi_out=shared --grpc_python_out=shared "
            f"shared/ctxmem_common/proto/ctxmem.proto`")


def test_proto_package_is_ctxmem_v1() -> None:
    assert "package ctxmem.v1;" in (PROTO_DIR / "ctxmem.proto").read_text()
