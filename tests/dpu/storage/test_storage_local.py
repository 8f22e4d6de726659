"""`local` backend, for real: files in tmp_path, O_DIRECT, errors with remedies."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import pytest
from storage_backend_suite import BackendTests, MakeBackend

from ctxmem_dpu.storage import StorageError, open_backend, parse_device_spec
from ctxmem_dpu.storage.local import LocalBackend

W = "flash.devices[0]"


def local(path: Path, **extra: object) -> LocalBackend:
    spec = parse_device_spec({"name": "f0", "backend": "local", "path": str(path), **extra}, W)
    backend = open_backend(spec)
    assert isinstance(backend, LocalBackend)
    return backend


def test_create_sparse_file_and_round_trip_o_direct(tmp_path: Path) -> None:
    path = tmp_path / "flash.img"
    with local(path, size="16MiB", create=True) as dev:
        assert dev.attach() == str(path)
        assert dev.size_bytes == 16 << 20 and dev.is_healthy()
        st = path.stat()
        assert st.st_size == 16 << 20
        assert st.st_blocks * 512 < st.st_size  # sparse
        assert st.st_mode & 0o777 == 0o600
        buf = mmap.mmap(-1, 1 << 20)
        buf.write(os.urandom(1 << 20))
        back = mmap.mmap(-1, 1 << 20)
        fd = os.open(dev.attach(), os.O_RDWR | os.O_DIRECT)
        try:
            assert os.pwritev(fd, [buf], 4 << 20) == 1 << 20
            assert os.preadv(fd, [back], 4 << 20) == 1 << 20
        finally:
            os.close(fd)
        assert back[:] == buf[:]
    assert not dev.is_healthy() and dev.path is None
    assert path.exists()  # detach never deletes data


def test_attach_is_idempotent_and_keeps_data(tmp_path: Path) -> None:
    path = tmp_path / "flash.img"
    first = local(path, size="4MiB", create=True)
    first.attach()
    path.write_bytes(b"x" * 4096 + b"\0" * ((4 << 20) - 4096))
    again = local(path, size="4MiB", create=True)  # e.g. after a service restart
    assert again.attach() == first.attach() == str(path)
    assert path.read_bytes()[:4096] == b"x" * 4096


def test_existing_smaller_file_grows_only_with_create(tmp_path: Path) -> None:
    path = tmp_path / "flash.img"
    path.write_bytes(b"\0" * (2 << 20))
    with pytest.raises(StorageError, match=r"holds 2MiB .* configured as 4MiB") as info:
        local(path, size="4MiB").attach()
    assert "lower `size`" in info.value.remedy
    dev = local(path, size="4MiB", create=True)
    dev.attach()
    assert path.stat().st_size == 4 << 20 and dev.size_bytes == 4 << 20


def test_size_defaults_to_the_whole_file_aligned_down(tmp_path: Path) -> None:
    path = tmp_path / "flash.img"
    path.write_bytes(b"\0" * ((3 << 20) + 1000))
    dev = local(path)
    dev.attach()
    assert dev.size_bytes == 3 << 20


def test_missing_file_names_path_and_remedy(tmp_path: Path) -> None:
    path = tmp_path / "nope.img"
    with pytest.raises(StorageError) as info:
        local(path, size="8MiB").attach()
    err = info.value
    assert str(path) in str(err) and "does not exist" in str(err)
    assert "create: true" in err.remedy and err.errno == errno.ENOENT
    assert str(err).endswith("Remedy: " + err.remedy)


def test_missing_parent_directory_is_created_private(tmp_path: Path) -> None:
    """With create: true a missing directory is created 0700 (issue 12: it holds cached
    data; ctxmem_common.safepaths); an existing one others can write is refused."""
    from ctxmem_common.safepaths import UnsafePathError

    path = tmp_path / "a" / "b.img"
    local(path, size="8MiB", create=True).attach()
    assert (path.parent.stat().st_mode & 0o777) == 0o700
    assert (path.stat().st_mode & 0o777) == 0o600
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafePathError, match=f"{shared} is writable by group or other"):
        local(shared / "b.img", size="8MiB", create=True).attach()


def test_directory_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="neither a block device nor a regular file"):
        local(tmp_path).attach()


def test_o_direct_einval_says_filesystem_lacks_o_direct(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tmpfs on this kernel (6.18) accepts O_DIRECT, so EINVAL is injected at os.open."""
    path = tmp_path / "flash.img"
    path.write_bytes(b"\0" * (1 << 20))
    real_open = os.open

    def fake_open(p: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *args)

    monkeypatch.setattr(os, "open", fake_open)
    with pytest.raises(StorageError) as info:
        local(path).attach()
    assert "does not support O_DIRECT" in str(info.value) and "tmpfs" in str(info.value)
    assert "ext4 or xfs" in info.value.remedy and info.value.errno == errno.EINVAL


