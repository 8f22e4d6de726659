"""RDMA transport pieces that need no RDMA device: the exchange's messages in
ctxmem.proto, GID choice from sysfs, the registration cache and bounce plan, the
service's exchange checks and the RdmaAttach call's life over gRPC, the slab-retire hook,
and the errors a host without RDMA gets. The verbs path itself runs in the QEMU guest
(tests/vm/test_rdma_transport.py)."""

from __future__ import annotations

import asyncio
import errno
import itertools
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ctxmem.transport.rdma import (
    Piece,
    RdmaError,
    RegistrationCache,
    address_of,
    bounce_plan,
    chains,
    owner_view,
    wc_status_text,
)
from ctxmem_common import rdma_wire as rw
from ctxmem_common.errors import (
    ERROR_METADATA_KEY,
    CtxmemError,
    ErrorCode,
    InvalidArgument,
    PermissionDenied,
    Unavailable,
    UnknownSession,
)
from ctxmem_common.identity import SESSION_TOKEN_METADATA_KEY
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.proto import ctxmem_pb2_grpc as pb_grpc
from tests.kit import byte_layout, until_async

MiB = 1 << 20
GID_V4 = rw.gid_from_str("0000:0000:0000:0000:0000:ffff:0a00:020f")  # ::ffff:10.0.2.15


# -- the exchange's messages (ctxmem.proto) -----------------------------------------------


def test_exchange_is_part_of_the_context_memory_service() -> None:
    methods = pb.DESCRIPTOR.services_by_name["ContextMemory"].methods_by_name
    info, attach = methods["RdmaInfo"], methods["RdmaAttach"]
    assert (info.input_type.name, info.output_type.name) == ("RdmaInfoRequest",
                                                              "RdmaInfoResponse")
    assert not info.server_streaming and not info.client_streaming
    assert (attach.input_type.name, attach.output_type.name) == ("RdmaAttachRequest",
                                                                  "RdmaAttachResponse")
    assert attach.server_streaming and not attach.client_streaming


def test_qp_messages_round_trip() -> None:
    tok = bytes(range(16))
    qp = rw.QpInfo(0x11, 0xABCDEF, GID_V4, 5, 3, 8)
    req = pb.RdmaAttachRequest(session_id=b"\x09" * 16, session_token=tok, qp=qp.to_pb())
    back = pb.RdmaAttachRequest.FromString(req.SerializeToString())
    assert (back.session_id, back.session_token) == (b"\x09" * 16, tok)
    assert rw.QpInfo.from_pb(back.qp) == qp and qp.check("here") is qp
    resp = pb.RdmaAttachResponse.FromString(pb.RdmaAttachResponse(qp=qp.to_pb())
                                            .SerializeToString())
    assert rw.QpInfo.from_pb(resp.qp) == qp
    info = pb.RdmaInfoResponse.FromString(pb.RdmaInfoResponse(
        gid=GID_V4, lid=0, mtu=3, rd_atomic=16).SerializeToString())
    assert (info.gid, info.mtu, info.rd_atomic) == (GID_V4, 3, 16)


def test_qp_fields_must_fit_their_verbs_types() -> None:
    empty = rw.QpInfo.from_pb(pb.RdmaQp())  # an absent qp: every field zero, no GID
    with pytest.raises(InvalidArgument, match=r"RdmaAttachRequest\.qp: gid is 0 bytes, not 16"):
        empty.check("RdmaAttachRequest.qp")
    bad = rw.QpInfo(1 << 24, 1 << 24, GID_V4, 1 << 16, 6, 256)
    with pytest.raises(InvalidArgument) as info:
        bad.check("q")
    assert all(f"{name} " in info.value.message for name in ("qpn", "psn", "lid", "mtu",
                                                             "rd_atomic"))
    assert rw.QpInfo((1 << 24) - 1, 0, GID_V4, 0xFFFF, 5, 255).check("q")


