"""A pod on one machine: one ``redis-server`` and N real ``ctxmem serve`` nodes on
loopback, each with its own flash file and peer-fetch port, all with the pod's one master
key (tests, ``ctxmem bench pod``, and the README's pod of three)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from ctxmem_tools.launcher import ServiceProcess, free_port, local_config
from ctxmem_tools.redis_server import RedisClusterServers, RedisServer


def pod_section(redis_url: str, node_id: str, token: str, *, host: str = "127.0.0.1",
                port: int | None = None, **extra: Any) -> dict[str, Any]:
    """The ``pod:`` section of one node's config (peer fetch on ``host:port``)."""
    port = port or free_port(host)
    section: dict[str, Any] = {
        "enabled": True, "index_url": redis_url, "node_id": node_id,
        "advertise": f"{host}:{port}", "listen": f"{host}:{port}", "pod_token": token,
        "heartbeat_s": 0.5, "node_ttl_s": 2.0,
    }
    section.update(extra)
    return section


def write_key(path: Path, key_hex: str) -> None:
    """A master key file (mode 0600 from the start) in a private directory, unless one is
    there already."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.exists():
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key_hex)


class LocalPod:
    """``redis-server`` plus ``n`` service processes; ``with LocalPod(dir, 3) as pod``.

    ``index``: the pod's index when not a fresh ``RedisServer`` of its own: a TLS
    ``RedisServer`` (``pod`` then names ``index_ca_file``) or a
    :class:`RedisClusterServers` (the nodes get ``pod.index_cluster: true``). The pod
    stops it at close either way. ``master_key_hex``: the pod's master key (default: a
    fresh one), which also names the index's keys (keyed hashes). ``env``: variables set
    for every node over this process's environment (:class:`ServiceProcess`)."""

    def __init__(self, workdir: Path, n: int = 3, *, pod: dict[str, Any] | None = None,
                 index: RedisServer | RedisClusterServers | None = None,
                 master_key_hex: str | None = None, env: dict[str, str] | None = None,
                 **config: Any) -> None:
        workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.workdir = workdir
        self.token = secrets.token_hex(16)
        #: The pod's master key (hex), the same on every node (docs/deploy.md, "A pod's
        #: master key"): blocks served between nodes are authenticated under it.
        self.master_key_hex = master_key_hex or secrets.token_hex(32)
        self.index = index if index is not None else RedisServer(workdir / "redis")
        pod = dict(pod or {})
        if isinstance(self.index, RedisClusterServers):
            pod.setdefault("index_cluster", True)
        self.nodes: list[ServiceProcess] = []
        try:
            for i in range(n):
                d = workdir / f"node{i + 1}"
                write_key(d / "master.key", self.master_key_hex)
                cfg = local_config(d, **config)
                cfg["pod"] = pod_section(self.index.url, f"node{i + 1}", self.token,
                                         **pod)
                self.nodes.append(ServiceProcess(d, cfg, env=env))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for node in self.nodes:
            node.stop()
        self.index.stop()

    @property
    def master_key(self) -> bytes:
        return bytes.fromhex(self.master_key_hex)

    @property
    def redis(self) -> RedisServer:
        """The single ``redis-server`` of the pod (not a cluster's)."""
        if not isinstance(self.index, RedisServer):
            raise TypeError("this pod's index is a Redis Cluster: use LocalPod.index")
        return self.index

    def __enter__(self) -> LocalPod:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