@pytest.mark.parametrize(("err", "remedy"), [
    (errno.EACCES, "read/write access"), (errno.EROFS, "read-only"),
    (errno.EBUSY, "held exclusively"),
])
def test_open_errors_carry_errno_and_remedy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, remedy: str) -> None:
    """Injected: these tests run as root, which bypasses file permissions."""
    path = tmp_path / "flash.img"
    path.write_bytes(b"\0" * (1 << 20))

    def fake_open(p: str, flags: int, *args: int) -> int:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, "open", fake_open)
    with pytest.raises(StorageError, match=f"errno {err}") as info:
        local(path).attach()
    assert remedy in info.value.remedy and info.value.errno == err


def test_size_before_attach_raises(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="not attached"):
        _ = local(tmp_path / "x.img").size_bytes


def test_health_notices_a_deleted_or_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "flash.img"
    dev = local(path, size="2MiB", create=True)
    dev.attach()
    os.truncate(path, 1 << 20)
    assert not dev.is_healthy()
    path.unlink()
    assert not dev.is_healthy()
    assert not dev.offloads_encryption


class TestLocalBackend(BackendTests):
    """The shared backend suite on a real sparse file."""

    @pytest.fixture
    def make(self, tmp_path: Path) -> MakeBackend:
        raw = {"name": "flash0", "backend": "local", "path": str(tmp_path / "flash0.img"),
               "size": "4MiB", "create": True}
        return lambda: open_backend(parse_device_spec(raw, "flash.devices[0]"))


def _formatted(path: Path, size: int) -> None:
    """A file holding a ctxmem superblock pair (as a service leaves it)."""
    from ctxmem_common.flash_format import Superblock

    with open(path, "wb") as f:
        f.truncate(size)
        f.write(Superblock.new(1 << 20, size).pack_pair())


def test_a_formatted_file_is_never_grown(tmp_path: Path) -> None:
    path = tmp_path / "flash.img"
    _formatted(path, 2 << 20)
    with pytest.raises(StorageError, match=r"'f0': .* holds 2MiB of ctxmem records but "
                                           r"`size` is 4MiB") as info:
        local(path, size="4MiB", create=True).attach()
    assert "docs/storage.md" in info.value.remedy and info.value.errno == errno.EEXIST
    assert path.stat().st_size == 2 << 20


def test_a_file_with_slab_headers_but_no_superblock_is_never_grown(tmp_path: Path) -> None:
    from ctxmem_common.flash_format import DATA_START, SlabHeader, slots_per_slab

    path = tmp_path / "flash.img"
    with open(path, "wb") as f:
        f.truncate(3 << 20)
        f.seek(DATA_START)
        f.write(SlabHeader(65536, slots_per_slab(1 << 20, 65536)).pack())
    with pytest.raises(StorageError, match="ctxmem records"):
        local(path, size="8MiB", create=True).attach()
    assert path.stat().st_size == 3 << 20


def test_a_locked_file_is_not_grown(tmp_path: Path) -> None:
    import fcntl

    path = tmp_path / "flash.img"
    path.write_bytes(bytes(2 << 20))
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(StorageError, match=r"'f0' .* is in use by another process") \
                as info:
            local(path, size="4MiB", create=True).attach()
        assert info.value.errno == errno.EBUSY
    finally:
        os.close(fd)
    assert path.stat().st_size == 2 << 20


def test_a_file_with_a_live_owner_record_is_not_grown(tmp_path: Path) -> None:
    from ctxmem_dpu.tiers.flash_owner import DeviceOwner

    path = tmp_path / "flash.img"
    path.write_bytes(bytes(2 << 20))
    fd = os.open(path, os.O_RDWR)
    owner = DeviceOwner("flash0", str(path))  # as a service on a loop device over the file
    try:
        owner.claim(fd, 2 << 20)
        with pytest.raises(StorageError, match=r"'f0' .* is in use by service") as info:
            local(path, size="4MiB", create=True).attach()
        assert info.value.errno == errno.EBUSY
    finally:
        owner.release(fd)
        os.close(fd)
    assert path.stat().st_size == 2 << 20
