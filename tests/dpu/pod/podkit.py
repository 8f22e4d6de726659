"""Pod nodes on one shared flash device, for the shared-flash tests (host and guest):
real BlockStores, a real redis-server, real O_DIRECT I/O on one file or block device.

``python -m tests.dpu.pod.podkit node ...`` runs one node as its own process (a service
the tests can kill -9): it puts blocks, makes them durable on the shared device, prints
one JSON line per block (key, namespace, sequence, CRC, shared location) and ``ready``,
then keeps its leases until it is killed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from ctxmem_common.codecs import crc32c
from ctxmem_common.config import Config, config_from_dict
from ctxmem_common.flash_format import SECTOR, Superblock, aligned_buffer
from ctxmem_common.layout import KVLayout
from ctxmem_dpu.blocks import Namespace, Session
from ctxmem_dpu.pod.entries import RemoteEntry, SharedLocation
from ctxmem_dpu.pod.slab_leases import SlabLeases
from ctxmem_dpu.store import BlockStore
from ctxmem_dpu.tiers.flash import FlashDevice
from tests.kit import byte_layout

MASTER = bytes(range(32))
DEVICE = "shared0"
NODE_START_TIMEOUT_S = float(os.environ.get("CTXMEM_POD_NODE_TIMEOUT_S", "60"))


def layout(kib: int) -> KVLayout:
    """Blocks of ``kib`` KiB (each size its own slot-size class on flash)."""
    return byte_layout(kib << 10)


def format_shared(path: str, slab_size: int, size: int = 0, slabs: int = 0) -> bytes:
    """Create (``size``: a file of that size) and format the shared device once, as an
    operator does before attaching it shared; returns its UUID. ``slabs``: only that many
    slabs (a superblock pair written directly, with a new UUID: the guest's namespace
    size then does not matter)."""
    if size and not os.path.exists(path):
        with open(path, "wb") as f:
            f.truncate(size)
    if slabs:
        sb = Superblock(slab_size, slabs, uuid.uuid4().bytes)
        buf = aligned_buffer(2 * SECTOR)
        buf[:] = sb.pack_pair()
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        try:
            os.pwritev(fd, [buf], 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        return sb.device_uuid
    with FlashDevice(0, "format", path, slab_size, True) as dev:
        return dev.superblock.device_uuid


def pod_config(path: str, slab_size: int, lease_s: float, spare: int = 1,
               dead_grace_s: float = 0.0, write_policy: str = "write_back") -> Config:
    """A shared-flash node's config. ``dead_grace_s`` (``pod.dead_slab_grace_s``) is 0 by
    default here: these tests take a dead node's slabs as soon as it is dead."""
    return config_from_dict({
        "dram": {"size": "8MiB", "slab_size": "1MiB"},
        "flash": {"slab_size": slab_size, "write_policy": write_policy, "devices": [
            {"name": DEVICE, "path": path, "shared": True}]},
        "pod": {"slab_lease_s": lease_s, "shared_spare_slabs": spare,
                "dead_slab_grace_s": dead_grace_s},
    })


async def _bounded(aw: Awaitable[object], what: str) -> None:
    """``aw`` within :data:`NODE_START_TIMEOUT_S`, else an AssertionError saying ``what``."""
    try:
        await asyncio.wait_for(aw, NODE_START_TIMEOUT_S)
    except TimeoutError:
        raise AssertionError(f"{what} within {NODE_START_TIMEOUT_S:.0f} s") from None


@contextlib.asynccontextmanager
async def node(url: str, node_id: str, path: str, slab_size: int, lease_s: float,
               spare: int = 1, dead_grace_s: float = 0.0,
               write_policy: str = "write_back") -> AsyncIterator[BlockStore]:
    """One pod node: a BlockStore on the shared device, leasing slabs in Redis."""
    client = aioredis.Redis.from_url(url)
    try:
        store = BlockStore(pod_config(path, slab_size, lease_s, spare, dead_grace_s,
                                      write_policy),
                           [(DEVICE, path)],
                           MASTER, slab_leases=SlabLeases(client, node_id, lease_s))
        # Start and stop bounded and named (a guest run once hung somewhere in a test
        # built on this without saying where).
        await _bounded(store.__aenter__(), f"node {node_id}'s store did not start")
        try:
            yield store
        finally:
            await _bounded(store.close(), f"node {node_id}'s store did not stop")
    finally:
        await client.aclose()


def session(store: BlockStore, kib: int, model: str = "m") -> tuple[Session, Namespace]:
    s = store.connect("t", "", "shm", "test")
    _, ns = store.open_namespace(s, model, layout(kib), {})
    return s, ns