def test_gid_helpers() -> None:
    text = "fe80:0000:0000:0000:5054:00ff:fe12:3456"
    assert rw.gid_to_str(rw.gid_from_str(text)) == text
    assert rw.gid_ipv4(GID_V4) == "10.0.2.15"
    assert rw.gid_ipv4(rw.gid_from_str(text)) is None
    with pytest.raises(ValueError):
        rw.gid_from_str("0000:0000")


# -- GID choice from sysfs -----------------------------------------------------------------


def _fake_port(root: Path, dev: str, port: int, gids: list[tuple[str, str]],
               state: str = "4: ACTIVE") -> None:
    p = root / dev / "ports" / str(port)
    (p / "gids").mkdir(parents=True)
    (p / "gid_attrs" / "types").mkdir(parents=True)
    (p / "gid_attrs" / "ndevs").mkdir(parents=True)
    (p / "state").write_text(state + "\n")
    for i, (gid, gtype) in enumerate(gids):
        (p / "gids" / str(i)).write_text(gid + "\n")
        if gtype:
            (p / "gid_attrs" / "types" / str(i)).write_text(gtype + "\n")
            (p / "gid_attrs" / "ndevs" / str(i)).write_text("eth0\n")
    (p / "gids" / str(len(gids))).write_text("0000:0000:0000:0000:0000:0000:0000:0000\n")


RXE_GIDS = [
    ("fe80:0000:0000:0000:5054:00ff:fe12:3456", "IB/RoCE v1"),
    ("fe80:0000:0000:0000:5054:00ff:fe12:3456", "RoCE v2"),
    ("0000:0000:0000:0000:0000:ffff:0a00:020f", "IB/RoCE v1"),
    ("0000:0000:0000:0000:0000:ffff:0a00:020f", "RoCE v2"),
]


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    root = tmp_path / "infiniband"
    _fake_port(root, "rxe0", 1, RXE_GIDS)
    _fake_port(root, "mlx5_0", 1, [("0000:0000:0000:0000:0000:ffff:c0a8:0107", "RoCE v2")])
    return root


def test_find_gid_picks_the_roce_v2_gid_of_the_ip(sysfs: Path) -> None:
    c = rw.find_gid("10.0.2.15", sysfs=sysfs)
    assert (c.device, c.port, c.gid_index, c.gid_type) == ("rxe0", 1, 3, "RoCE v2")
    assert c.ipv4 == "10.0.2.15" and "GID[3]" in c.describe()
    c = rw.find_gid("192.168.1.7", sysfs=sysfs)
    assert (c.device, c.gid_index) == ("mlx5_0", 0)
    assert rw.find_gid("10.0.2.15", device="rxe0", gid_index=2, sysfs=sysfs).gid_index == 2
    assert rw.find_gid("0.0.0.0", device="rxe0", sysfs=sysfs).gid_index == 3


def test_find_gid_errors_say_what_to_check(sysfs: Path, tmp_path: Path) -> None:
    with pytest.raises(rw.RdmaDeviceError, match="no RDMA devices"):
        rw.find_gid("10.0.2.15", sysfs=tmp_path / "absent")
    with pytest.raises(rw.RdmaDeviceError, match=r"'mlx9' not found; present: \['mlx5_0'"):
        rw.find_gid("10.0.2.15", device="mlx9", sysfs=sysfs)
    with pytest.raises(rw.RdmaDeviceError, match=r"RoCE v2 GID for 10\.9\.9\.9.*rdma_listen"):
        rw.find_gid("10.9.9.9", sysfs=sysfs)
    with pytest.raises(rw.RdmaDeviceError, match="GID index 1"):
        rw.find_gid("10.0.2.15", device="rxe0", gid_index=1, sysfs=sysfs)
    down = tmp_path / "down"
    _fake_port(down, "rxe0", 1, RXE_GIDS, state="1: DOWN")
    with pytest.raises(rw.RdmaDeviceError, match="not ACTIVE: rxe0 port 1 is 1: DOWN"):
        rw.find_gid("10.0.2.15", sysfs=down)


