"""``ctxmem bench profile``: the reading of py-spy's collapsed stacks (waits left out,
self and inclusive shares), and a short real run where py-spy is installed."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from ctxmem_tools.bench.profile import top_frames
from ctxmem_tools.cli import bench_command

RAW = """\
main (a.py:1);serve (ctxmem_dpu/x.py:2);crc32c (crc.c:9) 30
main (a.py:1);serve (ctxmem_dpu/x.py:2);copy (ctxmem_dpu/y.py:3);memcpy (libc.so.6) 10
main (a.py:1);worker (t.py:81);PyThread_acquire_lock_timed (libpython);0x7f (libc.so.6) 50
main (a.py:1);loop (e.py:1);epoll_wait (libc.so.6) 10
"""


def test_top_frames_drops_waits_and_counts_self_and_inclusive() -> None:
    total, busy, own, incl = top_frames(RAW, 10)
    assert (total, busy) == (100, 40)
    assert own == [("crc32c (crc.c:9)", 30), ("memcpy (libc.so.6)", 10)]
    assert incl == [("serve (ctxmem_dpu/x.py:2)", 40), ("copy (ctxmem_dpu/y.py:3)", 10)]


PY_SPY = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))


@pytest.mark.skipif(not Path(PY_SPY).exists(), reason="py-spy is not installed (pip install "
                    "py-spy): the live profile needs it")
def test_profile_a_short_put_loop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = tmp_path / "stacks.txt"
    assert bench_command(["profile", "--op", "put", "--seconds", "2", "--batch-mib", "4",
                          "--workdir", str(tmp_path / "w"), "--raw", str(raw)]) == 0
    out = capsys.readouterr().out
    assert "s/GB" in out and "top self" in out
    assert "ctxmem_dpu" in raw.read_text()  # the service's own frames were sampled
