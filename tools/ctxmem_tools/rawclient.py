"""A client that speaks the protocol by hand, to do what the shim never would.

The shim always writes right after Allocate, checks what it reads, ends its grants and
sends its own session's token; a stalled, buggy or hostile client does none of that.
``RawSession`` drives the gRPC calls and the data channel one step at a time, so a test
can stall between Allocate and the copy, write after its allocation expired, commit slots
it never wrote, or name another session's objects (with its own token, another
session's, or none).

Ids are opaque here (16 random bytes since issue 12): :func:`neighbours` makes the ids
"next to" one, the first guesses of a tenant hunting for another's session.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from ctxmem.transport.base import DataChannel
from ctxmem_common.identity import SESSION_TOKEN_METADATA_KEY
from ctxmem_common.layout import KVLayout
from ctxmem_common.netaddr import split_hostport
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.proto import ctxmem_pb2_grpc as pb_grpc
from ctxmem_common.protoconv import layout_to_pb, transport_to_pb

OWN = object()  # call(): send this session's own token


@dataclass
class RawAllocation:
    id: Any
    slots: list[pb.Slot]
    exists: list[bool]


@dataclass
class RawLease:
    id: Any
    slots: list[pb.Slot]
    crc32c: list[int]


def neighbours(ident: Any, spread: int = 8) -> list[Any]:
    """The ids within ``spread`` of ``ident`` (not itself), in the id's own type."""
    if isinstance(ident, int):
        return [ident + d for d in range(-spread, spread + 1) if d and ident + d >= 0]
    n = int.from_bytes(ident, "big")
    width = len(ident)
    return [(n + d).to_bytes(width, "big") for d in range(-spread, spread + 1)
            if d and 0 <= n + d < 1 << (8 * width)]


class RawSession:
    """One session opened by hand: Connect, OpenNamespace, then single protocol steps."""

    def __init__(self, endpoint: str, layout: KVLayout, *, tenant: str = "default",
                 model_id: str = "raw", tags: dict[str, str] | None = None,
                 transport: str = "shm", tenant_token: str = "") -> None:
        self.channel = grpc.insecure_channel(endpoint)
        self.stub = pb_grpc.ContextMemoryStub(self.channel)
        self.endpoint = endpoint
        self.health = self.stub.Health(pb.HealthRequest(), timeout=10)
        r = self.stub.Connect(pb.ConnectRequest(
            client_name="raw", transport=transport_to_pb(transport), tenant=tenant,
            tenant_token=tenant_token), timeout=10)
        self.session_id = r.session_id
        self.token = r.session_token
        ns = self.call("OpenNamespace", pb.OpenNamespaceRequest(
            session_id=self.session_id, model_id=model_id, tags=tags or {},
            layout=layout_to_pb(layout)))
        self.handle = ns.namespace_handle
        self.block_nbytes = ns.block_nbytes
        self.data: DataChannel | None = None
        if transport == "shm":
            from ctxmem.transport.shm import ShmChannel

            self.data = ShmChannel(self.health.shm_socket, self.session_id, self.token, 10.0)
        elif transport == "tcp":
            from ctxmem.transport.tcp import TcpChannel

            host, port = split_hostport(self.health.data_endpoint, "data_endpoint")
            self.data = TcpChannel(host, port, self.session_id, self.token, 10.0)

    @property
    def shm(self) -> DataChannel | None:  # the name older tests use
        return self.data

    def call(self, method: str, request: Any, token: Any = OWN) -> Any:
        """One RPC; ``token``: this session's (default), another bytes value, or None to
        send no token metadata at all."""
        if token is OWN:
            token = self.token
        metadata = None if token is None else ((SESSION_TOKEN_METADATA_KEY, token),)
        return getattr(self.stub, method)(request, timeout=10, metadata=metadata)

    def allocate(self, keys: Sequence[bytes]) -> RawAllocation:
        r = self.call("Allocate", pb.AllocateRequest(
            session_id=self.session_id, namespace_handle=self.handle, keys=list(keys)))
        return RawAllocation(r.allocation_id, list(r.slots), list(r.exists))

    def write(self, a: RawAllocation, blocks: Sequence[bytes]) -> None:
        """Copy ``blocks`` into the allocation's slots through this session's data channel,
        with no check that the allocation is still ours (what a stalled writer does)."""
        assert self.data is not None
        self.data.write(a.id, a.slots, [memoryview(b) for b in blocks])

    def commit(self, a: RawAllocation, crcs: Sequence[int] = ()) -> Any:
        return self.call("Commit", pb.CommitRequest(
            session_id=self.session_id, allocation_id=a.id, crc32c=list(crcs)))

    def acquire(self, keys: Sequence[bytes]) -> RawLease:
        r = self.call("Acquire", pb.AcquireRequest(
            session_id=self.session_id, namespace_handle=self.handle, keys=list(keys)))
        return RawLease(r.lease_id, list(r.slots), list(r.crc32c))

    def read(self, lease: RawLease) -> list[bytes]:
        assert self.data is not None
        bufs = [bytearray(s.length) for s in lease.slots]
        self.data.read(lease.id, lease.slots, [memoryview(b) for b in bufs])
        return [bytes(b) for b in bufs]

    def release(self, lease: RawLease) -> list[bool]:
        r = self.call("Release", pb.ReleaseRequest(session_id=self.session_id,
                                                   lease_ids=[lease.id]))
        return list(r.valid)

    def close(self) -> None:
        if self.data is not None:
            self.data.close()
        self.channel.close()

    def __enter__(self) -> RawSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
