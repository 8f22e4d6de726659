"""``ctxmem bench --peer mooncake``: Mooncake Store beside ctxmem, round by round.

Mooncake Store (the KV store of Mooncake, the serving system behind Kimi) keeps objects in
memory segments that its clients mount, located by a master process. Its CPU build
(PyPI ``mooncake-transfer-engine-non-cuda``) runs here: this module starts the wheel's own
``mooncake_master`` (loopback ports of its own, its HTTP metadata server in place of etcd)
and one ``MooncakeDistributedStore`` client in this process that mounts a segment sized
for two batches, over its TCP transport. A round puts the caller's buffers with
``batch_put_from`` and reads them back with ``batch_get_into``, both zero-copy APIs on
buffers registered once (``register_buffer``), which is Mooncake's fastest CPU path; every
get's bytes are compared with what was stored (:class:`PeerMismatch`).

What is compared: Mooncake's put and DRAM-hit get against ctxmem's encrypted service's
(``dram_put_*_xts``, ``dram_get_*_xts``: CRC32C computed on the put and checked on the
get). Mooncake checks nothing. Its SSD tier needs a separate client process and a
file system of its own; it is not run here (no flash rows). The rows run beside ctxmem's
rounds (after them in even rounds, before them in odd ones), on the same buffers, as the
LMCache peer's do.

``mooncake_master`` needs ``libibverbs.so.1`` even for TCP (Debian: ``libibverbs1``,
installed by ``deploy/setup.sh``).
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ctxmem_tools.bench import peer_lmcache
from ctxmem_tools.bench.cpu import own_cpu_seconds
from ctxmem_tools.bench.datapath import Result
from ctxmem_tools.bench.peer_lmcache import Pair, PeerMismatch, PeerUnavailable, check_equal

INSTALL = ("Mooncake Store is not importable here; `ctxmem bench --peer mooncake` runs its CPU "
           "build. Install it with: pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 "
           "(and apt-get install libibverbs1 for its master)")
START_S = 30.0  # the longest the master may take to listen
STOP_S = 10.0
#: Object lease of the master, ms: a removal inside the lease is refused, so the bench's
#: per-round deletes need a short one (the default, 10 s, would fill the segment); a get
#: whose transfer outlasts the lease fails (LEASE_EXPIRED: 1 ms did, for 4 x 2 MiB).
LEASE_MS = 200


def mooncake_version() -> str:
    """The wheel's version; :class:`PeerUnavailable` naming what to install otherwise."""
    try:
        from importlib.metadata import version

        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as exc:
        raise PeerUnavailable(f"{INSTALL} (import failed: {exc})") from exc
    try:
        return version("mooncake-transfer-engine-non-cuda")
    except Exception:  # metadata of another build of the same package
        return "unknown"


def master_binary() -> Path:
    import mooncake

    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not path.exists():
        raise PeerUnavailable(f"{INSTALL} ({path} is missing from the installed wheel)")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class MasterAddr:
    rpc: str
    metadata: str


