"""Which tenant owns each namespace, kept across restarts (issue 25; docs/security.md,
"Quotas and fair eviction").

A record on flash names its namespace by digest only (``sha256(tenant, model, layout,
tags)``: the tenant cannot be read back from it). Without more, blocks recovered at a
restart belong to no tenant until a session of their tenant opens the namespace again:
they count against nobody's flash quota and no configured guarantee protects them, so
another tenant's puts could evict them first.

So the service appends ``DIGEST TENANT`` (both hex) to a small file the first time a
namespace is opened, and reads it back at start: recovered blocks are charged to their
tenant from the start. The mapping is a fact (the digest is a hash of the tenant), so a
line is never rewritten, only appended (``O_APPEND``, one ``write`` per line: services
of a pod that share the file cannot interleave a line) and dropped at a start when its
namespace has no block left. It is a hint for accounting, never for access: a missing or
damaged file only leaves blocks unattributed until their tenant comes back, as before.

Where: ``PATH.tenants`` next to the first ``local`` flash device whose ``path`` is a
regular file and that is not a pod's shared device (the service's state directory in the
default config); a config whose devices are all block devices, SPDK bdevs or shared keeps
none. Opened through
:mod:`ctxmem_common.safepaths` (no symbolic link, no other user's file), created 0600.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Iterable

from ctxmem_common import safepaths
from ctxmem_common.config import Config

log = logging.getLogger("ctxmem_dpu.store")

#: Suffix added to the flash file's path.
SUFFIX = ".tenants"
#: Lines longer than this are ignored (a tenant name is at most a few hundred bytes).
_MAX_LINE = 4096


def default_path(cfg: Config) -> str | None:
    """Where the file lives for ``cfg`` (None: no local flash file to put it next to)."""
    for d in cfg.flash.devices:
        if d.backend != "local" or not d.path or d.shared:
            continue
        path = os.path.abspath(d.path)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            return path + SUFFIX
    return None


class NamespaceTenants:
    """The persisted digest -> tenant map (see the module doc)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.known: dict[bytes, str] = {}

    def load(self, keep: Iterable[bytes]) -> dict[bytes, str]:
        """Read the file; keep the namespaces in ``keep`` (those with blocks after the
        rebuild) and rewrite it with only those. Returns the map (also ``known``)."""
        if self.path is None:
            return self.known
        found: dict[bytes, str] = {}
        try:
            fd = safepaths.open_nofollow(self.path, os.O_RDONLY, "namespace tenants file")
        except FileNotFoundError:
            fd = -1
        except OSError as exc:  # accounting only, not fatal (an unsafe path, a link or
            # another user's file, is not an OSError: UnsafePathError, the store does not
            # start on it, as for its other files)
            log.warning("namespace tenants file %s not read (%s); blocks recovered from "
                        "flash count under no tenant until their namespace is opened",
                        self.path, exc)
            self.path = None
            return self.known
        if fd >= 0:
            with os.fdopen(fd, "rb") as f:
                for line in f:
                    parsed = _parse(line)
                    if parsed is not None:
                        found[parsed[0]] = parsed[1]
        wanted = set(keep)
        self.known = {d: t for d, t in found.items() if d in wanted}
        if fd >= 0 and len(self.known) == len(found):
            return self.known
        self._rewrite()
        return self.known

    def record(self, digest: bytes, tenant: str) -> None:
        """``tenant`` opened namespace ``digest``: append it if not known yet."""
        if self.known.get(digest) == tenant:
            return
        self.known[digest] = tenant
        if self.path is None:
            return
        try:
            fd = safepaths.open_nofollow(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                                         "namespace tenants file", 0o600)
            try:
                os.write(fd, _line(digest, tenant))
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("namespace tenants file %s: cannot append (%s); this namespace's "
                        "blocks will count under no tenant after a restart until it is "
                        "opened again", self.path, exc)

    def _rewrite(self) -> None:
        assert self.path is not None
        tmp = self.path + ".new"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        try:
            fd = safepaths.open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                         "namespace tenants file", 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(b"".join(_line(d, t) for d, t in self.known.items()))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("namespace tenants file %s: cannot rewrite (%s)", self.path, exc)


def _line(digest: bytes, tenant: str) -> bytes:
    return f"{digest.hex()} {tenant.encode().hex()}\n".encode()


def _parse(line: bytes) -> tuple[bytes, str] | None:
    if len(line) > _MAX_LINE:
        return None
    parts = line.split()
    if len(parts) != 2:
        return None
    try:
        digest = bytes.fromhex(parts[0].decode("ascii"))
        tenant = bytes.fromhex(parts[1].decode("ascii")).decode()
    except (ValueError, UnicodeDecodeError):
        return None
    if len(digest) != 16 or not tenant:
        return None
    return digest, tenant