def block_bytes(key: bytes, n: int) -> bytes:
    """A key's content (a function of the key, as engines' content-hashed blocks)."""
    seed = crc32c(key).to_bytes(4, "little")
    return (seed * (n // 4 + 1))[:n]


@dataclass(frozen=True)
class Published:
    """What the cluster index would publish for one block."""

    ns: bytes
    key: bytes
    entry: RemoteEntry

    def to_json(self) -> str:
        e, loc = self.entry, self.entry.shared
        assert loc is not None
        return json.dumps({"ns": self.ns.hex(), "key": self.key.hex(), "node": e.node_id,
                           "seq": e.seq, "nbytes": e.nbytes, "crc": e.crc32c,
                           "uuid": loc.device_uuid, "offset": loc.offset,
                           "length": loc.length})

    @classmethod
    def from_json(cls, line: str) -> Published:
        d = json.loads(line)
        return cls(bytes.fromhex(d["ns"]), bytes.fromhex(d["key"]), RemoteEntry(
            d["node"], "flash", d["seq"], d["nbytes"], d["crc"],
            SharedLocation(d["uuid"], d["offset"], d["length"])))


async def put_durable(store: BlockStore, node_id: str, s: Session, ns: Namespace,
                      keys: list[bytes]) -> list[Published]:
    """Put ``keys`` (content from :func:`block_bytes`), make them durable on the shared
    device (Evict), and return what the index would publish for each."""
    a, exists = await store.allocate(s, ns, keys)
    new = [k for k, e in zip(keys, exists, strict=True) if not e]
    for k, ref in zip(new, a.slots, strict=True):
        store.dram.view(ref, ns.block_nbytes)[:] = block_bytes(k, ns.block_nbytes)
    await store.commit(s, a.id, [], False)
    await store.evict(ns, keys, "dram")
    out = []
    for k in keys:
        b = store.index[ns.digest][k]
        loc = store.shared_location(b)
        if loc is not None:
            out.append(Published(ns.digest, k, RemoteEntry(node_id, "flash", b.seq, b.length,
                                                           b.crc, loc)))
    return out


@contextlib.contextmanager
def node_process(url: str, node_id: str, path: str, slab_size: int, lease_s: float,
                 blocks: int, kib: int, rounds: int = 1, pause_s: float = 0.0,
                 env: dict[str, str] | None = None, check: list[Published] | None = None
                 ) -> Iterator[tuple[subprocess.Popen[str], list[Published]]]:
    """:func:`_node_main` as a child process; yields it (running) and its blocks.
    ``rounds``: puts ``blocks`` blocks that many times, ``pause_s`` apart (the pressure
    spans that long); ``env``: added to its environment (a shifted clock); ``check``:
    blocks of other nodes it reads from the shared device after its puts (it fails unless
    each reads back exactly)."""
    cmd = [sys.executable, "-m", "tests.dpu.pod.podkit", "node", "--url", url, "--node",
           node_id, "--path", path, "--slab-size", str(slab_size), "--lease", str(lease_s),
           "--blocks", str(blocks), "--kib", str(kib), "--rounds", str(rounds),
           "--pause", str(pause_s)]
    if check is not None:
        listing = Path(path).with_name(f"check-{node_id}.jsonl")
        listing.write_text("".join(p.to_json() + "\n" for p in check))
        cmd += ["--check", str(listing)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[3],
                            env={**os.environ, **(env or {})})
    try:
        assert proc.stdout is not None
        published: list[Published] = []
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        os.set_blocking(proc.stdout.fileno(), True)
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {node_id} not ready in {NODE_START_TIMEOUT_S} s")
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"node {node_id} exited ({proc.wait(5)}) before ready")
            if line.strip() == "ready":
                break
            published.append(Published.from_json(line))
        yield proc, published
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(10)


async def _check(path: str, lines: list[str]) -> None:
    """Read other nodes' blocks from the shared device, as this node's pod fetch does."""
    from ctxmem_dpu.pod.shared_flash import SharedFlashSource

    with SharedFlashSource([path], MASTER) as src:
        for p in map(Published.from_json, lines):
            got = (await src.fetch(p.ns, [p.entry], [p.key]))[0]
            if got is None or bytes(got) != block_bytes(p.key, p.entry.nbytes):
                raise SystemExit(f"block {p.key!r} of node {p.entry.node_id} does not read "
                                 f"back: {'a miss' if got is None else 'WRONG bytes'}")


async def _node_main(a: argparse.Namespace) -> None:
    async with node(a.url, a.node, a.path, a.slab_size, a.lease) as store:
        s, ns = session(store, a.kib)
        for r in range(a.rounds):
            if r:
                await asyncio.sleep(a.pause)
            keys = [f"{a.node}-{i}".encode() for i in range(r * a.blocks, (r + 1) * a.blocks)]
            for p in await put_durable(store, a.node, s, ns, keys):
                print(p.to_json(), flush=True)
        if a.check:
            await _check(a.path, Path(a.check).read_text().splitlines())
        print("ready", flush=True)
        await asyncio.sleep(3600)  # until killed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="podkit")
    sub = ap.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("node")
    for name, tp in (("--url", str), ("--node", str), ("--path", str), ("--slab-size", int),
                     ("--lease", float), ("--blocks", int), ("--kib", int)):
        n.add_argument(name, type=tp, required=True)
    n.add_argument("--rounds", type=int, default=1)
    n.add_argument("--pause", type=float, default=0.0)
    n.add_argument("--check", default="")
    a: Any = ap.parse_args(argv)
    asyncio.run(_node_main(a))


if __name__ == "__main__":
    main()
