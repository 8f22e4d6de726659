"""Issue 12, item 6: the service refuses files and directories another local user could
have prepared (docs/security.md, "Files and paths"). Each case starts a real
``ctxmem serve`` process on a config whose one path was tampered with, and checks that it
refuses to start with an error naming the path, what was found and the fix, and that the
tampered-with target was left alone. Needs root (to create another user's files)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ctxmem_tools.launcher import ServiceProcess, local_config

OTHER_UID = 12345  # a local user the service must not trust

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another uid")


def _refused(workdir: Path, cfg: dict[str, Any], *needles: str) -> str:
    """Start the service on ``cfg``; it must exit, and its log must hold every needle."""
    with pytest.raises(RuntimeError, match="exited with status") as info:
        ServiceProcess(workdir, cfg).stop()
    text = str(info.value)
    for needle in needles:
        assert needle in text, f"{needle!r} not in the service's error:\n{text}"
    return text


def _cfg(work: Path, **kw: Any) -> dict[str, Any]:
    return local_config(work, dram_size="16MiB", dram_slab="4MiB", flash_size="64MiB",
                        flash_slab="4MiB", **kw)


def test_flash_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "theirs"
    other.mkdir(mode=0o700)
    os.chown(other, OTHER_UID, OTHER_UID)
    cfg = _cfg(tmp_path / "svc", flash_path=str(other / "flash0.img"))
    _refused(tmp_path / "svc", cfg, str(other), f"owner uid {OTHER_UID}", "owned by another user",
             "chown")
    assert not (other / "flash0.img").exists()


def test_socket_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "sockdir"
    other.mkdir(mode=0o755)
    os.chown(other, OTHER_UID, OTHER_UID)
    cfg = _cfg(tmp_path / "svc", service={"shm_socket": str(other / "data.sock")})
    _refused(tmp_path / "svc", cfg, "shm socket directory", str(other), "owned by another user")
    assert not (other / "data.sock").exists()


def test_world_writable_socket_directory_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp: sticky, but anyone may plant a socket or link
    cfg = _cfg(tmp_path / "svc", service={"shm_socket": str(shared / "data.sock")})
    _refused(tmp_path / "svc", cfg, str(shared), "writable by group or other", "chmod go-w")


def test_missing_socket_directory_is_created_0750(tmp_path: Path) -> None:
    sockdir = tmp_path / "run" / "ctxmem"
    cfg = _cfg(tmp_path / "svc", service={"shm_socket": str(sockdir / "data.sock")})
    with ServiceProcess(tmp_path / "svc", cfg):
        assert (sockdir.stat().st_mode & 0o777) == 0o750
        assert (sockdir / "data.sock").is_socket()


def test_group_readable_key_file_is_refused(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path / "svc")
    key = Path(cfg["encryption"]["key_file"])
    key.chmod(0o640)
    _refused(tmp_path / "svc", cfg, f"encryption key file {key}", "read or written by group or "
             "other", "0640", f"chmod 600 {key}")


def test_key_file_of_another_user_is_refused(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path / "svc")
    key = Path(cfg["encryption"]["key_file"])
    os.chown(key, OTHER_UID, OTHER_UID)  # 0600, but theirs: they know the key
    _refused(tmp_path / "svc", cfg, str(key), f"owner uid {OTHER_UID}", "owned by another user")


def test_symlinked_key_file_is_refused(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path / "svc")
    key = Path(cfg["encryption"]["key_file"])
    real = tmp_path / "real.key"
    key.rename(real)
    key.symlink_to(real)
    _refused(tmp_path / "svc", cfg, str(key), "symbolic link", "configure the real path")


def test_symlinked_key_file_is_not_created_through(tmp_path: Path) -> None:
    """A dangling link where the key is to be created: the service must not create (and
    so choose) the key at the link's target."""
    cfg = _cfg(tmp_path / "svc")
    key = Path(cfg["encryption"]["key_file"])
    key.unlink()
    target = tmp_path / "victim.key"
    key.symlink_to(target)
    _refused(tmp_path / "svc", cfg, str(key), "symbolic link")
    assert not target.exists()


def test_symlinked_flash_path_is_refused_and_target_untouched(tmp_path: Path) -> None:
    victim = tmp_path / "root-owned.conf"
    content = b"precious root-owned file\n"
    victim.write_bytes(content)
    link = tmp_path / "flash-link.img"
    link.symlink_to(victim)
    cfg = _cfg(tmp_path / "svc", flash_path=str(link))
    _refused(tmp_path / "svc", cfg, f"flash device 'flash0': {link} is a symbolic link",
             "realpath")
    assert victim.read_bytes() == content  # neither grown nor given a superblock


def test_flash_file_of_another_user_is_refused(tmp_path: Path) -> None:
    flash = tmp_path / "svc" / "flash0.img"
    flash.parent.mkdir(mode=0o700)
    with open(flash, "wb") as f:
        f.truncate(64 << 20)
    os.chown(flash, OTHER_UID, OTHER_UID)
    cfg = _cfg(tmp_path / "svc", flash_path=str(flash))
    _refused(tmp_path / "svc", cfg, str(flash), f"owner uid {OTHER_UID}", "owned by another user")
    assert flash.stat().st_size == 64 << 20


def test_flash_directory_writable_by_others_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    cfg = _cfg(tmp_path / "svc", flash_path=str(shared / "flash0.img"))
    _refused(tmp_path / "svc", cfg, str(shared), "writable by group or other")


def test_safe_paths_start_and_key_is_created_private(tmp_path: Path) -> None:
    """The control case: private directories the service creates itself work, and the
    key, flash and state directory it creates are private."""
    state = tmp_path / "state" / "ctxmem"
    cfg = _cfg(tmp_path / "svc", flash_path=str(state / "flash0.img"))
    cfg["encryption"]["key_file"] = str(state / "master.key")
    with ServiceProcess(tmp_path / "svc", cfg):
        assert (state.stat().st_mode & 0o777) == 0o700
        assert ((state / "master.key").stat().st_mode & 0o777) == 0o600
        assert ((state / "flash0.img").stat().st_mode & 0o777) == 0o600


def test_ready_file_link_is_not_followed(tmp_path: Path) -> None:
    from ctxmem_common import safepaths

    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    link = tmp_path / "ready"
    link.symlink_to(victim)
    with pytest.raises(safepaths.UnsafePathError, match="symbolic link"):
        safepaths.write_ready_file(link, "50051\n")
    theirs = tmp_path / "theirs"
    theirs.write_text("keep\n")
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(safepaths.UnsafePathError, match="owned by another user"):
        safepaths.write_ready_file(theirs, "50051\n")
    assert victim.read_text() == theirs.read_text() == "keep\n"