def test_device_error_carries_errno_and_hint() -> None:
    err = rw.RdmaDeviceError("open failed", 12)
    assert err.errno == 12 and "errno 12" in str(err) and isinstance(err, Unavailable)
    assert "memlock" in rw.verbs_hint(12) and "GID index" in rw.verbs_hint(22)
    e = RdmaError("registering 4096 bytes", 12)
    assert e.errno == 12 and "memlock" in str(e)
    assert "another tenant" in wc_status_text(10) and "restarted" in wc_status_text(12)


# -- registration cache, bounce plan, chains ----------------------------------------------


class FakeVerbs:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.live: dict[int, tuple[int, int, bool]] = {}
        self.calls = 0

    def register(self, addr: int, n: int, writable: bool) -> tuple[int, Any]:
        self.calls += 1
        if self.fail:
            raise RdmaError("registering", 12)
        handle = object()
        self.live[id(handle)] = (addr, n, writable)
        return 1000 + self.calls, handle

    def deregister(self, handle: Any) -> None:
        del self.live[id(handle)]


def _cache(v: FakeVerbs, min_bytes: int = 256 << 10, max_bytes: int = 64 * MiB
           ) -> RegistrationCache:
    return RegistrationCache(v.register, v.deregister, min_bytes=min_bytes, max_bytes=max_bytes)


def test_pool_is_registered_once_and_slices_hit() -> None:
    v = FakeVerbs()
    cache = _cache(v)
    pool = np.zeros(8 * MiB, dtype=np.uint8)
    blocks = [pool[i * MiB:(i + 1) * MiB].data for i in range(8)]
    hits = [cache.lookup(b, need_write=True) for b in blocks]
    assert v.calls == 1 and cache.registrations == 1 and cache.registered_bytes == 8 * MiB
    assert [h[0] for h in hits if h] == [address_of(b) for b in blocks]
    assert len({h[1] for h in hits if h}) == 1  # one lkey
    ((addr, n, writable),) = v.live.values()
    assert (addr, n, writable) == (address_of(pool.data), 8 * MiB, True)


def test_small_buffers_are_staged_and_readonly_ones_only_for_writes() -> None:
    v = FakeVerbs()
    cache = _cache(v)
    assert cache.lookup(memoryview(bytearray(16 << 10)), need_write=False) is None
    ro = bytes(MiB)
    assert cache.lookup(memoryview(ro), need_write=True) is None  # a get needs LOCAL_WRITE
    assert cache.lookup(memoryview(ro), need_write=False) is not None
    assert next(iter(v.live.values()))[2] is False  # registered without LOCAL_WRITE
    assert v.calls == 1


def test_cache_evicts_lru_and_pins_what_it_holds() -> None:
    v = FakeVerbs()
    cache = _cache(v, max_bytes=3 * MiB)
    bufs = [bytearray(MiB) for _ in range(4)]
    views = [memoryview(b) for b in bufs]
    for mv in views[:3]:
        assert cache.lookup(mv, need_write=True)
    assert cache.lookup(views[0], need_write=True)  # refresh: views[1] is now the oldest
    for mv in views:
        mv.release()  # the caller's views may go; the cache keeps its own
    assert cache.lookup(memoryview(bufs[3]), need_write=True)
    assert cache.registered_bytes == 3 * MiB and len(v.live) == 3
    assert address_of(memoryview(bufs[1])) not in {a for a, _n, _w in v.live.values()}
    bufs[1].extend(b"x")  # evicted: no longer pinned
    with pytest.raises(BufferError):  # registered memory cannot move or be freed under the MR
        bufs[2].extend(b"x")
    cache.clear()
    assert not v.live and cache.registered_bytes == 0 and len(cache) == 0
    bufs[2].extend(b"x")  # released with the registration


def test_failed_registration_falls_back_to_bounce_once() -> None:
    v = FakeVerbs(fail=True)
    cache = _cache(v)
    buf = np.zeros(MiB, dtype=np.uint8).data
    assert cache.lookup(buf, need_write=True) is None
    assert cache.lookup(buf, need_write=True) is None
    assert v.calls == 1


