"""The index client on its own, against a real ``redis-server``: commands packed in C
(``pod/resp_pack.py``) are the bytes redis-py would send, the connections in use are the
fast ones (single server and Redis Cluster), and a Lookup's filtering of HMGET values
(live peer, dead node, this node's own, corrupt, none) is exact on both of its paths."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from ctxmem_common.config import PodConfig
from ctxmem_common.podkeys import PodKeys
from ctxmem_dpu.pod.entries import NODES_KEY, RemoteEntry, alive_key, blocks_key, pack_entry
from ctxmem_dpu.pod.index import ClusterIndex
from ctxmem_dpu.pod.redis_conn import connect
from ctxmem_dpu.pod.resp_pack import FastConnection, FastSSLConnection, pack_command
from ctxmem_tools.redis_server import RedisClusterServers, RedisServer

_ARG = st.one_of(st.binary(max_size=40), st.text(max_size=10),
                 st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=False,
                                                           allow_infinity=False))


def _python_pack(args: tuple[Any, ...]) -> bytes:
    return b"".join(Connection().pack_command(*args))


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(["HMGET", "EXISTS", "CLUSTER SLOTS", b"HSET", b"GET x"]),
       args=st.lists(_ARG, max_size=40),
       uniform=st.lists(st.binary(min_size=32, max_size=32), max_size=40))
def test_packing_is_what_redis_py_sends(name: str | bytes, args: list[Any],
                                        uniform: list[bytes]) -> None:
    """Mixed arguments (hiredis) and a long tail of equal-length keys (one join): the same
    RESP bytes as redis-py's own packer."""
    for tail in (args, uniform, [*args, *uniform]):
        cmd = (name, *tail)
        assert pack_command(cmd) == _python_pack(cmd)


def test_packing_refuses_what_redis_refuses() -> None:
    with pytest.raises(DataError):
        pack_command(("SET", "k", None))


def _pod(url: str, **extra: Any) -> PodConfig:
    return PodConfig(enabled=True, index_url=url, node_id="me", advertise="127.0.0.1:1",
                     **extra)


def test_the_clients_connections_pack_in_c(tmp_path: Path, index_exe: str) -> None:
    with RedisServer(tmp_path / "redis", exe=index_exe) as server, \
            RedisClusterServers(tmp_path / "cluster", exe=index_exe) as servers:
        asyncio.run(_fast_connections(server.url, servers.url))
    assert FastSSLConnection.__mro__[1].__name__ == "_FastPack"


async def _fast_connections(url: str, cluster_url: str) -> None:
    single = connect(_pod(url))
    cluster = connect(_pod(cluster_url, index_cluster=True))
    try:
        await single.ping()
        assert single.connection_pool.connection_class is FastConnection
        conn = await single.connection_pool.get_connection()
        try:  # replies parsed in C too (pyproject requires hiredis)
            assert type(conn._parser).__name__ == "_AsyncHiredisParser"
        finally:
            await single.connection_pool.release(conn)
        assert await cluster.hmget(blocks_key(bytes(16).hex()), [b"a" * 32] * 20) \
            == [None] * 20
        nodes = cluster.get_nodes()
        assert len(nodes) == 3
        for node in nodes:
            assert node.connection_class is FastConnection, node.name
    finally:
        await single.aclose()
        await cluster.aclose()


def test_lookup_filters_values_exactly(tmp_path: Path, index_exe: str) -> None:
    """Per key: a live peer's entry is returned; a dead node's, this node's own, a corrupt
    value (empty, one byte, foreign version) and no value are None; the dead node's entry
    is cleaned up. All-live answers take the C path, mixed ones the per-value path: both
    are checked."""
    ns = bytes(range(16))
    keys = [bytes([i % 256, i // 256]) * 16 for i in range(6000)]
    ik = PodKeys(bytes(32))

    def named(m: dict[bytes, bytes]) -> dict[bytes, bytes]:
        """``m`` under the index's keyed field names."""
        return dict(zip(ik.index_fields(ns, list(m)), m.values(), strict=True))

    async def run(url: str) -> None:
        index = ClusterIndex(_pod(url), connect(_pod(url)), ik)
        r = index._r
        name = index.blocks_key(ns)
        try:
            live = {k: pack_entry(RemoteEntry("peer", "dram", i, 4096, i))
                    for i, k in enumerate(keys[:5000])}
            await r.hset(name, mapping=named(live))  # type: ignore[arg-type]
            await r.set(alive_key("peer"), "127.0.0.1:2")
            await r.hset(NODES_KEY, "peer", "127.0.0.1:2")
            await index.heartbeat()
            assert set(index.live) == {"peer"}
            # All live (and a missing key): the C path.
            got = await index.lookup(ns, keys[:5001])
            assert got == [live[k] for k in keys[:5000]] + [None]
            # Mixed: the per-value path.
            odd = {keys[5001]: pack_entry(RemoteEntry("dead", "dram", 1, 4096, 1)),
                   keys[5002]: pack_entry(RemoteEntry("me", "dram", 1, 4096, 1)),
                   keys[5003]: b"", keys[5004]: b"\x01", keys[5005]: b"\x02\x04peer" + bytes(28),
                   keys[5006]: pack_entry(RemoteEntry("peer2", "dram", 1, 4096, 1))}
            await r.hset(name, mapping=named(odd))  # type: ignore[arg-type]
            got = await index.lookup(ns, keys[:5010])
            assert got == [live[k] for k in keys[:5000]] + [None] * 10
            got = await index.lookup(ns, keys[5001:5010] + keys[:3])
            assert got == [None] * 9 + [live[k] for k in keys[:3]]
            # Live peers whose ids differ in length: the other C check (startswith).
            other = {k: pack_entry(RemoteEntry("peer-22", "flash", i, 4096, i))
                     for i, k in enumerate(keys[5500:5600])}
            await r.hset(name, mapping=named(other))  # type: ignore[arg-type]
            await r.set(alive_key("peer-22"), "127.0.0.1:3")
            await r.hset(NODES_KEY, "peer-22", "127.0.0.1:3")
            await index.heartbeat()
            assert set(index.live) == {"peer", "peer-22"}
            got = await index.lookup(ns, keys[5500:5600] + keys[:100])
            assert got == [other[k] for k in keys[5500:5600]] + [live[k] for k in keys[:100]]
            got = await index.lookup(ns, keys[5500:5502] + keys[5001:5003] + keys[:2])
            assert got == [other[keys[5500]], other[keys[5501]], None, None, live[keys[0]],
                           live[keys[1]]]
            await index.close()  # waits for the lazy cleanup
            left = await (r2 := connect(_pod(url))).hmget(name, list(named(odd)))
            await r2.aclose()
            # The dead nodes' entries (and the foreign version's) are gone; this node's own
            # and the values too short to name a node stay.
            assert left == [None, odd[keys[5002]], b"", b"\x01", None, None]
        finally:
            await r.aclose()

    with RedisServer(tmp_path / "redis", exe=index_exe) as server:
        asyncio.run(run(server.url))