@contextmanager
def mooncake_master(log_path: Path) -> Iterator[MasterAddr]:
    """A ``mooncake_master`` on loopback (its HTTP metadata server on), stopped on exit."""
    rpc, http, metrics = _free_port(), _free_port(), _free_port()
    args = [str(master_binary()), f"-rpc_port={rpc}", "-rpc_address=127.0.0.1",
            "-enable_http_metadata_server=true", "-http_metadata_server_host=127.0.0.1",
            f"-http_metadata_server_port={http}", f"-metrics_port={metrics}",
            f"-default_kv_lease_ttl={LEASE_MS}"]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_S
        while True:
            if proc.poll() is not None:
                raise PeerUnavailable(f"mooncake_master exited with {proc.returncode} at "
                                      f"start; its log: {log_path}")
            try:
                socket.create_connection(("127.0.0.1", rpc), timeout=1).close()
                socket.create_connection(("127.0.0.1", http), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise PeerUnavailable(f"mooncake_master did not listen on {rpc}/{http} "
                                          f"within {START_S:.0f} s; its log: {log_path}") from None
                time.sleep(0.05)
        yield MasterAddr(f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata")
    finally:
        proc.terminate()
        try:
            proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_S)


def pairs(size: str) -> list[Pair]:
    """The rows for one block size: ctxmem with CRC32C and AES-XTS on, Mooncake with none."""
    return [
        Pair("DRAM-hit get", f"dram_get_{size}_xts", f"mooncake_dram_get_{size}",
             "Mooncake: batch_get_into, registered buffers"),
        Pair("put (call returns)", f"dram_put_{size}_xts", f"mooncake_dram_put_{size}",
             "Mooncake: batch_put_from, registered buffers"),
    ]


class MooncakePeer:
    """One Mooncake Store client with a segment for two batches of ``block`` bytes."""

    def __init__(self, master: MasterAddr, block: int, batch: int, tag: str) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.block, self.batch, self.tag = block, batch, tag
        self.size = f"{block >> 20}MiB" if block >= 1 << 20 else f"{block >> 10}KiB"
        self.store: Any = MooncakeDistributedStore()
        segment = 2 * block * batch + (64 << 20)
        rc = self.store.setup("127.0.0.1", master.metadata, segment, 16 << 20, "tcp", "",
                              master.rpc)
        if rc != 0:
            raise PeerUnavailable(f"Mooncake Store setup against {master.rpc} returned {rc}")
        self._registered: set[int] = set()
        self.times: dict[str, list[float]] = {p.lmcache: [] for p in pairs(self.size)}
        self.cpu: dict[str, float] = dict.fromkeys(self.times, 0.0)

    def _register(self, arrays: list[np.ndarray]) -> list[int]:
        ptrs = []
        for a in arrays:
            ptr = a.ctypes.data
            if ptr not in self._registered:
                rc = self.store.register_buffer(ptr, a.nbytes)
                if rc != 0:
                    raise RuntimeError(f"Mooncake register_buffer({a.nbytes} B) returned {rc}")
                self._registered.add(ptr)
            ptrs.append(ptr)
        return ptrs

    def round(self, r: int, bufs: list[np.ndarray], outs: list[np.ndarray]) -> None:
        """One round on fresh keys: put, DRAM-hit get (bytes compared), remove."""
        keys = [f"ctxmem-bench-{self.tag}-{self.size}-{r}-{i}" for i in range(self.batch)]
        sizes = [self.block] * self.batch
        src, dst = self._register(bufs), self._register(outs)
        put_n, get_n = f"mooncake_dram_put_{self.size}", f"mooncake_dram_get_{self.size}"
        c0, t0 = own_cpu_seconds(), time.perf_counter()
        rcs = self.store.batch_put_from(keys, src, sizes)
        self.times[put_n].append(time.perf_counter() - t0)
        self.cpu[put_n] += own_cpu_seconds() - c0
        if any(rc != 0 for rc in rcs):
            raise PeerMismatch(f"Mooncake put refused {sum(rc != 0 for rc in rcs)} of "
                               f"{len(keys)} objects (codes {sorted(set(rcs))})")
        for out in outs:
            out.fill(0)
        c0, t0 = own_cpu_seconds(), time.perf_counter()
        got = self.store.batch_get_into(keys, dst, sizes)
        self.times[get_n].append(time.perf_counter() - t0)
        self.cpu[get_n] += own_cpu_seconds() - c0
        if any(n != self.block for n in got):
            raise PeerMismatch(f"Mooncake get served {sum(n == self.block for n in got)} of "
                               f"{len(keys)} objects whole")
        check_equal(bufs, outs, f"mooncake round {r}")
        self._remove(keys)

    def _remove(self, keys: list[str]) -> None:
        """Remove the round's objects (their lease is ``LEASE_MS``: retried briefly)."""
        deadline = time.monotonic() + 5.0
        left = keys
        while left:
            rcs = self.store.batch_remove(left)
            left = [k for k, rc in zip(left, rcs, strict=True) if rc != 0]
            if left and time.monotonic() > deadline:
                raise RuntimeError(f"Mooncake kept {len(left)} objects past their lease")
            if left:
                time.sleep(0.005)

    def results(self, limits: dict[str, float]) -> list[Result]:
        """GB/s of the median batch and p50/p99 ms per batch, as ctxmem's rows."""
        return peer_lmcache.peer_results(self.times, self.cpu, self.block * self.batch,
                                         limits)

    def close(self) -> None:
        for ptr in self._registered:
            self.store.unregister_buffer(ptr)
        self._registered.clear()
        self.store.close()


@contextmanager
def mooncake_peer(workdir: Path, block: int, batch: int, tag: str) -> Iterator[MooncakePeer]:
    """A master and a :class:`MooncakePeer` for one block size, both ended on exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        master = stack.enter_context(mooncake_master(workdir / "mooncake_master.log"))
        peer = MooncakePeer(master, block, batch, tag)
        stack.callback(peer.close)
        yield peer


def pair_rows(results: list[Result], sizes: list[str]) -> list[dict[str, Any]]:
    """Each Mooncake GB/s figure next to ctxmem's (``ratio`` > 1: ctxmem faster)."""
    return peer_lmcache.pair_rows(results, sizes, pairs, peer="mooncake")


def describe(version: str) -> dict[str, Any]:
    return {"name": "mooncake", "version": version,
            "ctxmem_checks": "CRC32C on put and get, AES-256-XTS on flash",
            "mooncake_checks": "none",
            "mooncake_setup": "mooncake_master (HTTP metadata server) + one in-process "
                              "MooncakeDistributedStore client, TCP transport, one segment",
            "order": "one Mooncake round beside each ctxmem round of the encrypted service "
                     "(after it in even rounds, before it in odd ones), same buffers"}


def print_pairs(info: dict[str, Any]) -> None:
    peer_lmcache.print_pairs(info, peer="mooncake", label="Mooncake")


# --- cross-client get (``ctxmem bench pod --peer mooncake``) -------------------------------
#
# Mooncake's equivalent of ctxmem's cross-node get: client A (another process, its own
# segment) puts the blocks; client B (this process) reads them with ``batch_get_into``
# over Mooncake's TCP transport, from A's segment, into registered buffers.

HOLDER_READY = "MOONCAKE-HOLDER-READY"


def _blocks(seed: int, block: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, block, dtype=np.uint8) for _ in range(count)]