def test_owner_too_big_registers_only_the_view() -> None:
    v = FakeVerbs()
    cache = _cache(v, max_bytes=2 * MiB)
    pool = np.zeros(8 * MiB, dtype=np.uint8)
    view = pool[MiB:2 * MiB].data
    assert owner_view(view).nbytes == 8 * MiB
    assert cache.lookup(view, need_write=True) == (address_of(view), 1001)
    ((addr, n, _w),) = v.live.values()
    assert (addr, n) == (address_of(view), MiB)


def test_owner_view_follows_numpy_bases() -> None:
    pool = np.zeros((4, 2, 1024), dtype=np.float16)
    flat = pool.reshape(-1).view(np.uint8)
    block = flat[4096:8192].data
    assert owner_view(block).nbytes == pool.nbytes
    standalone = memoryview(bytearray(100))
    assert owner_view(standalone).nbytes == 100


@given(st.lists(st.integers(1, 5 * MiB), min_size=1, max_size=12),
       st.integers(64 << 10, 4 * MiB))
def test_bounce_plan_covers_every_byte_once_within_capacity(lengths: list[int],
                                                            capacity: int) -> None:
    capacity -= capacity % 64
    rounds = bounce_plan(lengths, capacity)
    covered: dict[int, list[tuple[int, int]]] = {}
    for rnd in rounds:
        assert rnd
        for p in rnd:
            assert p.bounce_offset % 64 == 0 and p.bounce_offset + p.length <= capacity
            covered.setdefault(p.item, []).append((p.offset, p.length))
        spans = sorted((p.bounce_offset, p.bounce_offset + p.length) for p in rnd)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    for i, n in enumerate(lengths):
        parts = sorted(covered[i])
        assert parts[0][0] == 0 and sum(ln for _o, ln in parts) == n
        assert all(o1 + l1 == o2 for (o1, l1), (o2, _l2) in itertools.pairwise(parts))


def test_bounce_plan_example_and_chains() -> None:
    assert bounce_plan([100, 200], 1024) == [[Piece(0, 0, 100, 0), Piece(1, 0, 200, 128)]]
    assert bounce_plan([3000], 1024) == [[Piece(0, 0, 1024, 0)], [Piece(0, 1024, 1024, 0)],
                                         [Piece(0, 2048, 952, 0)]]
    assert chains(40, 16) == [(0, 16), (16, 32), (32, 40)]
    assert chains(0, 16) == [] and chains(3, 0) == [(0, 1), (1, 2), (2, 3)]


# -- service side: exchange checks, keys, the retire hook ----------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Any:
    from tests.dpu.storekit import open_store, store_config

    cfg = store_config(service={"transports": ["rdma", "tcp"], "rdma_listen": "10.0.2.15"})
    s = asyncio.run(open_store(cfg, None))
    yield s
    asyncio.run(s.close())


def test_exchange_refuses_bad_tokens_and_non_rdma_sessions(store: Any) -> None:
    from ctxmem_dpu.transport.rdma import RdmaServer

    srv = RdmaServer(store, "10.0.2.15")
    qp = rw.QpInfo(1, 2, GID_V4, 0, 3, 4)
    s = store.connect("alice", "", "rdma", "t")
    t = store.connect("alice", "", "tcp", "t")

    def refused(cls: type[CtxmemError], session_id: bytes, token: bytes, *words: str,
                peer: rw.QpInfo = qp, calls: tuple[str, ...] = ("info", "attach")) -> None:
        """Each call raises ``cls`` with the session id, the call and ``words`` in it."""
        run: dict[str, Callable[[], object]] = {
            "info": lambda: srv.info(session_id, token),
            "attach": lambda: srv.open_endpoint(session_id, token, peer)}
        for name in calls:
            with pytest.raises(cls) as info:
                run[name]()
            assert type(info.value) is cls and info.value.code == cls.code
            msg = info.value.message
            assert session_id.hex() in msg and all(w in msg for w in words), msg
            if cls is not UnknownSession:  # the store's own message, as for every call
                assert ("RdmaInfo" if name == "info" else "RdmaAttach") in msg
        assert not srv.endpoints

    refused(Unavailable, s.id, s.token, "shutting down", "reconnect")  # not started
    srv.dev = object()  # type: ignore[assignment]  # checks before any verbs call
    refused(PermissionDenied, s.id, bytes(16), "wrong session token", "Connect")
    refused(PermissionDenied, s.id, b"", "wrong session token")
    refused(UnknownSession, bytes(16), s.token, "unknown", "reconnect")
    refused(InvalidArgument, t.id, t.token, "transport 'tcp'", "TRANSPORT_RDMA")
    refused(InvalidArgument, s.id, s.token, "RdmaAttachRequest.qp", "gid is 4 bytes",
            peer=rw.QpInfo(1, 2, b"\0" * 4, 0, 3, 4), calls=("attach",))
    assert srv.info(s.id, s.token) is srv.dev
    srv.endpoints[s.id] = object()  # type: ignore[assignment]  # an open RdmaAttach call
    with pytest.raises(InvalidArgument, match=f"session {s.id.hex()}: the session already has an "
                                              f"RDMA connection"):
        srv.open_endpoint(s.id, s.token, qp)
    del srv.endpoints[s.id]
    with pytest.raises(Unavailable, match="no RDMA connection"):
        asyncio.run(srv.grant(s, bytes(16), [], [], write=False))


