"""``ctxmem check``'s operator actions on a device's superblock: rebuilding a lost pair
from the slab headers (``--repair``) and formatting a device on purpose (``--format``).

The service formats only a blank device by itself (no valid superblock and no slab
header); a device whose two superblock copies are both damaged but which holds records
is refused at start, and this module is how the operator gets it back: each slab header
written since the slab-header extension existed carries the device UUID, slab size and
slab count (see :mod:`ctxmem_common.flash_format`), so the superblock, UUID included
(the XTS tweak of every encrypted record depends on it), is rebuilt exactly.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
import uuid
from collections import Counter

from ctxmem_common import safepaths
from ctxmem_common.config import Config
from ctxmem_common.errors import CtxmemError
from ctxmem_common.flash_format import (
    DATA_START,
    SB_OFFSET,
    SECTOR,
    FlashReader,
    SlabHeader,
    Superblock,
    slab_base,
)
from ctxmem_common.units import parse_size
from ctxmem_dpu.tiers.flash_owner import describe, stale_reason


def open_device(name: str, path: str, flags: int) -> int:
    """Open flash device ``name`` at ``path`` with ``flags`` the way the service does: a
    symbolic link, or a regular file owned by another non-root user (whatever its mode),
    is refused (:func:`ctxmem_common.safepaths.check_flash_path`, then ``O_NOFOLLOW`` and
    an owner check on the open descriptor, so a file swapped in between is refused too).
    Block devices are not owner-checked, as in the service.

    Raises:
        safepaths.UnsafePathError: naming the path, what was found and the fix.
        OSError: any other failure of the open.
    """
    safepaths.check_flash_path(path, name)
    return safepaths.open_nofollow(path, flags, f"flash device {name!r}:")


def refuse_if_owned(fd: int, path: str, size: int) -> None:
    """Raise OSError (EBUSY) when the device's owner record names a live service (one
    that may have it open through another path, e.g. a loop device over this file)."""
    if size < DATA_START:
        return
    rec = FlashReader(fd).owner()
    if rec is not None and not stale_reason(rec, FlashReader(fd).owner):
        raise OSError(errno.EBUSY, f"{path} is in use by {describe(rec)}; stop it first")


def rebuild(found: list[tuple[int, int, SlabHeader]], size: int
            ) -> tuple[Superblock, bool, str]:
    """The superblock the slab headers ``found`` (``FlashReader.find_slab_headers``)
    describe: (superblock, whether its UUID is the device's own, what it is based on).

    The geometry most headers' extensions agree on wins. Without any extension (headers
    written before it existed) the slab size is the one the headers were found at, the
    slab count what fits in ``size``, and the UUID a new one: encrypted records cannot be
    decrypted under it (they are left alone, never invalidated)."""
    votes = Counter(sb for _slab, _size, h in found if (sb := h.superblock()) is not None)
    if votes:
        sb, n = votes.most_common(1)[0]
        return sb, True, (f"{n} of {len(found)} slab headers give UUID "
                          f"{uuid.UUID(bytes=sb.device_uuid)}, {sb.num_slabs} slabs of "
                          f"{sb.slab_size} bytes")
    slab_size = found[0][1]
    sb = Superblock.new(slab_size, size)
    return sb, False, (f"{len(found)} slab headers of {slab_size}-byte slabs carry no device "
                       f"UUID (written by an older version): a new UUID, so encrypted "
                       f"records stay unreadable (not invalidated)")


def write_pair(fd: int, sb: Superblock) -> None:
    """Write both superblock copies and sync them."""
    os.pwrite(fd, sb.pack_pair(), SB_OFFSET)
    os.fsync(fd)


def format_device(name: str, path: str, slab_size: int) -> str:
    """Format ``path`` as a new, empty device of ``slab_size`` slabs: every slab header
    that can be found is zeroed (so no record comes back), then a new superblock pair is
    written. Discards every record on it. Refused (OSError EBUSY) while a service has it, and
    (UnsafePathError) for a link or another user's file (:func:`open_device`).
    Returns a line saying what was done."""
    if slab_size < 2 * SECTOR or slab_size % SECTOR:
        raise OSError(errno.EINVAL, f"{name}: slab size {slab_size} is not a multiple of "
                                    f"4096 of at least 8 KiB")
    fd = open_device(name, path, os.O_RDWR)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise OSError(errno.EBUSY, f"{name}: {path} is in use (a running ctxmem "
                                       f"service?); stop it before --format") from None
        size = os.lseek(fd, 0, os.SEEK_END)
        refuse_if_owned(fd, path, size)
        if size < DATA_START + slab_size:
            raise OSError(errno.ENOSPC, f"{name}: {path} has {size} bytes; formatting it "
                                        f"needs at least {DATA_START + slab_size}")
        reader = FlashReader(fd)
        found = reader.find_slab_headers(size, [slab_size])
        sb = reader.superblocks().current
        if sb is not None:  # the old geometry's slabs too
            found += [(s, sb.slab_size, h) for s in range(sb.num_slabs)
                      if (h := reader.slab_header(s, sb.slab_size)) is not None]
        for slab, size_of, _h in found:
            os.pwrite(fd, bytes(SECTOR), slab_base(slab, size_of))
        new = Superblock.new(slab_size, size)
        write_pair(fd, new)
        return (f"{name}: formatted {path}: {new.num_slabs} slabs of {slab_size} bytes, "
                f"UUID {uuid.UUID(bytes=new.device_uuid)}; {len(found)} slab headers "
                f"(and their records) discarded")
    finally:
        os.close(fd)


def format_command(devices: list[tuple[str, str]], slab_size: str | None,
                    cfg: Config | None) -> int:
    """``ctxmem check --format``: only devices named with ``--device`` (never the whole
    config by accident). Exit status 0 formatted, 8 refused or failed."""
    if not devices:
        print("ctxmem check: --format needs --device NAME=PATH (each device to format)",
              file=sys.stderr)
        return 8
    try:
        size = (parse_size(slab_size, "--slab-size") if slab_size is not None
                else cfg.flash.slab_size if cfg is not None else 0)
    except (ValueError, CtxmemError) as exc:
        print(f"ctxmem check: {exc}", file=sys.stderr)
        return 8
    if not size:
        print("ctxmem check: --format needs --slab-size SIZE (or --config)", file=sys.stderr)
        return 8
    for name, path in devices:
        try:
            print(format_device(name, path, size))
        except (OSError, CtxmemError) as exc:
            print(f"ctxmem check: not formatted: {exc}", file=sys.stderr)
            return 8
    return 0
