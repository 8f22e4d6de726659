"""Service objects are async context managers: the Service itself, the metrics endpoint.

(The data servers run their own conformance suite, test_data_servers.py; the storage
backends theirs, tests/dpu/storage/storage_backend_suite.py.)
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ctxmem_common.config import Config, config_from_dict
from ctxmem_common.errors import ConfigError
from ctxmem_dpu.app import Service
from ctxmem_dpu.metrics import HttpEndpoint
from ctxmem_dpu.tiers.flash_owner import OWNER_OFFSET, SECTOR, OwnerRecord
from tests.dpu.storekit import open_store, store_config


def service_config(tmp_path: Path, **metrics: Any) -> Config:
    return config_from_dict({
        "service": {"listen": "127.0.0.1:0", "data_listen": "127.0.0.1:0",
                    "shm_socket": str(tmp_path / "data.sock"), "insecure": True},
        "metrics": {"listen": "127.0.0.1:0", **metrics},
        "dram": {"size": "4MiB", "slab_size": "1MiB", "prefault": False},
        "flash": {"slab_size": "1MiB", "devices": [
            {"name": "flash0", "backend": "local", "path": str(tmp_path / "flash0.img"),
             "size": "8MiB", "create": True}]},
        "encryption": {"key_file": str(tmp_path / "master.key")},
    })


def test_service_is_an_async_context_manager(tmp_path: Path) -> None:
    async def run() -> None:
        async with Service(service_config(tmp_path)) as svc:
            assert svc.ready and svc.health() == "serving" and svc.grpc_port > 0
            assert svc.tcp is not None and svc.shm is not None and svc.http is not None
            assert svc.tcp.running and svc.shm.running
            assert os.path.exists(svc.shm.address)
            tcp, shm = svc.tcp, svc.shm
        assert not svc.ready and not tcp.running and not shm.running
        assert not os.path.exists(shm.address)
        await svc.stop()  # stopping twice does nothing

    asyncio.run(run())


def test_a_start_that_fails_half_way_is_undone(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]

    async def run() -> None:
        svc = Service(service_config(tmp_path, listen=f"127.0.0.1:{port}"))
        with pytest.raises(ConfigError, match=r"metrics\.listen: cannot bind"):
            async with svc:
                raise AssertionError("the metrics port is taken: start must fail")
        # Everything started before the metrics endpoint failed has been stopped.
        assert not svc.ready and svc.tcp is not None and svc.shm is not None
        assert not svc.tcp.running and not svc.shm.running
        assert not os.path.exists(svc.shm.address)

    try:
        asyncio.run(run())
    finally:
        taken.close()


def test_metrics_endpoint_is_an_async_context_manager() -> None:
    async def run() -> None:
        store = await open_store(store_config(), None)
        try:
            endpoint = HttpEndpoint(store, "127.0.0.1", 0, lambda: True)
            async with endpoint:
                await endpoint.start()  # idempotent: still the same port
                url = f"http://127.0.0.1:{endpoint.port}/healthz"
                body = await asyncio.to_thread(
                    lambda: urllib.request.urlopen(url, timeout=10).read())
                assert body == b"ok\n"
            await endpoint.close()  # idempotent
            with pytest.raises(OSError):
                await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10))
        finally:
            await store.close()

    asyncio.run(run())


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_a_failed_start_leaks_nothing(tmp_path: Path) -> None:
    """Issue 31: a start that fails at its last listener (the metrics port is taken)
    leaves nothing of what it had started: no thread, no file descriptor, no bound port
    (gRPC, TCP data), no Unix socket file, no owner record on the flash device; a service
    on the same config then starts. (A first full start and stop warms up what gRPC and
    the interpreter keep for the whole process, so what remains is the failed start's.)"""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    good, bad = service_config(tmp_path), service_config(tmp_path, listen=f"127.0.0.1:{port}")

    async def cycle() -> None:
        async with Service(good) as svc:
            assert svc.ready

    async def failed_start() -> tuple[int, int]:
        svc = Service(bad)
        with pytest.raises(ConfigError, match=r"metrics\.listen: cannot bind"):
            await svc.start()
        assert svc.tcp is not None and svc.tcp.running, "the failure came before the end"
        await svc.stop()
        assert svc.tcp is not None
        return svc.grpc_port, int(svc.tcp.address.rsplit(":", 1)[1])

    try:
        asyncio.run(cycle())
        threads = {t.ident for t in threading.enumerate()}
        fds = set(os.listdir("/proc/self/fd"))
        grpc_port, data_port = asyncio.run(failed_start())
        left = [t.name for t in threading.enumerate() if t.ident not in threads and t.is_alive()]
        assert left == [], f"threads of the failed start still run: {left}"
        opened = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in
                  set(os.listdir("/proc/self/fd")) - fds
                  if os.path.exists(f"/proc/self/fd/{fd}")}
        assert opened == {}, f"file descriptors of the failed start still open: {opened}"
        assert _free(grpc_port) and _free(data_port), "a port of the failed start is bound"
        assert not os.path.exists(tmp_path / "data.sock")
        with open(tmp_path / "flash0.img", "rb") as f:
            f.seek(OWNER_OFFSET)
            assert OwnerRecord.unpack(f.read(SECTOR)) is None, "the device is still owned"
        asyncio.run(cycle())  # nothing is "in use" by the failed start
    finally:
        taken.close()
