"""Staging regions (service-owned memory a client puts from) against hostile clients, on
the real service (issue 27 item 1; docs/security.md, "Staging regions").

A client holds a staging region's memfd and its own mapping, so it can write the region
while the service copies, unmap or close it, try to resize it, name offsets outside it
or over its header, name another session's or tenant's region, and create regions until
memory runs out. Each must end in a refusal or a miss with a clear error, never a wrong
byte stored or served, and nothing already stored lost.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import threading
from collections.abc import Callable

import numpy as np
import pytest

import ctxmem
from ctxmem.staging import StagingRegion
from ctxmem.transport.shm import ShmChannel
from ctxmem_common import staging_wire
from ctxmem_common.codecs import crc32c
from ctxmem_common.errors import InvalidArgument, ResourceExhausted
from ctxmem_common.wire import (
    SHM_OP,
    SHM_OP_REPLY,
    SHM_OP_STAGE_CREATE,
    SHM_OP_STAGE_PUT,
    TCP_NO_ID,
    TCP_OP,
    TCP_OP_REPLY,
    Status,
)
from tests.adversary.raw import RawSession
from tests.adversary.shm_raw import shm_connect
from tests.adversary.sockets import recv_exact
from tests.conftest import ServiceHandle
from tests.kit import byte_layout, salted_keys

BLOCK = 64 << 10
LAYOUT = byte_layout(BLOCK)
HDR = staging_wire.HEADER_BYTES


@pytest.fixture
def svc(service_factory: Callable[..., ServiceHandle]) -> ServiceHandle:
    return service_factory(encryption=False, flash_size=None,
                           data_plane={"read_timeout_s": 2.0},
                           quotas={"default": {"staging_max_bytes": "4MiB"}})


def _get(ns: ctxmem.Namespace, keys: list[bytes]) -> list[np.ndarray | None]:
    """Each key's block (verified get, one key at a time), or None for a miss."""
    out: list[np.ndarray | None] = []
    for k in keys:
        buf = np.zeros(BLOCK, np.uint8)
        out.append(buf if ns.get([k], [buf]) == 1 else None)
    return out


def _raw_create(r: RawSession, nbytes: int) -> tuple[staging_wire.Created, int]:
    assert isinstance(r.data, ShmChannel)
    body, fd = r.data.call_with_fd(SHM_OP_STAGE_CREATE, [staging_wire.encode_create(nbytes)])
    return staging_wire.decode_create_reply(body), fd


def _raw_put(r: RawSession, region_id: int, keys: list[bytes], offsets: list[int],
             lengths: list[int] | None = None, crcs: list[int] | None = None
             ) -> staging_wire.PutOutcome:
    assert isinstance(r.data, ShmChannel)
    lens = lengths if lengths is not None else [r.block_nbytes] * len(keys)
    body = r.data.call(SHM_OP_STAGE_PUT, staging_wire.encode_put(
        r.handle, region_id, b"".join(keys), len(keys[0]), offsets, lens, crcs))
    return staging_wire.decode_put_reply(body, len(keys))


def test_a_staged_put_stores_exact_bytes_in_one_call(svc: ServiceHandle) -> None:
    """The shim's API: blocks filled in the region, one put, exact bytes back; with CRCs
    declared, a wrong one is refused (not stored), the rest stored; a key already stored
    is not copied again."""
    keys = salted_keys("exact", 6)
    with ctxmem.Client(svc.endpoint, transport="shm") as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        before = svc.stats()
        with c.staging(6 * BLOCK) as region:
            assert region.nbytes >= 6 * BLOCK and not region.hugepages
            buf = region.array()
            blocks = [np.full(BLOCK, 10 + i, np.uint8) for i in range(6)]
            for i, b in enumerate(blocks):
                buf[i * BLOCK:(i + 1) * BLOCK] = b
            r = region.put(ns, keys[:3], [0, BLOCK, 2 * BLOCK])
            assert (r.stored, r.existing, r.refused) == (3, 0, [])
            crcs = [crc32c(b) for b in blocks[3:]]
            crcs[1] ^= 1  # key 4's declared CRC is wrong
            r = region.put(ns, keys[2:], [2 * BLOCK, 3 * BLOCK, 4 * BLOCK, 5 * BLOCK],
                           [crc32c(blocks[2]), *crcs])
            assert (r.stored, r.existing, r.refused) == (2, 1, [2])
        got = _get(ns, keys)
        for i in (0, 1, 2, 3, 5):
            assert got[i] is not None and np.array_equal(got[i], blocks[i]), i
        assert got[4] is None, "a block whose CRC differs from the declared one is stored"
        after = svc.stats()
        assert after["staging_put_blocks"] - before["staging_put_blocks"] == 6
        assert after["put_crc_mismatch"] - before["put_crc_mismatch"] == 1
        assert after["staging_regions_freed"] - before["staging_regions_freed"] == 1


