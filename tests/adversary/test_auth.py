"""Issue 12, items 1 and 7: every call proves its session, ids cannot be guessed, identity
is explicit, a commit proves what was written, and namespace tags cannot collide.

Every test runs against a REAL service process (``service_factory``). The attacks were
found from outside with the code before issue 12: sequential ids let a tenant find
another's session one id away and look up, delete and commit under its keys.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

import ctxmem
from ctxmem_common.codecs import crc32c
from ctxmem_common.errors import ERROR_METADATA_KEY, PermissionDenied, error_for_code
from ctxmem_common.keys import namespace_digest
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_tools.launcher import ServiceProcess, free_port, local_config
from tests.adversary.raw import RawSession, neighbours
from tests.kit import byte_layout, keys, tiled, until

BLOCK = 64 << 10
LAYOUT = byte_layout(BLOCK)
TOKENS = {"alice": "alice-token-0123456789abcdef", "bob": "bob-token-0123456789abcdef00"}


def content(key: bytes) -> bytes:
    return tiled(key, BLOCK)


def refusal(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    """The status code and ctxmem-error of a refused call."""
    call: Any = exc
    kind = {k: v for k, v in call.trailing_metadata() or ()}.get(ERROR_METADATA_KEY, "")
    return call.code(), str(kind)


def assert_refused(fn: Callable[[], Any], *, codes: tuple[grpc.StatusCode, ...] = (
        grpc.StatusCode.UNAUTHENTICATED,)) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    got = refusal(info.value)
    assert got[0] in codes, f"expected one of {codes}, got {got} ({info.value})"
    return got


@pytest.fixture
def tcp_service(service_factory: Callable[..., Any]) -> Any:
    return service_factory(dram_size="8MiB", dram_slab="2MiB", flash_size=None,
                           transports=["shm", "tcp"])


def put_victim(endpoint: str, n: int = 8) -> tuple[ctxmem.Client, ctxmem.Namespace,
                                                    list[bytes]]:
    c = ctxmem.Client(endpoint, transport="tcp")
    ns = c.open_namespace(LAYOUT, model_id="m", tenant="alice")
    ks = keys("alice", n)
    assert ns.put(ks, [content(k) for k in ks]).stored == n
    return c, ns, ks


def get_intact(ns: ctxmem.Namespace, ks: list[bytes]) -> int:
    """Get ``ks``; every block returned must be exactly its own content."""
    bufs = [bytearray(BLOCK) for _ in ks]
    n = ns.get(ks, bufs)
    for i in range(n):
        assert bytes(bufs[i]) == content(ks[i]), f"block {i} came back with other bytes"
    return n


def test_session_ids_are_random_128_bit(tcp_service: Any) -> None:
    with RawSession(tcp_service.endpoint, LAYOUT, tenant="a") as a, \
            RawSession(tcp_service.endpoint, LAYOUT, tenant="b") as b:
        assert isinstance(a.session_id, bytes) and len(a.session_id) == 16
        gap = abs(int.from_bytes(a.session_id, "big") - int.from_bytes(b.session_id, "big"))
        assert gap > 1 << 32, "session ids look sequential"
        alloc = a.allocate(keys("a", 2))
        assert isinstance(alloc.id, bytes) and len(alloc.id) == 16
        a.call("Commit", pb.CommitRequest(session_id=a.session_id, allocation_id=alloc.id,
                                          abort=True))


def test_guessing_another_tenants_session_is_refused(tcp_service: Any) -> None:
    """Tenant bob holds a valid session of his own and tries alice's session id (as if
    found) and the ids next to his own with his token, and alice's token on his session:
    every call is refused and alice's blocks stay intact."""
    c, ns, ks = put_victim(tcp_service.endpoint)
    try:
        alice_id = c._sessions["alice"].id
        alice_token = getattr(c._sessions["alice"], "token", bytes(16))
        with RawSession(tcp_service.endpoint, LAYOUT, tenant="bob", model_id="m",
                        transport="tcp") as bob:
            targets = [alice_id, *neighbours(bob.session_id, 16), *neighbours(alice_id, 4)]
            for sid in targets:
                for method, req in [
                    ("Lookup", pb.LookupRequest(session_id=sid, namespace_handle=1, keys=ks,
                                                prefix=True)),
                    ("Delete", pb.DeleteRequest(session_id=sid, namespace_handle=1, keys=ks)),
                    ("Acquire", pb.AcquireRequest(session_id=sid, namespace_handle=1,
                                                  keys=ks)),
                    ("Allocate", pb.AllocateRequest(session_id=sid, namespace_handle=1,
                                                    keys=keys("evil", 2))),
                ]:
                    _code, kind = assert_refused(lambda m=method, r=req: bob.call(m, r))
                    assert kind == "UNKNOWN_SESSION", (method, kind)
            # A token replayed on another session id: alice's token with bob's id.
            assert_refused(lambda: bob.call("Lookup", pb.LookupRequest(
                session_id=bob.session_id, namespace_handle=1, keys=ks), token=alice_token))
            # The RDMA exchange rides the same check (refused before it looks at RDMA).
            assert_refused(lambda: bob.call("RdmaInfo", pb.RdmaInfoRequest(
                session_id=alice_id, session_token=bob.token)))
        assert get_intact(ns, ks) == len(ks), "the victim's blocks were changed or deleted"
    finally:
        c.close()


