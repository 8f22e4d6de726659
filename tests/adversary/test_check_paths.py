"""``ctxmem check`` opens flash paths as carefully as the service (issue 25, item 5;
docs/security.md, "Files and paths").

A real service formats a flash file and stops; its backup superblock copy is then
damaged, so ``ctxmem check --repair`` has something to write. Another local user then
swaps the configured path for a symbolic link to a file of their choosing, or plants an
image of their own with mode 0666. ``ctxmem check`` (the real command, a subprocess)
must refuse both, read-only and with ``--repair`` and ``--format``, with an error naming
the path, what was found and what to do, and must leave the link's target byte for byte
as it was. Needs root (to create another user's file).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ctxmem_common.flash_format.records import SB_BACKUP_OFFSET, SECTOR
from ctxmem_tools.launcher import ServiceProcess, local_config

OTHER_UID = 65534  # nobody: a local user ctxmem must not trust

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another uid")


def _digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ctxmem_dpu", "check", "-q", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _formatted_device(tmp_path: Path) -> tuple[Path, Path]:
    """(config path, flash path): a device a real service formatted, whose backup
    superblock copy is then zeroed (``--repair`` would rewrite it)."""
    work = tmp_path / "svc"
    cfg = local_config(work, dram_size="16MiB", dram_slab="4MiB", flash_size="32MiB",
                       flash_slab="4MiB")
    svc = ServiceProcess(work, cfg)
    svc.stop()
    assert svc.flash_path is not None
    with svc.flash_path.open("r+b") as f:
        f.seek(SB_BACKUP_OFFSET)
        f.write(bytes(SECTOR))
    return svc.config_path, svc.flash_path


def test_symlinked_flash_path_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    config, flash = _formatted_device(tmp_path)
    target = tmp_path / "victim.img"  # say, a file of root's the link's maker wants hit
    flash.rename(target)
    flash.symlink_to(target)
    before = _digest(target)
    for args in (["--config", str(config), "--repair"], ["--config", str(config)],
                 ["--format", "--slab-size", "4MiB", f"--device=flash0={flash}"]):
        r = _check(*args)
        assert r.returncode == 8, (args, r.stdout, r.stderr)
        assert str(flash) in r.stderr and "symbolic link" in r.stderr, r.stderr
        assert str(target) in r.stderr and "real file" in r.stderr, r.stderr
        assert _digest(target) == before, f"ctxmem check {args} wrote through the link"
    # The same image at its real path is the operator's: --repair fixes it (exit 1).
    flash.unlink()
    target.rename(flash)
    r = _check("--config", str(config), "--repair")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert _digest(flash) != before


def test_image_of_another_user_is_refused(tmp_path: Path) -> None:
    config, flash = _formatted_device(tmp_path)
    os.chown(flash, OTHER_UID, OTHER_UID)
    flash.chmod(0o666)  # anyone may write it: its records could be anyone's
    before = _digest(flash)
    for args in (["--config", str(config), "--repair"], ["--config", str(config)],
                 [f"--device=flash0={flash}"],
                 ["--format", "--slab-size", "4MiB", f"--device=flash0={flash}"]):
        r = _check(*args)
        assert r.returncode == 8, (args, r.stdout, r.stderr)
        for needle in (str(flash), "owned by another user", f"owner uid {OTHER_UID}",
                       f"chown {os.geteuid()} {flash}"):
            assert needle in r.stderr, (args, needle, r.stderr)
        assert _digest(flash) == before
    # Handed back to the service's user, the same image is checked and repaired.
    os.chown(flash, 0, 0)
    flash.chmod(0o600)
    r = _check("--config", str(config), "--repair")
    assert r.returncode == 1, (r.stdout, r.stderr)