class StandInEndpoint:
    """What the exchange needs of a SessionEndpoint, without verbs (no device here)."""

    made: list[StandInEndpoint] = []

    def __init__(self, dev: Any, session_id: int, tenant: str, peer: rw.QpInfo,
                 access: str) -> None:
        self.session_id, self.peer = session_id, peer
        self.qp = SimpleNamespace(qp_num=77)
        self.closed = False
        self.ended = asyncio.Event()
        self.made.append(self)

    def info(self) -> rw.QpInfo:
        return rw.QpInfo(77, 5, GID_V4, 0, 3, 16)

    def close(self) -> None:
        self.closed = True
        self.ended.set()


def test_attach_call_lives_as_long_as_the_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real servicer, RdmaServer and store over gRPC on loopback, in one process; only
    the verbs endpoint is stood in. Refusals are status codes with the ctxmem-error code;
    RdmaAttach answers once and stays open; the client cancelling drops the endpoint; the
    endpoint closing, or the service's RDMA transport shutting down, ends the call."""
    import grpc

    from ctxmem_dpu.control.servicer import ContextMemoryServicer
    from ctxmem_dpu.transport import rdma as rdma_mod
    from tests.dpu.storekit import open_store, store_config

    async def status(call: Any) -> tuple[grpc.StatusCode, str, str]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        e = info.value
        # Pairs, not dict(metadata): grpc.aio's Metadata in grpcio 1.78 breaks dict().
        trailing = {k: v for k, v in e.trailing_metadata() or ()}
        return e.code(), e.details() or "", trailing[ERROR_METADATA_KEY]

    async def run() -> None:
        store = await open_store(store_config(service={
            "transports": ["rdma", "tcp"], "rdma_listen": "10.0.2.15"}), None)
        rdma = rdma_mod.RdmaServer(store, "10.0.2.15")
        rdma.dev = SimpleNamespace(  # type: ignore[assignment]
            gid=GID_V4, lid=0, mtu=3, responder_depth=16, close=lambda: None)
        servicer = ContextMemoryServicer(store, "i", "", "", lambda: "serving")
        servicer.rdma = rdma
        server = grpc.aio.server()
        pb_grpc.add_ContextMemoryServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        s = store.connect("alice", "", "rdma", "t")
        mine = rw.QpInfo(12, 34, GID_V4, 0, 3, 8)

        def attach_req(token: bytes = s.token) -> pb.RdmaAttachRequest:
            return pb.RdmaAttachRequest(session_id=s.id, session_token=token, qp=mine.to_pb())

        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.ContextMemoryStub(ch)
                info = await stub.RdmaInfo(pb.RdmaInfoRequest(
                    session_id=s.id, session_token=s.token), timeout=10)
                assert (info.gid, info.mtu, info.rd_atomic) == (GID_V4, 3, 16)
                code, details, kind = await status(stub.RdmaInfo(pb.RdmaInfoRequest(
                    session_id=s.id, session_token=bytes(16)), timeout=10))
                assert (code, kind) == (grpc.StatusCode.PERMISSION_DENIED,
                                        ErrorCode.PERMISSION_DENIED.value)
                assert f"RdmaInfo for session {s.id.hex()}: wrong session token" in details
                code, details, kind = await status(stub.RdmaAttach(attach_req(bytes(16)),
                                                                   timeout=10).read())
                assert code == grpc.StatusCode.PERMISSION_DENIED and "RdmaAttach" in details
                code, details, kind = await status(stub.RdmaAttach(pb.RdmaAttachRequest(
                    session_id=bytes(16), session_token=s.token), timeout=10).read())
                assert (code, kind) == (grpc.StatusCode.UNAUTHENTICATED, "UNKNOWN_SESSION")
                assert f"session {bytes(16).hex()} is unknown" in details

                # A device error creating the QP: UNAVAILABLE, with the verbs message.
                def broken(*_a: Any) -> None:
                    raise rw.RdmaDeviceError("creating the queue pair failed: modify QP",
                                             errno.EINVAL)

                monkeypatch.setattr(rdma_mod, "SessionEndpoint", broken)
                code, details, kind = await status(stub.RdmaAttach(attach_req(),
                                                                   timeout=10).read())
                assert (code, kind) == (grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE")
                assert "modify QP (errno 22: Invalid argument)" in details
                assert not rdma.endpoints

                monkeypatch.setattr(rdma_mod, "SessionEndpoint", StandInEndpoint)
                # One answer, then the call stays open; a second attach is refused.
                call = stub.RdmaAttach(attach_req())
                first = await call.read()
                assert rw.QpInfo.from_pb(first.qp) == rw.QpInfo(77, 5, GID_V4, 0, 3, 16)
                ep = rdma.endpoints[s.id]
                assert isinstance(ep, StandInEndpoint) and ep.peer == mine
                code, details, kind = await status(stub.RdmaAttach(attach_req(),
                                                                   timeout=10).read())
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "already" in details
                await asyncio.sleep(0.2)
                assert not call.done() and rdma.endpoints[s.id] is ep and not ep.closed
                # The client ending the call drops the endpoint.
                call.cancel()
                await until_async(lambda: ep.closed and s.id not in rdma.endpoints, 2,
                                  "the cancelled call's endpoint to be closed and dropped",
                                  0.01)

                # The endpoint closing (a broken QP) ends the call, cleanly.
                call = stub.RdmaAttach(attach_req())
                await call.read()
                rdma.endpoints[s.id].close()
                assert await call.read() is grpc.aio.EOF
                assert await call.code() == grpc.StatusCode.OK
                await until_async(lambda: s.id not in rdma.endpoints, 2,
                                  "the closed endpoint to be dropped", 0.01)

                # The service's RDMA transport shutting down ends every call; new ones
                # are UNAVAILABLE.
                call = stub.RdmaAttach(attach_req())
                await call.read()
                ep = rdma.endpoints[s.id]
                await rdma.close()
                assert await call.read() is grpc.aio.EOF and ep.closed and not rdma.endpoints
                code, details, kind = await status(stub.RdmaInfo(pb.RdmaInfoRequest(
                    session_id=s.id, session_token=s.token), timeout=10))
                assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details
        finally:
            await server.stop(0)
            await store.close()

    StandInEndpoint.made.clear()
    asyncio.run(run())
    assert len(StandInEndpoint.made) == 3 and all(ep.closed for ep in StandInEndpoint.made)


def test_rdma_listen_must_be_an_ip(store: Any) -> None:
    from ctxmem_common.errors import ConfigError
    from ctxmem_dpu.transport.rdma import RdmaServer

    with pytest.raises(ConfigError, match="not an IP address"):
        RdmaServer(store, "rxe-host")
    with pytest.raises(ConfigError, match="has a port"):
        RdmaServer(store, "10.0.2.15:4791")
    with pytest.raises(ConfigError, match="rdma_access"):
        RdmaServer(store, "10.0.2.15", access="slab")


def test_retire_hook_runs_before_a_slab_changes_tenant() -> None:
    from ctxmem_dpu.tiers.dram import DramTier

    dram = DramTier(2 * MiB, MiB)
    calls: list[tuple[int, int, bool]] = []
    dram.on_retire.append(lambda slab, gen: calls.append((slab, gen, slab in dram._idle)))
    (a,) = dram.allocate(MiB, 1, "alice") or []
    gen = dram.generation(a.slab)
    dram.free(a)  # emptied: kept for alice, not retired
    (a2,) = dram.allocate(MiB, 1, "alice") or []
    assert a2.slab == a.slab and calls == []
    dram.free(a2)
    (c,) = dram.allocate(MiB, 1, "carol") or []
    assert c.slab == a.slab and dram.generation(c.slab) == gen + 1
    assert calls == [(a.slab, gen, False)]  # called while alice's memory was still mapped
    dram.close()


# -- a host without RDMA -------------------------------------------------------------------


def test_service_without_rdma_device_fails_with_a_remedy(tmp_path: Path) -> None:
    from ctxmem_tools.launcher import ServiceProcess, local_config

    cfg = local_config(tmp_path, flash_size=None, transports=["rdma", "tcp"],
                       service={"rdma_listen": "127.0.0.1"})
    with pytest.raises(RuntimeError) as info:
        ServiceProcess(tmp_path, cfg)
    assert "RDMA" in str(info.value) and ("rdma link add" in str(info.value)
                                          or "rdma_listen" in str(info.value))


def test_client_rdma_against_a_service_without_it(service: Any) -> None:
    import ctxmem
    from ctxmem_common.errors import InvalidArgument

    lay = byte_layout(4 << 10)
    with ctxmem.Client(service.endpoint, transport="rdma") as c, \
            pytest.raises(InvalidArgument, match="'rdma' is not offered"):
        c.open_namespace(lay, model_id="m")


def test_rdma_calls_against_a_service_without_it(service: Any) -> None:
    import grpc

    with grpc.insecure_channel(service.endpoint) as ch:
        stub = pb_grpc.ContextMemoryStub(ch)
        t = stub.Connect(pb.ConnectRequest(client_name="t", transport=pb.TRANSPORT_TCP,
                                           tenant="t"), timeout=30)
        qp = rw.QpInfo(1, 2, GID_V4, 0, 3, 4).to_pb()
        md = ((SESSION_TOKEN_METADATA_KEY, t.session_token),)
        calls = {
            "RdmaInfo": lambda: stub.RdmaInfo(pb.RdmaInfoRequest(
                session_id=t.session_id, session_token=t.session_token), timeout=30,
                metadata=md),
            "RdmaAttach": lambda: next(stub.RdmaAttach(pb.RdmaAttachRequest(
                session_id=t.session_id, session_token=t.session_token, qp=qp), timeout=30,
                metadata=md)),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as info:
                call()
            e: Any = info.value
            assert e.code() == grpc.StatusCode.UNAVAILABLE, name
            assert (ERROR_METADATA_KEY, "UNAVAILABLE") in tuple(e.trailing_metadata())
            assert e.details().startswith(f"{name} for session {t.session_id.hex()}: this service "
                                          f"has no RDMA transport")
            assert "service.transports" in e.details()

        # The shim's channel turns the refusal into a TransportError that says why.
        pytest.importorskip("pyverbs")
        from ctxmem.transport.base import TransportError
        from ctxmem.transport.rdma import RdmaChannel

        with pytest.raises(TransportError, match=rf"RdmaInfo for session {t.session_id.hex()} "
                                                 rf"failed \(UNAVAILABLE\): .*no RDMA transport"):
            RdmaChannel(ch, t.session_id, t.session_token, 30)


def test_rdma_modules_do_not_import_pyverbs() -> None:
    code = ("import sys, ctxmem.transport.rdma, ctxmem_dpu.transport.rdma, ctxmem_dpu.app\n"
            "print(','.join(m for m in sys.modules if m.split('.')[0] == 'pyverbs'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == ""
