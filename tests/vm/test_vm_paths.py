"""The guest sees the checkout it was started from, wherever it lives (tests/vm/run.sh
mounts the repo by its own 9p share at the same path, after the guest's tmpfs mounts on
/tmp and /run): the command runs from the repo root, the code imported is this
checkout's, the repo is read-only, and the harness's helper script is reachable.

``tests/vm/clone-check.sh`` runs this file from a fresh clone under /tmp with a venv
inside the clone, and names the paths it expects in ``CTXMEM_VM_EXPECT_REPO`` and
``CTXMEM_VM_EXPECT_PREFIX``. Outside the guest every test here is skipped.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest

IN_VM = os.environ.get("CTXMEM_VM") == "1"
REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(not IN_VM, reason="needs the QEMU guest: bash tests/vm/run.sh ..."),
]


def test_runs_from_this_checkout() -> None:
    assert Path.cwd().resolve() == REPO
    expected = os.environ.get("CTXMEM_VM_EXPECT_REPO")
    if expected:
        assert Path(expected).resolve() == REPO
    import ctxmem
    import ctxmem_common
    import ctxmem_dpu

    for mod in (ctxmem, ctxmem_common, ctxmem_dpu):
        assert Path(str(mod.__file__)).resolve().is_relative_to(REPO), mod.__file__


def test_interpreter_is_the_expected_venv() -> None:
    expected = os.environ.get("CTXMEM_VM_EXPECT_PREFIX")
    if not expected:
        pytest.skip("no CTXMEM_VM_EXPECT_PREFIX (set by tests/vm/clone-check.sh)")
    assert Path(sys.prefix).resolve() == Path(expected).resolve()


def test_repo_is_read_only_and_helpers_are_reachable() -> None:
    with pytest.raises(OSError) as exc:
        (REPO / "vm-write-probe").write_text("x")
    assert exc.value.errno == errno.EROFS, exc.value
    ctl = Path(os.environ["CTXMEM_NVMET_CTL"])
    assert ctl.is_file() and ctl.resolve().is_relative_to(REPO)
