"""ctxmem_common.safepaths: the default paths the embedded config resolves to (root and
another uid, the latter in a child process run as that uid), and the checks' errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ctxmem_common import safepaths
from ctxmem_common.config import default_config_yaml, load_config

OTHER_UID = 12345
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


def _paths(text: str) -> tuple[str, str, str]:
    cfg = yaml.safe_load(text)
    return (cfg["service"]["shm_socket"], cfg["flash"]["devices"][0]["path"],
            cfg["encryption"]["key_file"])


def test_root_defaults_are_run_and_var_lib() -> None:
    assert _paths(default_config_yaml(0, {})) == (
        "/run/ctxmem/data.sock", "/var/lib/ctxmem/flash0.img", "/var/lib/ctxmem/master.key")


def test_user_defaults_are_xdg() -> None:
    env = {"XDG_RUNTIME_DIR": "/run/user/1000", "XDG_STATE_HOME": "/home/u/.st",
           "HOME": "/home/u"}
    assert _paths(default_config_yaml(1000, env)) == (
        "/run/user/1000/ctxmem/data.sock", "/home/u/.st/ctxmem/flash0.img",
        "/home/u/.st/ctxmem/master.key")
    bare = {"HOME": "/home/u"}
    sock, flash, key = _paths(default_config_yaml(OTHER_UID, bare))
    assert flash == "/home/u/.local/state/ctxmem/flash0.img"
    assert key == "/home/u/.local/state/ctxmem/master.key"
    assert not sock.startswith(("/tmp", "/var/tmp"))


def test_no_default_path_is_in_a_shared_temp_dir() -> None:
    for text in (default_config_yaml(0, {}), default_config_yaml(),
                 default_config_yaml(OTHER_UID, {"HOME": "/home/u"})):
        assert "/tmp" not in text, text
    cfg = load_config()
    assert not cfg.service.shm_socket.startswith(("/tmp", "/var/tmp"))


def _resolve_as(uid: int, env: dict[str, str]) -> tuple[int, tuple[str, str, str]]:
    """Fork a child that becomes ``uid`` (setgid/setuid), sets ``env`` as its whole
    environment and resolves the embedded default config itself; returns the child's euid
    and the paths. (Forked rather than exec'd: the interpreter may live where another uid
    cannot exec it, e.g. under /root.)"""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(r)
            if uid:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            os.environ.clear()
            os.environ.update(env)
            out = json.dumps([os.geteuid(), _paths(default_config_yaml())])
            os.write(w, out.encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data
    euid, paths = json.loads(data)
    return euid, tuple(paths)  # type: ignore[return-value]


@root_only
def test_default_config_resolves_per_user_in_a_child(tmp_path: Path) -> None:
    """The embedded default resolves for the user loading it: root gets /run/ctxmem and
    /var/lib/ctxmem; another uid (a child process running as that uid) its XDG
    directories, with and without the XDG variables."""
    assert _resolve_as(0, {"HOME": "/root"}) == (0, (
        "/run/ctxmem/data.sock", "/var/lib/ctxmem/flash0.img", "/var/lib/ctxmem/master.key"))
    home = tmp_path / "home"
    xdg = {"HOME": str(home), "XDG_RUNTIME_DIR": f"/run/user/{OTHER_UID}",
           "XDG_STATE_HOME": str(home / "state")}
    assert _resolve_as(OTHER_UID, xdg) == (OTHER_UID, (
        f"/run/user/{OTHER_UID}/ctxmem/data.sock", f"{home}/state/ctxmem/flash0.img",
        f"{home}/state/ctxmem/master.key"))
    euid, (sock, flash, key) = _resolve_as(OTHER_UID, {"HOME": str(home)})
    assert euid == OTHER_UID
    assert (flash, key) == (f"{home}/.local/state/ctxmem/flash0.img",
                            f"{home}/.local/state/ctxmem/master.key")
    assert sock == (f"/run/user/{OTHER_UID}/ctxmem/data.sock"
                    if os.path.isdir(f"/run/user/{OTHER_UID}")
                    else f"{home}/.local/state/ctxmem/run/data.sock")


def test_print_default_config_prints_the_resolved_paths() -> None:
    out = subprocess.run([sys.executable, "-m", "ctxmem_dpu", "serve",
                          "--print-default-config"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out == default_config_yaml()
    assert _paths(out) == _paths(default_config_yaml(os.geteuid(), os.environ))


def test_ensure_dir_creates_private_and_refuses_shared(tmp_path: Path) -> None:
    new = tmp_path / "a" / "b"
    safepaths.ensure_dir(new)
    assert (new.stat().st_mode & 0o777) == 0o700
    sock = tmp_path / "sock"
    safepaths.ensure_dir(sock, safepaths.SOCKET_DIR_MODE)
    assert (sock.stat().st_mode & 0o777) == 0o750
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o775)
    with pytest.raises(safepaths.UnsafePathError, match=r"writable by group or other .*0775"):
        safepaths.ensure_dir(open_dir)
    link = tmp_path / "link"
    link.symlink_to(new)
    with pytest.raises(safepaths.UnsafePathError, match="symbolic link"):
        safepaths.check_dir(link)


@root_only
def test_key_file_checks(tmp_path: Path) -> None:
    key = tmp_path / "k"
    assert safepaths.open_key_file(key, create_with="ab\n") == "ab\n"
    assert (key.stat().st_mode & 0o777) == 0o600
    assert safepaths.open_key_file(key, create_with="other\n") == "ab\n"  # never replaced
    key.chmod(0o604)
    with pytest.raises(safepaths.UnsafePathError, match=f"chmod 600 {key}"):
        safepaths.open_key_file(key)
    key.chmod(0o600)
    os.chown(key, OTHER_UID, OTHER_UID)
    with pytest.raises(safepaths.UnsafePathError, match=f"owner uid {OTHER_UID}"):
        safepaths.open_key_file(key)
    with pytest.raises(FileNotFoundError):
        safepaths.open_key_file(tmp_path / "missing")
