"""The S3 door in a pod (issue 30 item 1: "pod sharing applies"): an object PUT through
one node's S3 port is read, whole and by range, through another node's, its chunks pulled
from the node that holds them and checked like any fetched block; a DELETE through the
writer's node leaves no node serving it (docs/pod.md, "Deletes and re-puts across nodes":
a Delete goes to the node that wrote the block; the copies other nodes fetched stop being
served once the index no longer names it). Two real service processes, a real
redis-server, boto3."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

boto3 = pytest.importorskip("boto3")
pytest.importorskip("aiohttp")

from botocore.config import Config as BotoConfig  # noqa: E402
from botocore.exceptions import ClientError  # noqa: E402

from ctxmem_tools.launcher import ServiceProcess, free_port, local_config  # noqa: E402
from ctxmem_tools.pod_launcher import pod_section, write_key  # noqa: E402
from ctxmem_tools.redis_server import RedisServer  # noqa: E402
from tests.integration.test_s3_door import (  # noqa: E402
    KEY_ID,
    OTHER_SECRET,
    SECRET,
    payload,
    s3_section,
)
from tests.kit import until  # noqa: E402
from tests.pod.podtest import Clients  # noqa: E402

MiB = 1 << 20


def _client(port: int) -> object:
    return boto3.client(
        "s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
        aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET,
        config=BotoConfig(s3={"addressing_style": "path"},
                          retries={"max_attempts": 1, "mode": "standard"}))


def test_an_object_put_on_one_node_is_read_and_deleted_through_another(
        tmp_path: Path, clients: Clients, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTXMEM_TEST_S3", OTHER_SECRET)  # the module's second access key
    token, master = secrets.token_hex(16), secrets.token_hex(32)
    ports = [free_port(), free_port()]
    nodes: list[ServiceProcess] = []
    with RedisServer(tmp_path / "redis") as index:
        try:
            for i, port in enumerate(ports, 1):
                d = tmp_path / f"node{i}"
                write_key(d / "master.key", master)
                cfg = local_config(d, s3=s3_section(port))
                cfg["pod"] = pod_section(index.url, f"node{i}", token)
                nodes.append(ServiceProcess(d, cfg))
            c1, c2 = _client(ports[0]), _client(ports[1])
            data = payload(3 * MiB + 777, 30)  # four 1 MiB chunks, the last partial
            c1.create_bucket(Bucket="shared")  # type: ignore[attr-defined]
            c1.put_object(Bucket="shared", Key="k/obj", Body=data)  # type: ignore[attr-defined]
            c2.create_bucket(Bucket="shared")  # type: ignore[attr-defined]

            def published() -> bool:  # node 1 publishes its blocks in the background
                try:
                    c2.head_object(Bucket="shared", Key="k/obj")  # type: ignore[attr-defined]
                except ClientError:
                    return False
                return True
            until(published, 10.0, "node 1's object to be visible through node 2")
            got = c2.get_object(Bucket="shared", Key="k/obj")  # type: ignore[attr-defined]
            assert got["Body"].read() == data
            rng = c2.get_object(Bucket="shared", Key="k/obj",  # type: ignore[attr-defined]
                                Range=f"bytes={MiB - 5}-{2 * MiB + 4}")
            assert rng["Body"].read() == data[MiB - 5:2 * MiB + 5]
            s2 = clients.stats(nodes[1].endpoint)
            assert s2.get("pod_fetch_blocks_peer", 0) >= 4, s2  # the chunks came from node 1
            c1.delete_object(Bucket="shared", Key="k/obj")  # type: ignore[attr-defined]
            for c in (c1, c2):
                with pytest.raises(ClientError) as err:
                    c.get_object(Bucket="shared", Key="k/obj")  # type: ignore[attr-defined]
                assert err.value.response["Error"]["Code"] == "NoSuchKey"
        finally:
            for n in nodes:
                n.stop()
