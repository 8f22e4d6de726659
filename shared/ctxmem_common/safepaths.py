"""Safe files and directories for a service on a machine shared by users who do not trust
each other (issue 12, item 6; docs/security.md, "Files and paths").

The service creates and opens its directories, the master key file, local flash files,
the shared-memory socket's directory and the ready file only through this module, so a
path that another local user prepared in advance (a directory they own or can write, a
key file they can read, a flash file they created, a symbolic link to a file of root's)
is refused with an error naming the path, what was found and the fix, instead of being
used. The rules are deliberately simple and strict:

* a directory is created with mode 0700 (0750 for the socket's, see
  :data:`SOCKET_DIR_MODE`) if absent; an existing one is refused if a user other than
  root or the service's own owns it, or if group or other may write it (sticky or not);
* the key file is refused if another user owns it or group/other may read or write it;
* flash files, the key file and the ready file are opened with ``O_NOFOLLOW`` (a
  symbolic link is refused), and one owned by another non-root user is refused.

Root-owned paths are accepted: root can already do anything to the service.

:func:`default_runtime_dir` and :func:`default_state_dir` say where the embedded default
config puts the socket and the state (``/run/ctxmem`` and ``/var/lib/ctxmem`` as root,
the user's XDG directories otherwise), never ``/tmp`` or ``/var/tmp``.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from ctxmem_common.errors import ConfigError

__all__ = [
    "SOCKET_DIR_MODE",
    "UnsafePathError",
    "check_dir",
    "check_flash_path",
    "default_runtime_dir",
    "default_state_dir",
    "ensure_dir",
    "open_key_file",
    "open_nofollow",
    "read_tls_key_file",
    "write_ready_file",
]

# The shm socket is created 0660 so that members of the service's group (the engines'
# users, e.g. group `ctxmem`) can connect; connecting needs search permission on its
# directory too, hence group r-x. Nobody but the owner may write the directory.
SOCKET_DIR_MODE = 0o750
PRIVATE_DIR_MODE = 0o700


class UnsafePathError(ConfigError):
    """A file or directory the service would use is not safe: another user owns it, it is
    writable (or, for the key, readable) by others, or it is a symbolic link. The message
    names the path, the owner and mode found, and the fix."""


def _owner_ok(uid: int) -> bool:
    return uid in (0, os.geteuid())


def _describe(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)} ({st.st_mode & 0o7777:04o})"


def check_dir(path: str | os.PathLike[str], what: str = "directory") -> os.stat_result:
    """Check that existing directory ``path`` is the service's to use: not a symbolic
    link, a directory, owned by root or the service's user, writable by nobody else.

    Raises:
        UnsafePathError: naming the path, its owner and mode, and the fix.
        FileNotFoundError: if it does not exist.
    """
    p = os.fspath(path)
    st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(
            f"{what} {p} is a symbolic link (to {os.readlink(p)!r}); ctxmem does not follow "
            f"links for its directories: configure the real directory instead")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{what} {p} is not a directory ({_describe(st)}): remove it or "
                              f"configure another path")
    if not _owner_ok(st.st_uid):
        raise UnsafePathError(
            f"{what} {p} is owned by another user ({_describe(st)}); it could have been "
            f"prepared by them to read or replace ctxmem's files: remove it, or "
            f"`chown {os.geteuid()} {p} && chmod 700 {p}`, or configure another path")
    if st.st_mode & 0o022:
        raise UnsafePathError(
            f"{what} {p} is writable by group or other ({_describe(st)}); other users could "
            f"plant or replace files in it: `chmod go-w {p}`, or configure a private "
            f"directory (not /tmp or /var/tmp)")
    return st


def ensure_dir(path: str | os.PathLike[str], mode: int = PRIVATE_DIR_MODE,
               what: str = "directory") -> str:
    """Create directory ``path`` with ``mode`` (missing parents too, each with ``mode``)
    if absent, then :func:`check_dir` it. Returns the path as a string.

    Raises:
        UnsafePathError: for an existing directory that is not safe (see :func:`check_dir`).
        OSError: if it cannot be created.
    """
    p = os.fspath(path)
    try:
        os.lstat(p)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(p))
        if not os.path.isdir(parent):
            ensure_dir(parent, PRIVATE_DIR_MODE, "parent directory")
        try:
            os.mkdir(p, mode)
            os.chmod(p, mode)  # the umask may have taken bits the socket's group needs
        except FileExistsError:
            pass  # created concurrently: checked below like any existing one
    check_dir(p, what)
    return p


def open_nofollow(path: str | os.PathLike[str], flags: int, what: str,
                  mode: int = 0o600) -> int:
    """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC)``; a symbolic link, or a regular
    file owned by another non-root user, is refused (the descriptor is closed).

    Raises:
        UnsafePathError: for a link or another user's file.
        OSError: any other failure of the open.
    """
    p = os.fspath(path)
    try:
        fd = os.open(p, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(p):
            raise UnsafePathError(
                f"{what} {p} is a symbolic link (to {os.readlink(p)!r}); ctxmem refuses to "
                f"follow it (another user could point it at a file of yours): configure the "
                f"real path, or replace the link with the file") from None
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and not _owner_ok(st.st_uid):
            raise UnsafePathError(
                f"{what} {p} is owned by another user ({_describe(st)}); it may have been "
                f"planted: remove it and let ctxmem create it, or `chown {os.geteuid()} {p}` "
                f"if it is yours")
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_flash_path(path: str | os.PathLike[str], name: str) -> None:
    """Refuse flash device ``name``'s ``path`` if it is a symbolic link or a regular file
    owned by another non-root user (nothing to check if it does not exist yet). Called
    before every open of a flash file; the open itself adds ``O_NOFOLLOW``.

    Raises:
        UnsafePathError: naming the path, what was found and the fix.
    """
    p = os.fspath(path)
    what = f"flash device {name!r}:"
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(
            f"{what} {p} is a symbolic link (to {os.readlink(p)!r}); ctxmem does not follow "
            f"links for flash (one planted by another user would have ctxmem overwrite "
            f"its target): point `path` at the real file or block device "
            f"(e.g. `realpath {p}`)")
    if stat.S_ISREG(st.st_mode) and not _owner_ok(st.st_uid):
        raise UnsafePathError(
            f"{what} {p} is owned by another user ({_describe(st)}); it may have been "
            f"planted to read or corrupt cached data: remove it and let ctxmem create it, "
            f"or `chown {os.geteuid()} {p} && chmod 600 {p}` if it is yours")


def open_key_file(path: str | os.PathLike[str], create_with: str | None = None) -> str:
    """The content of the master key file ``path``; with ``create_with``, a missing file
    is first created (mode 0600, ``O_EXCL``) holding that text, after its directory is
    created 0700 if absent, or checked like any ctxmem directory (:func:`check_dir`).

    Refused: a symbolic link, a file owned by another non-root user, a file that group or
    other may read or write.

    Raises:
        UnsafePathError: naming the path, its owner and mode, and the fix.
        FileNotFoundError: if it is missing and ``create_with`` is None.
    """
    p = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(p))
    if create_with is not None and not os.path.lexists(p):
        ensure_dir(parent, PRIVATE_DIR_MODE, "key file directory")
        try:
            fd = open_nofollow(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "encryption key file",
                               0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(create_with)
    fd = open_nofollow(p, os.O_RDONLY, "encryption key file")
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"encryption key file {p} is not a regular file "
                                  f"({_describe(st)}): configure the key file's path")
        if st.st_mode & 0o066:
            raise UnsafePathError(
                f"encryption key file {p} can be read or written by group or other "
                f"({_describe(st)}); the master key must be private: `chmod 600 {p}` (and "
                f"replace the key if others may have read it: that loses cached blocks)")
        return f.read()


def read_tls_key_file(path: str | os.PathLike[str],
                      what: str = "TLS key file (tls.key_file)") -> bytes:
    """The bytes of TLS private key file ``path`` (``what`` names it and its config key in
    errors: ``tls.key_file``, ``pod.index_key_file``), after checking it is
    private: a regular file owned by root or the service's user that group and other may
    not read or write.

    Unlike the master key, a symbolic link is accepted when its target (fully resolved)
    lies inside the link's own directory: that is how a Kubernetes Secret volume rotates
    files (``tls.key -> ..data/tls.key -> ..2024_01_01_00_00_00.1/tls.key``). A link out
    of the directory is refused: another user could point it anywhere.

    Raises:
        UnsafePathError: naming the path, what was found and the fix.
        OSError: the file cannot be read.
    """
    p = os.path.abspath(os.fspath(path))
    real = os.path.realpath(p)
    if real != p:
        home = os.path.realpath(os.path.dirname(p))
        if os.path.commonpath([home, real]) != home:
            raise UnsafePathError(
                f"{what} {p} is a symbolic link to {real}, outside its own directory "
                f"{home}; ctxmem follows a key link only within its directory (a Kubernetes "
                f"Secret volume's ..data links): configure the real path")
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{what} {p} is not a regular file ({_describe(st)})")
        if not _owner_ok(st.st_uid):
            raise UnsafePathError(
                f"{what} {p} is owned by another user ({_describe(st)}); `chown "
                f"{os.geteuid()} {real}` if it is yours, else replace it")
        if st.st_mode & 0o066:
            raise UnsafePathError(
                f"{what} {p} can be read or written by group or other ({_describe(st)}); "
                f"`chmod 600 {real}` (a Secret volume: defaultMode 0400), and replace the "
                f"key and certificate if others may have read it")
        return f.read()


def write_ready_file(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to the ready file ``path`` without following a symbolic link and
    without truncating a file another user owns (a link planted at a predictable path
    would otherwise have the service overwrite its target).

    Raises:
        UnsafePathError: for a link or another user's file.
    """
    fd = open_nofollow(path, os.O_WRONLY | os.O_CREAT, "ready file", 0o644)
    with os.fdopen(fd, "w") as f:
        f.truncate(0)
        f.write(text)