def test_the_stored_bytes_are_the_copy_not_the_region(svc: ServiceHandle) -> None:
    """After the put the client overwrites, unmaps and closes its region: the stored
    block is the service's copy (and the service's own mapping outlives the client's)."""
    keys = salted_keys("own", 2)
    with ctxmem.Client(svc.endpoint, transport="shm") as c, \
            RawSession(svc.endpoint, LAYOUT, model_id="m") as raw:
        ns = c.open_namespace(LAYOUT, model_id="m")
        created, fd = _raw_create(raw, 2 * BLOCK)
        mm = __import__("mmap").mmap(fd, created.size)
        os.close(fd)
        mm[HDR:HDR + BLOCK] = b"\x41" * BLOCK
        out = _raw_put(raw, created.region_id, keys[:1], [HDR], crcs=[crc32c(b"\x41" * BLOCK)])
        assert out.stored == 1
        mm[HDR:HDR + BLOCK] = b"\x42" * BLOCK  # after the put: not the stored block's
        mm.close()  # unmapped, fd closed: only the service maps it now
        # The service still copies from its own mapping of the region.
        out = _raw_put(raw, created.region_id, keys[1:], [HDR])
        assert out.stored == 1
        got = _get(ns, keys)
        assert got[0] is not None and bytes(got[0]) == b"\x41" * BLOCK
        assert got[1] is not None and bytes(got[1]) == b"\x42" * BLOCK


