"""The data-server conformance suite (data_server_suite.py) on shared memory and TCP."""

from __future__ import annotations

from pathlib import Path

from ctxmem.transport.base import DataChannel
from ctxmem.transport.shm import ShmChannel
from ctxmem.transport.tcp import TcpChannel
from ctxmem_common.netaddr import split_hostport
from ctxmem_dpu.store import BlockStore
from ctxmem_dpu.transport.base import DataServer
from ctxmem_dpu.transport.shm import ShmServer
from ctxmem_dpu.transport.tcp import TcpDataServer
from tests.integration.data_server_suite import DataServerTests


class TestShmServer(DataServerTests):
    transport = "shm"

    def make_server(self, store: BlockStore, tmp_path: Path) -> DataServer:
        return ShmServer(store, str(tmp_path / "data.sock"))

    def open_channel(self, server: DataServer, session_id: int, token: bytes) -> DataChannel:
        return ShmChannel(server.address, session_id, token, 10)


class TestTcpServer(DataServerTests):
    transport = "tcp"

    def make_server(self, store: BlockStore, tmp_path: Path) -> DataServer:
        return TcpDataServer(store, "127.0.0.1", 0)

    def open_channel(self, server: DataServer, session_id: int, token: bytes) -> DataChannel:
        host, port = split_hostport(server.address, "data endpoint")
        return TcpChannel(host, port, session_id, token, 10)