def default_runtime_dir(euid: int | None = None,
                        env: Mapping[str, str] | None = None) -> str:
    """Where the default config puts runtime files (the shm socket): ``/run/ctxmem`` as
    root; else ``$XDG_RUNTIME_DIR/ctxmem``, else ``/run/user/UID/ctxmem`` if
    ``/run/user/UID`` exists, else ``run`` under :func:`default_state_dir`."""
    uid = os.geteuid() if euid is None else euid
    e = os.environ if env is None else env
    if uid == 0:
        return "/run/ctxmem"
    xdg = e.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg):
        return os.path.join(xdg, "ctxmem")
    if os.path.isdir(f"/run/user/{uid}"):
        return f"/run/user/{uid}/ctxmem"
    return os.path.join(default_state_dir(uid, e), "run")


def default_state_dir(euid: int | None = None, env: Mapping[str, str] | None = None) -> str:
    """Where the default config puts state (flash file, master key): ``/var/lib/ctxmem`` as
    root; else ``$XDG_STATE_HOME/ctxmem``, else ``~/.local/state/ctxmem``."""
    uid = os.geteuid() if euid is None else euid
    e = os.environ if env is None else env
    if uid == 0:
        return "/var/lib/ctxmem"
    xdg = e.get("XDG_STATE_HOME", "")
    if xdg and os.path.isabs(xdg):
        return os.path.join(xdg, "ctxmem")
    home = e.get("HOME", "")
    if not home or not os.path.isabs(home):
        import pwd
        home = pwd.getpwuid(uid).pw_dir
    return str(Path(home) / ".local" / "state" / "ctxmem")