def test_a_region_cannot_be_resized_and_a_punched_hole_is_not_a_crash(
        svc: ServiceHandle) -> None:
    """The region's memfd is sealed against shrink and grow before the client gets it:
    ftruncate fails with EPERM either way. Punching a hole (fallocate, which the seals
    allow on shared memory) leaves the service whole: the copy reads zeros there, so a
    declared CRC of the old bytes refuses the block."""
    keys = salted_keys("seal", 2)
    with RawSession(svc.endpoint, LAYOUT, model_id="m") as raw:
        created, fd = _raw_create(raw, 2 * BLOCK)
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            assert seals & want == want
            for size in (0, created.size // 2, created.size * 2):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, size)
            assert os.fstat(fd).st_size == created.size
            os.pwrite(fd, b"\x33" * BLOCK, HDR)
            libc = ctypes.CDLL(None, use_errno=True)
            punch = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
            assert libc.fallocate(fd, punch, ctypes.c_long(HDR), ctypes.c_long(BLOCK)) == 0, \
                os.strerror(ctypes.get_errno())
        finally:
            os.close(fd)
        out = _raw_put(raw, created.region_id, keys[:1], [HDR],
                       crcs=[crc32c(b"\x33" * BLOCK)])
        assert (out.stored, out.refused) == (0, 1)
        lease = raw.acquire(keys[:1])
        assert len(lease.slots) == 0, "the refused block is a miss"
        out = _raw_put(raw, created.region_id, keys[1:], [HDR])  # the service still serves
        assert out.stored == 1
        lease = raw.acquire(keys[1:])
        assert raw.read(lease) == [bytes(BLOCK)]
        raw.release(lease)


BAD_ENTRIES = [
    pytest.param(lambda size: (0, BLOCK), "overlaps the region's 4096-byte header",
                 id="over-header"),
    pytest.param(lambda size: (HDR - 1, BLOCK), "overlaps the region's", id="header-tail"),
    pytest.param(lambda size: (size - BLOCK + 1, BLOCK), "lies outside", id="past-end"),
    pytest.param(lambda size: (size, BLOCK), "lies outside", id="at-end"),
    pytest.param(lambda size: (2**64 - 4096, BLOCK), "lies outside", id="wraps"),
    pytest.param(lambda size: (HDR, BLOCK - 1), "this namespace's blocks are", id="short"),
    pytest.param(lambda size: (HDR, 2**64 - 1), "this namespace's blocks are", id="huge-len"),
]


@pytest.mark.parametrize(("entry", "says"), BAD_ENTRIES)
def test_entries_outside_the_region_or_over_its_header_are_refused(
        svc: ServiceHandle, entry: Callable[[int], tuple[int, int]], says: str) -> None:
    """One bad (offset, length) among good ones refuses the whole put before any copy:
    InvalidArgument naming the entry and the region; nothing stored, nothing lost."""
    keys = salted_keys("bounds", 3)
    with RawSession(svc.endpoint, LAYOUT, model_id="m") as raw:
        created, fd = _raw_create(raw, 2 * BLOCK)
        os.pwrite(fd, b"\x55" * BLOCK, HDR)
        os.close(fd)
        assert _raw_put(raw, created.region_id, keys[:1], [HDR]).stored == 1
        off, length = entry(created.size)
        with pytest.raises(InvalidArgument) as err:
            _raw_put(raw, created.region_id, keys[1:], [HDR, off], [BLOCK, length])
        assert f"region {created.region_id}: entry 1" in str(err.value) and says in str(
            err.value), err.value
        assert len(raw.acquire(keys[1:]).slots) == 0, "a refused put stored something"
        lease = raw.acquire(keys[:1])
        assert raw.read(lease) == [b"\x55" * BLOCK]
        raw.release(lease)


def test_another_sessions_or_tenants_region_is_refused(svc: ServiceHandle) -> None:
    """Session B (same tenant) and session C (another tenant) name A's region id, a freed
    id and one never issued: each is refused with the same message (nothing says whose
    it is), and A's region and blocks are untouched."""
    keys = salted_keys("foreign", 2)
    with RawSession(svc.endpoint, LAYOUT, model_id="m") as a, \
            RawSession(svc.endpoint, LAYOUT, model_id="m") as b, \
            RawSession(svc.endpoint, LAYOUT, model_id="m", tenant="other") as c:
        created, fd = _raw_create(a, BLOCK)
        os.pwrite(fd, b"\x66" * BLOCK, HDR)
        os.close(fd)
        freed, fd2 = _raw_create(a, BLOCK)
        os.close(fd2)
        assert isinstance(a.data, ShmChannel)
        a.data.call(8, [staging_wire.encode_free(freed.region_id)])  # STAGE_FREE
        for who in (b, c):
            for rid in (created.region_id, freed.region_id, 10**6):
                with pytest.raises(InvalidArgument) as err:
                    _raw_put(who, rid, keys[:1], [HDR])
                assert f"staging region {rid} is not a region of session " \
                       f"{who.session_id.hex()}" in str(err.value), err.value
                assert "Client.staging()" in str(err.value)
        with pytest.raises(InvalidArgument, match="not a region of session"):
            _raw_put(a, freed.region_id, keys[:1], [HDR])  # freed: A's own, still refused
        assert _raw_put(a, created.region_id, keys[:1], [HDR]).stored == 1
        lease = a.acquire(keys[:1])
        assert a.read(lease) == [b"\x66" * BLOCK]
        a.release(lease)


def test_regions_count_in_the_tenants_quota_and_close_releases_them(
        svc: ServiceHandle) -> None:
    """quotas.default.staging_max_bytes is 4 MiB here: regions up to it are made, the
    next is refused with the quota's name and what to do; closing a region, or the
    client (its session), gives the room back; another tenant has its own."""
    with ctxmem.Client(svc.endpoint, transport="shm") as c:
        first = c.staging(3 << 20)
        with pytest.raises(ResourceExhausted) as err:
            c.staging(1 << 20)
        msg = str(err.value)
        assert "quota staging_max_bytes" in msg and "tenant 'default'" in msg, msg
        assert "StagingRegion.close" in msg and str(4 << 20) in msg, msg
        other = c.staging(3 << 20, tenant="other")  # another tenant's quota
        first.close()
        second = c.staging(3 << 20)  # the room came back
        other.close()
    before = svc.stats()["staging_regions_freed"]
    assert second.closed is False  # the client closed, not the region object ...
    with ctxmem.Client(svc.endpoint, transport="shm") as c2:
        # ... but its session ended on the service, which freed the region with it.
        c2.staging(3 << 20).close()
    assert svc.stats()["staging_regions_freed"] >= before + 1
    second.close()  # the session is gone: a no-op on the service, unmapped here


def test_writes_while_the_service_copies_never_store_a_wrong_byte(
        svc: ServiceHandle) -> None:
    """A thread of the client flips its staging blocks between two patterns while it puts
    them (a bounded number of flips). Whatever the interleaving: with CRCs declared, a
    block is stored only if the bytes the service copied are the declared ones (its
    fused CRC), else refused, and a get returns exactly those bytes or misses; without
    CRCs, each stored block is served as stored (its CRC is of the bytes copied), every
    byte one of the two patterns."""
    n = 24
    a_blk, b_blk = b"\x11" * BLOCK, b"\x22" * BLOCK
    with ctxmem.Client(svc.endpoint, transport="shm") as c:
        ns = c.open_namespace(LAYOUT, model_id="race")
        with c.staging(n * BLOCK) as region:
            buf = region.array()
            buf[:] = 0x11
            stop = threading.Event()

            def flip() -> None:
                for i in range(20000):  # bounded
                    if stop.is_set():
                        return
                    buf[:] = 0x22 if i % 2 == 0 else 0x11

            writer = threading.Thread(target=flip, daemon=True)
            writer.start()
            try:
                with_crc = salted_keys("race-crc", n)
                r1 = region.put(ns, with_crc, [i * BLOCK for i in range(n)],
                                [crc32c(a_blk)] * n)
                no_crc = salted_keys("race-nocrc", n)
                r2 = region.put(ns, no_crc, [i * BLOCK for i in range(n)])
            finally:
                stop.set()
                writer.join(timeout=30)
        assert r1.stored + len(r1.refused) == n and r2.stored == n
        for i, got in enumerate(_get(ns, with_crc)):
            if i in r1.refused:
                assert got is None
            else:
                assert got is not None and bytes(got) == a_blk, i
        for got in _get(ns, no_crc):
            assert got is not None, "a stored block failed its own CRC"
            assert set(np.unique(got).tolist()) <= {0x11, 0x22}
        assert b_blk != a_blk


def test_staging_is_shared_memory_only(svc: ServiceHandle) -> None:
    """Over TCP the ops are answered UNSUPPORTED (a region's fd cannot cross it) and the
    shim says what to do."""
    with ctxmem.Client(svc.endpoint, transport="tcp") as c, \
            pytest.raises(InvalidArgument, match="shared-memory transport"):
        c.staging(BLOCK)
    with RawSession(svc.endpoint, LAYOUT, transport="tcp") as raw:
        from ctxmem.transport.tcp import TcpChannel

        assert isinstance(raw.data, TcpChannel)
        sock: socket.socket = raw.data._sock  # the raw frame
        body = staging_wire.encode_create(BLOCK)
        sock.sendall(TCP_OP.pack(b"CXTO", SHM_OP_STAGE_CREATE, TCP_NO_ID, 0, len(body)) + body)
        magic, status, op, length = TCP_OP_REPLY.unpack(recv_exact(sock, TCP_OP_REPLY.size))
        assert (magic, status, op, length) == (b"CXTP", Status.UNSUPPORTED,
                                               SHM_OP_STAGE_CREATE, 0)


def test_a_malformed_staging_frame_closes_the_connection(svc: ServiceHandle) -> None:
    """A STAGE_PUT whose counts disagree with its length is BAD_REQUEST, and closed."""
    with RawSession(svc.endpoint, LAYOUT) as raw:
        sock, status = shm_connect(raw.health.shm_socket, raw.session_id, raw.token)
        assert status == Status.OK
        body = struct.pack("<IIIII", raw.handle, 1, 0, 32, 5) + b"x" * 10
        sock.sendall(SHM_OP.pack(b"CXSO", SHM_OP_STAGE_PUT, len(body)) + body)
        _m, st, op, length = SHM_OP_REPLY.unpack(recv_exact(sock, SHM_OP_REPLY.size))
        assert (st, op) == (Status.BAD_REQUEST, SHM_OP_STAGE_PUT)
        recv_exact(sock, length)
        sock.settimeout(5)
        assert sock.recv(1) == b""
        # a bad create size is an error, not a close
        with pytest.raises(InvalidArgument, match="at least 1"):
            _raw_create(raw, 0)  # a bad size is an error answer, on the raw's own channel


def test_views_of_the_region_give_their_offsets(svc: ServiceHandle) -> None:
    """An engine that lays its blocks out in the region puts them by their views; a
    buffer that is not inside the region is refused before anything is sent."""
    keys = salted_keys("views", 2)
    with ctxmem.Client(svc.endpoint, transport="shm") as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        with c.staging(3 * BLOCK) as region:
            arr = region.array()
            views = [arr[2 * BLOCK:3 * BLOCK], region.data[0:BLOCK]]
            views[0][:] = 0x77
            views[1][:] = b"\x78" * BLOCK
            assert region.offsets_of(views) == [2 * BLOCK, 0]
            assert region.put(ns, keys, region.offsets_of(views)).stored == 2
            with pytest.raises(InvalidArgument, match="not a contiguous view inside"):
                region.offsets_of([np.zeros(BLOCK, np.uint8)])
            with pytest.raises(InvalidArgument, match="not a contiguous view inside"):
                region.offsets_of([arr[::2][:BLOCK]])
            del arr, views
        got = _get(ns, keys)
        assert got[0] is not None and bytes(got[0]) == b"\x77" * BLOCK
        assert got[1] is not None and bytes(got[1]) == b"\x78" * BLOCK


def test_a_region_object_is_bound_to_its_session(svc: ServiceHandle) -> None:
    """A region of tenant A's session cannot put into tenant B's namespace: the shim
    refuses before sending (the service would refuse too)."""
    with ctxmem.Client(svc.endpoint, transport="shm") as c:
        ns_b = c.open_namespace(LAYOUT, model_id="m", tenant="b")
        region: StagingRegion
        with c.staging(BLOCK) as region, pytest.raises(InvalidArgument,
                                                       match="belongs to session"):
            region.put(ns_b, salted_keys("bound", 1), [0])


def test_the_service_wide_cap_and_the_per_session_count(
        service_factory: Callable[..., ServiceHandle]) -> None:
    """``service.staging_max_bytes`` caps all tenants together (each under its own
    quota here), and a session holds at most MAX_REGIONS_PER_SESSION regions however
    small; both refusals say which limit and what to do; 0 turns staging off."""
    from ctxmem_dpu.store.staging import MAX_REGIONS_PER_SESSION

    svc = service_factory(encryption=False, flash_size=None,
                          service={"staging_max_bytes": "3MiB"})
    with ctxmem.Client(svc.endpoint, transport="shm") as c:
        a = c.staging(2 << 20, tenant="a")
        with pytest.raises(ResourceExhausted, match=r"service\.staging_max_bytes=3145728"):
            c.staging(2 << 20, tenant="b")
        a.close()
        c.staging(2 << 20, tenant="b").close()
        small = [c.staging(1) for _ in range(MAX_REGIONS_PER_SESSION)]
        with pytest.raises(ResourceExhausted,
                           match=f"holds {MAX_REGIONS_PER_SESSION} staging regions"):
            c.staging(1)
        for r in small:
            r.close()
        c.staging(1).close()
    off = service_factory(encryption=False, flash_size=None,
                          service={"staging_max_bytes": 0})
    with ctxmem.Client(off.endpoint, transport="shm") as c, \
            pytest.raises(InvalidArgument, match="staging regions are off"):
        c.staging(1)


def test_huge_pages_fall_back_to_normal_pages(
        service_factory: Callable[..., ServiceHandle]) -> None:
    """``service.staging_hugepages``: a region is backed by huge pages when the kernel's
    pool has them, else by normal pages (this host's pool is usually empty); either way
    the put works."""
    svc = service_factory(encryption=False, flash_size=None,
                          service={"staging_hugepages": True})
    with open("/proc/meminfo") as f:
        free_huge = next((int(line.split()[1]) for line in f
                          if line.startswith("HugePages_Free:")), 0)
    keys = salted_keys("huge", 1)
    with ctxmem.Client(svc.endpoint, transport="shm") as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        with c.staging(BLOCK) as region:
            if free_huge == 0:
                assert not region.hugepages
            if region.hugepages:
                assert region.size % (2 << 20) == 0
            region.array()[:BLOCK] = 0x5A
            assert region.put(ns, keys, [0]).stored == 1
        got = _get(ns, keys)
        assert got[0] is not None and bytes(got[0]) == b"\x5a" * BLOCK


def test_a_region_freed_during_a_put_is_unmapped_only_after_its_copy(
        svc: ServiceHandle) -> None:
    """The client sends a STAGE_PUT on one connection and, without waiting, frees the
    region on another connection of the same session. Whichever the service serves
    first: the put is stored whole from the service's own mapping, or refused as a
    region no longer the session's; never an internal error, never a wrong byte; the
    region is gone afterwards."""
    n = 48
    keys = salted_keys("freed", n)
    with RawSession(svc.endpoint, LAYOUT, model_id="m") as raw:
        created, fd = _raw_create(raw, n * BLOCK)
        os.pwrite(fd, b"\x4d" * (n * BLOCK), HDR)
        os.close(fd)
        sock, status = shm_connect(raw.health.shm_socket, raw.session_id, raw.token)
        assert status == Status.OK
        body = b"".join(staging_wire.encode_put(
            raw.handle, created.region_id, b"".join(keys), 32,
            [HDR + i * BLOCK for i in range(n)], [BLOCK] * n, None))
        sock.sendall(SHM_OP.pack(b"CXSO", SHM_OP_STAGE_PUT, len(body)) + body)
        assert isinstance(raw.data, ShmChannel)
        raw.data.call(8, [staging_wire.encode_free(created.region_id)])  # STAGE_FREE
        _m, st, _op, length = SHM_OP_REPLY.unpack(recv_exact(sock, SHM_OP_REPLY.size))
        reply = recv_exact(sock, length)
        sock.close()
        if st == Status.OK:
            assert staging_wire.decode_put_reply(reply, n).stored == n
            lease = raw.acquire(keys)
            assert raw.read(lease) == [b"\x4d" * BLOCK] * n
            raw.release(lease)
        else:
            from ctxmem_common.shm_ops import decode_error

            assert st == Status.ERROR, st
            err = decode_error(reply)
            assert isinstance(err, InvalidArgument) and "not a region of session" in str(
                err), err
            assert len(raw.acquire(keys).slots) == 0
        with pytest.raises(InvalidArgument, match="not a region of session"):
            _raw_put(raw, created.region_id, keys[:1], [HDR])