def test_unknown_id_and_wrong_token_look_the_same(tcp_service: Any) -> None:
    """A guess tells nothing: an existing session with a wrong token answers exactly as
    a random id does."""
    c, _ns, ks = put_victim(tcp_service.endpoint, 1)
    try:
        alice_id = c._sessions["alice"].id
        with RawSession(tcp_service.endpoint, LAYOUT, tenant="bob") as bob:
            answers = set()
            for sid in (alice_id, bytes(16), b"\xff" * 16):
                with pytest.raises(grpc.RpcError) as info:
                    bob.call("Lookup", pb.LookupRequest(session_id=sid, namespace_handle=1,
                                                        keys=ks))
                answers.add((*refusal(info.value), info.value.details()))  # type: ignore[attr-defined]
            assert len(answers) == 1, answers
    finally:
        c.close()


def test_calls_without_the_session_token_are_refused(tcp_service: Any) -> None:
    with RawSession(tcp_service.endpoint, LAYOUT, tenant="a") as a:
        for method, req in [
            ("Lookup", pb.LookupRequest(session_id=a.session_id, namespace_handle=a.handle,
                                        keys=[b"k"])),
            ("Allocate", pb.AllocateRequest(session_id=a.session_id,
                                            namespace_handle=a.handle, keys=[b"k"])),
            ("OpenNamespace", pb.OpenNamespaceRequest(session_id=a.session_id, model_id="x",
                                                      layout=pb.Layout())),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                a.call(method, req, token=None)
            code, kind = refusal(info.value)
            assert code == grpc.StatusCode.UNAUTHENTICATED, method
            # The shim maps it to an exception class through ctxmem-error.
            err = error_for_code(kind, info.value.details())  # type: ignore[attr-defined]
            assert isinstance(err, PermissionDenied)
            assert "session token" in str(err)
        # An empty token is a wrong one: answered as an unknown session.
        assert_refused(lambda: a.call("Lookup", pb.LookupRequest(
            session_id=a.session_id, namespace_handle=a.handle, keys=[b"k"]), token=b""))
        # The session still works with its token.
        a.call("Lookup", pb.LookupRequest(session_id=a.session_id, namespace_handle=a.handle,
                                          keys=[b"k"]))


def test_another_sessions_allocation_is_not_found(tcp_service: Any) -> None:
    """A session names only its own allocations: another session's id is answered as a
    random id is."""
    with RawSession(tcp_service.endpoint, LAYOUT, tenant="a", transport="tcp") as a, \
            RawSession(tcp_service.endpoint, LAYOUT, tenant="b", transport="tcp") as b:
        alloc = a.allocate(keys("a", 2))
        blocks = [content(k) for k in keys("a", 2)]
        a.write(alloc, blocks)
        details = []
        for ident in (alloc.id, bytes(16)):
            with pytest.raises(grpc.RpcError) as info:
                b.call("Commit", pb.CommitRequest(session_id=b.session_id,
                                                  allocation_id=ident,
                                                  crc32c=[crc32c(x) for x in blocks]))
            assert refusal(info.value)[1] == "EXPIRED"
            details.append(info.value.details().replace(ident.hex(), "<id>"))  # type: ignore[attr-defined]
        assert details[0] == details[1]
        assert a.commit(alloc, [crc32c(x) for x in blocks]).committed == 2


def test_commit_of_unwritten_slots_is_refused_over_tcp(tcp_service: Any) -> None:
    """A commit of slots never written holds whatever those slots held before (another
    block's bytes, with a CRC the service computes itself). Without CRCs it is refused;
    with CRCs of what should have been written, nothing is committed."""
    c, ns, ks = put_victim(tcp_service.endpoint, 8)
    try:
        assert ns.delete(ks) == 8  # the slots go back, their bytes stay
        with RawSession(tcp_service.endpoint, LAYOUT, tenant="alice", model_id="m",
                        transport="tcp") as raw:
            evil = keys("unwritten", 8)
            a = raw.allocate(evil)
            assert len(a.slots) == 8
            _code, kind = assert_refused(lambda: raw.commit(a),
                                        codes=(grpc.StatusCode.INVALID_ARGUMENT,))
            assert kind == "INVALID_ARGUMENT"
            # CRCs that do not match the slots' bytes: no block is committed.
            assert raw.commit(a, [crc32c(content(k)) for k in evil]).committed == 0
            assert raw.call("Lookup", pb.LookupRequest(
                session_id=raw.session_id, namespace_handle=raw.handle, keys=evil,
                prefix=True)).num_hits == 0
        bufs = [bytearray(BLOCK) for _ in evil]
        assert ns.get(evil, bufs) == 0, "a get returned bytes that were never written"
        # A correct put of the same keys works afterwards.
        assert ns.put(evil, [content(k) for k in evil]).stored == 8
        assert get_intact(ns, evil) == 8
    finally:
        c.close()


def test_tag_sets_never_share_a_namespace(tcp_service: Any) -> None:
    one, two = {"a": "b=c"}, {"a=b": "c"}
    assert namespace_digest("t", "m", LAYOUT, one) != namespace_digest("t", "m", LAYOUT, two)
    assert namespace_digest("t", "m", LAYOUT, {"a": "", "b": ""}) != \
        namespace_digest("t", "m", LAYOUT, {"a": "\0\0\0\0\x01\0\0\0b"})
    with ctxmem.Client(tcp_service.endpoint, transport="tcp") as c:
        ns1 = c.open_namespace(LAYOUT, model_id="m", tags=one)
        ns2 = c.open_namespace(LAYOUT, model_id="m", tags=two)
        assert ns1.digest != ns2.digest
        ks = keys("tags", 2)
        ns1.put(ks, [content(k) for k in ks])
        assert ns2.lookup(ks).num_hits == 0


def _start(workdir: Path, **service: Any) -> ServiceProcess:
    cfg = local_config(workdir, flash_size=None, dram_size="8MiB", dram_slab="2MiB",
                       transports=["tcp"], service=service)
    if "tenant_tokens" not in service and "insecure" not in service:
        cfg["service"].pop("insecure")  # neither identity mode
    return ServiceProcess(workdir, cfg, start=False)


def test_refuses_to_listen_beyond_loopback_without_tokens(tmp_path: Path) -> None:
    for i, extra in enumerate([{}, {"insecure": True}]):
        svc = _start(tmp_path / f"s{i}", listen=f"0.0.0.0:{free_port()}",
                     data_listen="0.0.0.0:0", **extra)
        try:
            with pytest.raises(RuntimeError) as info:
                svc.start(timeout_s=30)
            assert "tenant_tokens" in str(info.value)
        finally:
            svc.stop()
    # The data plane alone on a wide address is refused too.
    svc = _start(tmp_path / "s3", insecure=True, data_listen="0.0.0.0:0")
    try:
        with pytest.raises(RuntimeError, match=r"service\.data_listen"):
            svc.start(timeout_s=30)
    finally:
        svc.stop()


def test_starts_beyond_loopback_with_tokens(tmp_path: Path) -> None:
    svc = _start(tmp_path / "s", listen=f"0.0.0.0:{free_port()}", data_listen="0.0.0.0:0",
                 tenant_tokens=TOKENS)
    svc.start(timeout_s=60)
    try:
        endpoint = svc.endpoint.replace("0.0.0.0", "127.0.0.1")
        with ctxmem.Client(endpoint, transport="tcp",
                           tenant_token=TOKENS["alice"]) as c:
            ns = c.open_namespace(LAYOUT, model_id="m", tenant="alice")
            ks = keys("tok", 2)
            assert ns.put(ks, [content(k) for k in ks]).stored == 2
            assert get_intact(ns, ks) == 2
        for tenant, token in [("alice", TOKENS["bob"]), ("bob", ""), ("mallory", "x" * 20)]:
            with ctxmem.Client(endpoint, transport="tcp", tenant_token=token) as c, \
                    pytest.raises(PermissionDenied):
                c.open_namespace(LAYOUT, model_id="m", tenant=tenant)
    finally:
        svc.stop()


def test_insecure_mode_logs_a_warning(tcp_service: Any) -> None:
    until(lambda: "service.insecure: true" in tcp_service.log(), 10, tcp_service.log)
    assert "WARNING" in tcp_service.log().split("service.insecure: true")[0].splitlines()[-1]


def test_stats_names_no_tenant_beyond_one_trust_domain(
        service_factory: Callable[..., Any]) -> None:
    """Stats needs no session: with tenant tokens it must not reveal which tenants exist
    or what they hold (the per-tenant entries stay on the loopback metrics endpoint)."""
    tokens = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789ab"}
    svc = service_factory(service={"insecure": False, "tenant_tokens": tokens})
    with ctxmem.Client(svc.endpoint, tenant_token=tokens["alice"]) as c:
        ns = c.open_namespace(LAYOUT, model_id="m", tenant="alice")
        ns.put([b"k" * 8], [bytes(LAYOUT.block_nbytes)])
        values = c.stats()
    assert values["blocks"] >= 1
    assert not [k for k in values if k.startswith("tenant.")], sorted(values)[:5]
