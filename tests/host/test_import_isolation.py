"""``import ctxmem`` must not pull in torch, pyverbs, or the service."""

from __future__ import annotations

import subprocess
import sys


def test_import_ctxmem_is_light() -> None:
    code = (
        "import sys, ctxmem\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'pyverbs', 'ctxmem_dpu', 'ctxmem_tools', 'transformers', 'vllm', 'lmcache', "
        "'sglang', 'spdk'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "", f"import ctxmem imported: {out}"


def test_service_does_not_import_the_shim() -> None:
    code = ("import sys, ctxmem_dpu.app, ctxmem_dpu.cli\n"
            "print(','.join(m for m in sys.modules if m.split('.')[0] in "
            "('ctxmem', 'ctxmem_tools')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == ""


def test_common_imports_neither_side() -> None:
    code = ("import sys, ctxmem_common.config, ctxmem_common.cli, ctxmem_common.codecs, "
            "ctxmem_common.proto.ctxmem_pb2_grpc\n"
            "print(','.join(m for m in sys.modules if m.split('.')[0] in "
            "('ctxmem', 'ctxmem_dpu', 'ctxmem_tools')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == ""


def test_tools_never_import_the_service() -> None:
    """The tools run the service as a program (``python -m ctxmem_dpu serve``) only."""
    code = ("import sys, ctxmem_tools.cli, ctxmem_tools.launcher, ctxmem_tools.chaos, "
            "ctxmem_tools.bench.datapath, ctxmem_tools.bench.recovery, ctxmem_tools.bench.ttft, "
            "ctxmem_tools.demo\n"
            "print(','.join(m for m in sys.modules if m.split('.')[0] in "
            "('ctxmem_dpu', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "", f"the tools imported: {out}"
