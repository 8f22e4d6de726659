"""A client that speaks the protocol by hand, to do what the shim never would (the
adversary tests and the chaos campaign's stalled-client fault use it).

The shim always writes right after Allocate, checks what it reads and ends its grants;
a stalled, buggy or hostile client does none of that. ``RawSession`` drives the gRPC
calls and the data channel one step at a time, so a test can stall between Allocate and
the copy, write after its allocation expired, or name another session's objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from ctxmem.transport.shm import ShmChannel
from ctxmem_common.layout import KVLayout
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.proto import ctxmem_pb2_grpc as pb_grpc
from ctxmem_common.protoconv import layout_to_pb, transport_to_pb


@dataclass
class RawAllocation:
    id: int
    slots: list[pb.Slot]
    exists: list[bool]


class RawSession:
    """One session opened by hand: Connect, OpenNamespace, then single protocol steps."""

    def __init__(self, endpoint: str, layout: KVLayout, *, tenant: str = "default",
                 model_id: str = "raw", tags: dict[str, str] | None = None,
                 transport: str = "shm", tenant_token: str = "") -> None:
        self.channel = grpc.insecure_channel(endpoint)
        self.stub = pb_grpc.ContextMemoryStub(self.channel)
        self.health = self.stub.Health(pb.HealthRequest(), timeout=10)
        r = self.stub.Connect(pb.ConnectRequest(
            client_name="raw", transport=transport_to_pb(transport), tenant=tenant,
            tenant_token=tenant_token), timeout=10)
        self.session_id = r.session_id
        self.token = r.session_token
        ns = self.stub.OpenNamespace(pb.OpenNamespaceRequest(
            session_id=self.session_id, model_id=model_id, tags=tags or {},
            layout=layout_to_pb(layout)), timeout=10)
        self.handle = ns.namespace_handle
        self.block_nbytes = ns.block_nbytes
        self.shm: ShmChannel | None = None
        if transport == "shm":
            self.shm = ShmChannel(self.health.shm_socket, self.session_id, self.token, 10.0)

    def call(self, method: str, request: Any) -> Any:
        return getattr(self.stub, method)(request, timeout=10)

    def allocate(self, keys: Sequence[bytes]) -> RawAllocation:
        r = self.call("Allocate", pb.AllocateRequest(
            session_id=self.session_id, namespace_handle=self.handle, keys=list(keys)))
        return RawAllocation(r.allocation_id, list(r.slots), list(r.exists))

    def write(self, a: RawAllocation, blocks: Sequence[bytes]) -> None:
        """Copy ``blocks`` into the allocation's slots through this session's mapping, with
        no check that the allocation is still ours (what a stalled writer does)."""
        assert self.shm is not None
        self.shm.write(a.id, a.slots, [memoryview(b) for b in blocks])

    def commit(self, a: RawAllocation, crcs: Sequence[int] = ()) -> Any:
        return self.call("Commit", pb.CommitRequest(
            session_id=self.session_id, allocation_id=a.id, crc32c=list(crcs)))

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
        self.channel.close()

    def __enter__(self) -> RawSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
