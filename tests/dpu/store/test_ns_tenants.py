"""``store/ns_tenants.py``: the namespace -> tenant file, byte for byte: one appended line
per namespace opened for the first time, read back at start keeping only the namespaces
that still have blocks (the file rewritten then), damaged lines ignored, and a symbolic link
refused (the store does not start on it), its target left as it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ctxmem_common.safepaths import UnsafePathError
from ctxmem_dpu.store.ns_tenants import NamespaceTenants, default_path

from ..storekit import store_config

A, B, C = (bytes([i]) * 16 for i in (1, 2, 3))


def _line(digest: bytes, tenant: str) -> bytes:
    return f"{digest.hex()} {tenant.encode().hex()}\n".encode()


def test_first_opens_append_one_line_each(tmp_path: Path) -> None:
    path = tmp_path / "flash.img.tenants"
    nt = NamespaceTenants(str(path))
    nt.record(A, "team-a")
    nt.record(B, "téam-b")  # any name: stored as hex of its UTF-8
    nt.record(A, "team-a")  # known: nothing appended
    assert path.read_bytes() == _line(A, "team-a") + _line(B, "téam-b")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert nt.known == {A: "team-a", B: "téam-b"}


def test_a_start_keeps_the_namespaces_with_blocks_and_skips_damage(tmp_path: Path) -> None:
    path = tmp_path / "flash.img.tenants"
    path.write_bytes(_line(A, "a") + b"not a line\n" + _line(B, "b") + b"zz 61\n"
                     + _line(C, "c")[:-8] + b"\n" + b"ab" * 3000 + b"\n" + _line(A[:8], "short")
                     + _line(C, "") + _line(C, "c"))
    nt = NamespaceTenants(str(path))
    assert nt.load([A, C]) == {A: "a", C: "c"}
    assert path.read_bytes() == _line(A, "a") + _line(C, "c")  # rewritten: only those
    before = path.stat().st_ino  # a rewrite replaces the file (a new inode)
    assert NamespaceTenants(str(path)).load([A, C]) == {A: "a", C: "c"}
    assert path.stat().st_ino == before  # nothing to drop: not rewritten
    assert NamespaceTenants(str(path)).load([C]) == {C: "c"}
    assert path.stat().st_ino != before and path.read_bytes() == _line(C, "c")


def test_a_symlinked_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(_line(A, "a"))
    link = tmp_path / "flash.img.tenants"
    link.symlink_to(target)
    with pytest.raises(UnsafePathError, match=r"namespace tenants file .*flash\.img\.tenants "
                                              r"is a symbolic link"):
        NamespaceTenants(str(link)).load([A])
    assert target.read_bytes() == _line(A, "a")
    assert link.is_symlink()


def test_the_file_sits_beside_the_first_local_regular_flash_file(tmp_path: Path) -> None:
    img = tmp_path / "flash0.img"
    img.write_bytes(b"")
    os.symlink(img, tmp_path / "alias.img")
    devices = [{"name": "s", "backend": "local", "path": str(tmp_path / "missing.img")},
               {"name": "l", "backend": "local", "path": str(tmp_path / "alias.img")},
               {"name": "f", "backend": "local", "path": str(img)}]
    cfg = store_config(flash={"devices": devices})
    assert default_path(cfg) == str(img) + ".tenants"
    assert default_path(store_config(flash={"devices": devices[:2]})) is None