def _holder_main(argv: list[str]) -> int:
    """``python -m ctxmem_tools.bench.peer_mooncake RPC METADATA BLOCK COUNT SEED``: put
    COUNT blocks, print :data:`HOLDER_READY`, serve them until stdin closes."""
    import sys

    from mooncake.store import MooncakeDistributedStore

    rpc, metadata, block, count, seed = argv[0], argv[1], *map(int, argv[2:5])
    store = MooncakeDistributedStore()
    if store.setup("127.0.0.1", metadata, block * count + (64 << 20), 16 << 20, "tcp", "",
                   rpc) != 0:
        print("mooncake holder: setup failed", file=sys.stderr)
        return 1
    data = _blocks(seed, block, count)
    ptrs = []
    for a in data:
        store.register_buffer(a.ctypes.data, a.nbytes)
        ptrs.append(a.ctypes.data)
    keys = [f"xget-{seed}-{i}" for i in range(count)]
    rcs = store.batch_put_from(keys, ptrs, [block] * count)
    if any(rc != 0 for rc in rcs):
        print(f"mooncake holder: put refused ({sorted(set(rcs))})", file=sys.stderr)
        return 1
    print(HOLDER_READY, flush=True)
    sys.stdin.read()  # until the bench closes our stdin
    store.close()
    return 0


def cross_client_gets(workdir: Path, block: int, total: int, repeat: int) -> list[float]:
    """Seconds per ``batch_get_into`` of ``total`` bytes in ``block``-byte objects that
    another client process holds, ``repeat`` times (bytes compared every time)."""
    import sys

    from mooncake.store import MooncakeDistributedStore

    count = max(1, total // block)
    seed = 11
    workdir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        master = stack.enter_context(mooncake_master(workdir / "mooncake_master.log"))
        holder_log = stack.enter_context(open(workdir / "mooncake_holder.log", "ab"))
        holder = subprocess.Popen(
            [sys.executable, "-m", "ctxmem_tools.bench.peer_mooncake", master.rpc,
             master.metadata, str(block), str(count), str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=holder_log, text=True)

        def stop_holder() -> None:
            assert holder.stdin is not None
            holder.stdin.close()
            try:
                holder.wait(STOP_S)
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait(STOP_S)
        stack.callback(stop_holder)
        assert holder.stdout is not None
        line = holder.stdout.readline()  # the holder's put of every block is done
        if line.strip() != HOLDER_READY:
            raise PeerUnavailable(f"the Mooncake holder process did not start "
                                  f"(exit {holder.poll()}); its log: "
                                  f"{workdir / 'mooncake_holder.log'}")
        store: Any = MooncakeDistributedStore()
        if store.setup("127.0.0.1", master.metadata, 16 << 20, 16 << 20, "tcp", "",
                       master.rpc) != 0:
            raise PeerUnavailable("Mooncake Store setup of the reading client failed")
        stack.callback(store.close)
        want = _blocks(seed, block, count)
        outs = [np.empty(block, np.uint8) for _ in range(count)]
        ptrs = []
        for a in outs:
            store.register_buffer(a.ctypes.data, a.nbytes)
            ptrs.append(a.ctypes.data)
        keys = [f"xget-{seed}-{i}" for i in range(count)]
        times = []
        for r in range(repeat):
            for a in outs:
                a.fill(0)
            t = time.perf_counter()
            got = store.batch_get_into(keys, ptrs, [block] * count)
            times.append(time.perf_counter() - t)
            if any(n != block for n in got):
                raise PeerMismatch(f"Mooncake cross-client get served "
                                   f"{sum(n == block for n in got)} of {count} objects")
            check_equal(want, outs, f"mooncake cross-client get round {r}")
        return times


if __name__ == "__main__":
    import sys

    sys.exit(_holder_main(sys.argv[1:]))
