"""Shared memory that clients cannot break (issue 12, item 3), against the real service.

Each test is an attack a same-host client can mount on the shared-memory data plane:
resizing the slab memfd it was handed (the service would die of SIGBUS), sending MAPs and
never reading the replies (the event loop would block in sendmsg), mapping a slab of
another namespace of its own tenant (``cache_salt`` separation), connecting as a uid the
operator did not allow.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import ctxmem
from ctxmem.transport.base import TransportError
from ctxmem_common.codecs import crc32c
from ctxmem_common.wire import SHM_HELLO, SHM_MAP, Status
from tests.adversary.raw import RawSession
from tests.adversary.shm_raw import run_in_child, shm_connect, shm_map
from tests.conftest import ServiceHandle
from tests.kit import blocks, model_layout, until

LAYOUT = model_layout()
SMALL = {"dram_size": "32MiB", "dram_slab": "4MiB", "flash_size": "64MiB",
         "flash_slab": "4MiB"}


def _read_to_eof(sock: socket.socket) -> bool:
    """One read of ``sock``: whether the service has closed it (end of file or reset)."""
    try:
        return not sock.recv(65536)
    except ConnectionResetError:
        return True


def _roundtrip(client: ctxmem.Client, seed: int, n: int = 8) -> None:
    """Put ``n`` fresh blocks, get them back byte-exact."""
    ns = client.open_namespace(LAYOUT, model_id="m")
    keys = ctxmem.chain_hashes(range(seed * 10_000, seed * 10_000 + 16 * n), 16)
    data = blocks(n, LAYOUT.block_nbytes, seed)
    ns.put(keys, data)
    out = [np.zeros_like(d) for d in data]
    assert ns.get(keys, out) == n
    assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))


def test_client_cannot_resize_a_slab_fd(service_factory: Callable[..., ServiceHandle]
                                        ) -> None:
    """ftruncate on the slab fd (shrink or grow) is refused; the service serves on."""
    svc = service_factory(encryption=False, **SMALL)
    with ctxmem.Client(svc.endpoint, transport="shm") as client:
        ns = client.open_namespace(LAYOUT, model_id="m")
        keys = ctxmem.chain_hashes(range(16 * 6), 16)
        data = blocks(6, LAYOUT.block_nbytes, 1)
        ns.put(keys, data)
    raw = RawSession(svc.endpoint, LAYOUT, model_id="m")
    try:
        a = raw.allocate(ctxmem.chain_hashes(range(50_000, 50_016), 16))
        slot = a.slots[0]
        path = raw.health.shm_socket

        def attack() -> dict[str, Any]:
            sock, _status = shm_connect(path, raw.session_id, raw.token)
            st, fd, size = shm_map(sock, slot.region, slot.generation)
            if fd is None:
                return {"map": st}
            out: dict[str, Any] = {"map": st, "size": size}
            for name, length in (("shrink", 0), ("grow", 2 * size)):
                try:
                    os.ftruncate(fd, length)
                    out[name] = 0
                except OSError as exc:
                    out[name] = exc.errno
            out["fstat"] = os.fstat(fd).st_size
            return out

        got = run_in_child(attack)
        assert got.get("map") == Status.OK, got
        assert got["shrink"] == errno.EPERM and got["grow"] == errno.EPERM, got
        assert got["fstat"] == got["size"], got
    finally:
        raw.close()
    # The service still reads its slabs: a TCP get copies out of them, an evict
    # (demotion: encrypt + write) reads them, a cold get writes them again.
    with ctxmem.Client(svc.endpoint, transport="tcp") as client:
        ns = client.open_namespace(LAYOUT, model_id="m")
        out = [np.zeros_like(d) for d in data]
        assert ns.get(keys, out) == 6
        assert all(np.array_equal(x, y) for x, y in zip(data, out, strict=True))
        assert ns.evict(keys) == 6
        out = [np.zeros_like(d) for d in data]
        assert ns.get(keys, out) == 6
        assert all(np.array_equal(x, y) for x, y in zip(data, out, strict=True))
    assert svc.proc is not None and svc.proc.poll() is None


def test_map_flood_without_reading_never_freezes_the_service(
        service_factory: Callable[..., ServiceHandle]) -> None:
    """A client that sends thousands of MAPs and reads nothing is disconnected; others'
    puts, gets and lookups stay prompt meanwhile."""
    svc = service_factory(encryption=False, service={"shm_reply_queue": 32,
                                                     "shm_reply_deadline_s": 1.0}, **SMALL)
    raw = RawSession(svc.endpoint, LAYOUT, model_id="m")
    try:
        a = raw.allocate(ctxmem.chain_hashes(range(16), 16))
        slot = a.slots[0]
        flood = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        flood.settimeout(10)
        flood.connect(raw.health.shm_socket)
        flood.sendall(SHM_HELLO.pack(b"CXS1", raw.session_id, raw.token))
        assert flood.recv(8)[4:] == b"\0\0\0\0"
        req = SHM_MAP.pack(b"CXSM", slot.region, slot.generation) * 5000
        sent: dict[str, Any] = {}

        def send_flood() -> None:
            try:
                flood.sendall(req)
                sent["ok"] = True
            except OSError as exc:  # the service closed it: what we want
                sent["error"] = exc

        t = threading.Thread(target=send_flood, daemon=True)
        t.start()
        worst = 0.0
        with ctxmem.Client(svc.endpoint, transport="shm", timeout_s=10) as other:
            for i in range(6):
                t0 = time.monotonic()
                _roundtrip(other, seed=i + 1, n=4)
                ns = other.open_namespace(LAYOUT, model_id="m")
                ns.lookup(ctxmem.chain_hashes(range(64), 16))
                worst = max(worst, time.monotonic() - t0)
                time.sleep(0.2)
        t.join(10)
        assert not t.is_alive()
        assert worst < 3.0, f"another client's round trip took {worst:.2f} s"
        # The flooder's connection is closed: after the replies already in its socket
        # buffer, it reads end of file.
        flood.settimeout(5)
        until(lambda: _read_to_eof(flood), 10, "the flooding connection to be closed", 0)
        flood.close()
        assert svc.stats()["shm_slow_readers"] >= 1
    finally:
        raw.close()


def test_map_is_scoped_to_the_namespace(service_factory: Callable[..., ServiceHandle]
                                        ) -> None:
    """Same tenant, namespaces differing only in cache_salt: B can neither map A's slab
    nor read A's bytes through shared memory, and their blocks never share a slab."""
    svc = service_factory(encryption=False, **SMALL)
    a = RawSession(svc.endpoint, LAYOUT, model_id="m", tags={"cache_salt": "alice"})
    b = RawSession(svc.endpoint, LAYOUT, model_id="m", tags={"cache_salt": "bob"})
    try:
        secret = bytes(range(256)) * (a.block_nbytes // 256)
        alloc_a = a.allocate(ctxmem.chain_hashes(range(16), 16))
        a.write(alloc_a, [secret])
        a.commit(alloc_a, [crc32c(secret)])
        slot = alloc_a.slots[0]
        alloc_b = b.allocate(ctxmem.chain_hashes(range(1000, 1016), 16))
        assert alloc_b.slots[0].region != slot.region
        assert b.shm is not None
        buf = bytearray(a.block_nbytes)
        with pytest.raises(TransportError, match="refused"):
            b.shm.read(0, [slot], [memoryview(buf)])
        assert bytes(buf) != secret
        # The raw MAP gets DENIED and no fd.
        sock, st = shm_connect(b.health.shm_socket, b.session_id, b.token)
        with sock:
            assert st == Status.OK
            status, fd, _size = shm_map(sock, slot.region, slot.generation)
            assert status == Status.DENIED and fd is None
        # A itself still maps and reads its bytes.
        assert a.shm is not None
        a.shm.read(0, [slot], [memoryview(buf)])
        assert bytes(buf) == secret
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("allowed", [True, False])
def test_peer_uid_check(service_factory: Callable[..., ServiceHandle], allowed: bool) -> None:
    """With service.shm_allowed_uids set, a peer of another uid is refused at accept; with
    it empty, the socket file's mode is the only gate."""
    sockdir = tempfile.mkdtemp(prefix="ctxmem-peer-", dir="/tmp")
    os.chmod(sockdir, 0o755)
    try:
        service: dict[str, Any] = {"shm_socket": os.path.join(sockdir, "data.sock")}
        if not allowed:
            service["shm_allowed_uids"] = [0]
        svc = service_factory(encryption=False, service=service, **SMALL)
        raw = RawSession(svc.endpoint, LAYOUT, model_id="m", transport="tcp")
        try:
            path = service["shm_socket"]

            def as_other_uid() -> dict[str, Any]:
                os.setgroups([])
                os.setgid(0)  # the socket is 0660 root:root: the group lets us open it
                os.setuid(54321)
                sock, status = shm_connect(path, raw.session_id, raw.token)
                sock.close()
                return {"uid": os.getuid(), "status": status}

            got = run_in_child(as_other_uid)
        finally:
            raw.close()
        assert got.get("uid") == 54321, got
        want = Status.OK if allowed else Status.PEER_NOT_ALLOWED
        assert got["status"] == want, got
        assert svc.stats()["shm_peers_refused"] == (0 if allowed else 1)
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)


def test_unread_replies_past_the_deadline_close_the_connection(
        service_factory: Callable[..., ServiceHandle]) -> None:
    """Replies that fit the queue but are never read: closed after the deadline."""
    svc = service_factory(encryption=False, service={"shm_reply_queue": 100_000,
                                                     "shm_reply_deadline_s": 0.5}, **SMALL)
    raw = RawSession(svc.endpoint, LAYOUT, model_id="m")
    try:
        slot = raw.allocate(ctxmem.chain_hashes(range(16), 16)).slots[0]
        sock, st = shm_connect(raw.health.shm_socket, raw.session_id, raw.token)
        with sock:
            assert st == Status.OK
            sock.sendall(SHM_MAP.pack(b"CXSM", slot.region, slot.generation) * 2000)
            time.sleep(1.5)  # past the deadline, reading nothing
            # Drain what was sent; then end of file.
            until(lambda: _read_to_eof(sock), 10,
                  "the connection that read nothing to be closed", 0)
        assert svc.stats()["shm_slow_readers"] == 1
    finally:
        raw.close()
