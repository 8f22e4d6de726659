"""The conformance suite every data-plane server runs (as zarr ships ``StoreTests``).

A transport's test class subclasses :class:`DataServerTests` and says how to build its
server over a store (:meth:`~DataServerTests.make_server`) and how the shim opens a data
channel to it (:meth:`~DataServerTests.open_channel`). The suite checks the contract of
:class:`ctxmem_dpu.transport.base.DataServer` against a real block store and the shim's
real channel: a put/get round trip, a wrong token refused, ``start``/``close``
idempotent, ``close`` ending every connection, ``async with``. Shared memory and TCP run
it here; RDMA needs a device (tests/vm).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from ctxmem.transport.base import DataChannel, TransportError
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_dpu.blocks import Session
from ctxmem_dpu.store import BlockStore
from ctxmem_dpu.transport.base import DataServer
from tests.dpu.storekit import LAYOUT, open_store, payload, store_config
from tests.kit import until_async


def with_store(body: Callable[[BlockStore], Awaitable[None]]) -> None:
    """Run ``body`` with a fresh DRAM-only store on a new event loop."""

    async def run() -> None:
        store = await open_store(store_config(), None)
        try:
            await body(store)
        finally:
            await store.close()

    asyncio.run(run())


def slots(store: BlockStore, refs: list[Any], nbytes: int) -> list[pb.Slot]:
    """The pb.Slot of each DRAM slot, as the control plane hands them to the shim."""
    dram = store.dram
    return [pb.Slot(region=r.slab, generation=dram.generation(r.slab), offset=dram.offset(r),
                    length=nbytes) for r in refs]


class DataServerTests:
    """Shared tests; subclasses define the transport and the two factories."""

    transport: str  # the session's transport name ("shm", "tcp")

    def make_server(self, store: BlockStore, tmp_path: Path) -> DataServer:
        raise NotImplementedError  # pragma: no cover

    def open_channel(self, server: DataServer, session_id: int, token: bytes) -> DataChannel:
        raise NotImplementedError  # pragma: no cover

    async def channel(self, server: DataServer, s: Session) -> DataChannel:
        return await asyncio.to_thread(self.open_channel, server, s.id, s.token)

    def test_a_put_and_get_round_trip(self, tmp_path: Path) -> None:
        async def body(store: BlockStore) -> None:
            async with self.make_server(store, tmp_path) as server:
                s = store.connect("t", "", self.transport, "suite")
                _, ns = store.open_namespace(s, "model", LAYOUT, {})
                keys = [b"k%d" % i for i in range(3)]
                data = [payload(i + 1) for i in range(3)]
                ch = await self.channel(server, s)
                try:
                    a, _exists = await store.allocate(s, ns, keys)
                    await asyncio.to_thread(ch.write, a.id, slots(store, a.slots,
                                                                  ns.block_nbytes),
                                            [memoryview(d) for d in data])
                    assert await store.commit(s, a.id, [], False) == 3
                    lease, _ = await store.acquire(s, ns, keys)
                    refs = [b.dram for b in lease.blocks]
                    out = [bytearray(ns.block_nbytes) for _ in keys]
                    await asyncio.to_thread(ch.read, lease.id, slots(store, refs,
                                                                     ns.block_nbytes),
                                            [memoryview(o) for o in out])
                    assert [bytes(o) for o in out] == data
                    assert store.release(s, [lease.id]) == [True]
                finally:
                    ch.close()

        with_store(body)

    def test_a_wrong_token_is_refused(self, tmp_path: Path) -> None:
        async def body(store: BlockStore) -> None:
            async with self.make_server(store, tmp_path) as server:
                s = store.connect("t", "", self.transport, "suite")
                assert server.authenticate(s.id, s.token) is s
                assert server.authenticate(s.id, bytes(16)) is None
                assert server.authenticate(bytes(16), s.token) is None
                with pytest.raises(TransportError, match="refused"):
                    await asyncio.to_thread(self.open_channel, server, s.id, bytes(16))
                with pytest.raises(TransportError, match="refused"):
                    await asyncio.to_thread(self.open_channel, server, bytes(16), s.token)

        with_store(body)

    def test_start_and_close_are_idempotent(self, tmp_path: Path) -> None:
        async def body(store: BlockStore) -> None:
            never = self.make_server(store, tmp_path / "never")
            await never.close()  # closing a server that never started does nothing
            server = self.make_server(store, tmp_path)
            await server.start()
            address = server.address
            await server.start()  # a second start neither rebinds nor moves
            assert server.running and server.address == address
            await server.close()
            await server.close()
            assert not server.running and server.connection_count() == 0

        with_store(body)

    def test_close_ends_every_connection(self, tmp_path: Path) -> None:
        async def body(store: BlockStore) -> None:
            server = self.make_server(store, tmp_path)
            await server.start()
            sessions = [store.connect("t", "", self.transport, "suite") for _ in range(2)]
            channels = [await self.channel(server, s) for s in sessions]
            try:
                await until_async(lambda: server.connection_count() == 2, 10,
                                  "two connections", 0.01)
                await server.close()
                assert server.connection_count() == 0
                for ch in channels:  # the service's end is closed: the shim reads EOF
                    sock: socket.socket = ch._sock  # type: ignore[attr-defined]
                    sock.settimeout(5)
                    assert await asyncio.to_thread(sock.recv, 1) == b""
            finally:
                for ch in channels:
                    ch.close()

        with_store(body)

    def test_async_with_starts_and_closes(self, tmp_path: Path) -> None:
        async def body(store: BlockStore) -> None:
            s = store.connect("t", "", self.transport, "suite")
            async with self.make_server(store, tmp_path) as server:
                assert server.running
                ch = await self.channel(server, s)
                ch.close()
            assert not server.running and server.connection_count() == 0
            with pytest.raises(TransportError):
                await asyncio.to_thread(self.open_channel, server, s.id, s.token)

        with_store(body)
