"""``ctxmem bench pod``: the pod tier's costs, measured in one run on one machine.

* the limit: one TCP loopback socket's rate (a thread sending, this one receiving into a
  buffer, 4 MiB at a time);
* get GB/s of 2 MiB blocks through the TCP data plane: local (the blocks are in the
  node's DRAM) and cross-node (held by another node: peer fetch over TCP, CRC-verified,
  adopted into DRAM, then read), plaintext and with mutual TLS 1.3 between the nodes;
* a 10,000-key Lookup on a node, p50/p99: all keys local, and half of them held by the
  other node (the cluster index asked for the local misses in one round trip), the two
  alternated call by call, and the remote part (the difference per call pair).

* with ``--rdma-listen IP`` (where an RDMA device carries IP: the QEMU guest's rxe0),
  the same gets between two nodes with ``pod.rdma_listen``: peer fetch by RDMA READ (the
  run fails if any block went over TCP).

* with ``--peer mooncake``, Mooncake Store's cross-client get in the same run: its own
  master, one client process holding the blocks in its segment, this process reading
  them with ``batch_get_into`` over Mooncake's TCP transport (bytes compared), 2 MiB and
  64 KiB objects, each beside the socket's limit, and ctxmem's plaintext cross-node get
  over it (``ratio``: > 1, ctxmem faster).

* with ``--auth-ab``, block authenticators on and off (bench/auth_ab.py): two pods of
  each kind at once, one whose nodes run with them off (a benchmark harness), the rounds
  alternated on/off, off/on; the local and cross-node get rows (no Lookup rows) and the
  shared-flash rows, each printed with both figures, on/off, the two nodes' CPU per GB
  of each (from their Stats) and the socket's limit; ``"auth_ab"`` in ``--json``.

Shared flash (issue 14 part 3): a get straight from a device several nodes attach
(bench/pod_flash.py). ``--json PATH`` writes ``{"results": [{"name", "value", "unit",
"limit", "service_cpu_s_per_gb"}]}``.
"""

from __future__ import annotations

import argparse
import functools
import json
import socket
import statistics
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ctxmem.client import Client
from ctxmem_common.keys import chain_hashes
from ctxmem_common.layout import KVLayout
from ctxmem_tools.bench.auth_ab import (
    ARMS,
    arm_env,
    arm_order,
    check_arm,
    check_output,
    exit_counts,
    pair_rows,
    print_rows,
)
from ctxmem_tools.bench.cpu import CpuMeter
from ctxmem_tools.bench.datapath import Result as FlashRow
from ctxmem_tools.bench.pod_flash import measure_shared_flash, shared_flash_run
from ctxmem_tools.bench.security_pki import make_pki, member_cert
from ctxmem_tools.pod_launcher import LocalPod

GB = 1e9
BIG = KVLayout(dtype="bfloat16", num_layers=32, num_kv_heads=8, head_dim=128,
               tokens_per_block=16)  # 2 MiB blocks
SMALL = KVLayout(dtype="bfloat16", num_layers=1, num_kv_heads=1, head_dim=128,
                 tokens_per_block=8)  # 4 KiB blocks: a Lookup is about keys, not bytes


@dataclass
class Result:
    name: str
    value: float
    unit: str
    limit: float = float("nan")  # the machine's limit measured in the same run, if any
    # --auth-ab: the CPU seconds per GB moved that the pod's nodes spent (their Stats).
    service_cpu_s_per_gb: float | None = None


#: ``--auth-ab``: the suffix of a row measured with block authenticators off.
AUTH_OFF_SUFFIX = " [authenticators off]"


def loopback_rate(total: int = 256 << 20, chunk: int = 4 << 20) -> float:
    """Bytes/s through one TCP loopback connection (sendall → recv_into)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    buf = bytes(chunk)

    def send() -> None:
        with socket.create_connection(srv.getsockname()) as s:
            for _ in range(total // chunk):
                s.sendall(buf)

    t = threading.Thread(target=send)
    t.start()
    conn, _ = srv.accept()
    into = bytearray(chunk)
    view = memoryview(into)
    got = 0
    start = time.perf_counter()
    with conn:
        while got < total:
            n = conn.recv_into(view)
            if not n:
                break
            got += n
    elapsed = time.perf_counter() - start
    t.join()
    srv.close()
    return got / elapsed


def _wait(cond: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _gets(pod: LocalPod, total_mib: int, repeat: int, label: str, out: list[Result],
          rdma: bool = False) -> None:
    n1, n2 = pod.nodes[0], pod.nodes[1]
    n = max(1, (total_mib << 20) // BIG.block_nbytes)
    keys = chain_hashes(range(BIG.tokens_per_block * n), BIG.tokens_per_block)
    rng = np.random.default_rng(1)
    data = [rng.integers(0, 255, BIG.block_nbytes, dtype=np.uint8) for _ in range(n)]
    bufs = [np.empty(BIG.block_nbytes, np.uint8) for _ in range(n)]
    nbytes = n * BIG.block_nbytes
    with Client(n1.endpoint, transport="tcp") as c1, \
            Client(n2.endpoint, transport="tcp") as c2:
        ns1 = c1.open_namespace(BIG, model_id="bench")
        ns2 = c2.open_namespace(BIG, model_id="bench")
        ns1.put(keys, data)
        _wait(lambda: ns2.lookup(keys).num_hits == n, "the index to publish")
        local, remote = [], []
        for _ in range(repeat):
            t = time.perf_counter()
            assert ns1.get(keys, bufs) == n
            local.append(time.perf_counter() - t)
            t = time.perf_counter()
            got = ns2.get(keys, bufs)
            remote.append(time.perf_counter() - t)
            if got != n:
                raise RuntimeError(f"cross-node get returned {got} of {n} blocks")
            if rdma and c2.stats()["pod_peer_rdma_blocks"] < n * len(remote):
                raise RuntimeError("cross-node get over RDMA: some blocks went over TCP "
                                   "(pod_peer_rdma_blocks); see the nodes' logs")
            if not all(np.array_equal(a, b) for a, b in zip(bufs, data, strict=True)):
                raise RuntimeError("cross-node get returned wrong bytes")
            ns2.delete(keys)  # the next round fetches from the peer again
    out.append(Result(f"local get, TCP ({label})", nbytes / min(local) / GB, "GB/s"))
    out.append(Result(f"cross-node get, peer fetch ({label})", nbytes / min(remote) / GB,
                      "GB/s"))


def _all_found(ns: Any, keys: list[bytes]) -> bool:
    return bool(ns.lookup(keys).num_hits == len(keys))


def _nodes_cpu(clients: list[Client]) -> float:
    """The CPU seconds of every node the clients talk to (their Stats), summed."""
    return sum(float(c.stats()["process_cpu_seconds"]) for c in clients)


def _gets_ab(pods: dict[bool, LocalPod], total_mib: int, repeat: int, label: str,
             out: list[Result], limit: float, rdma: bool = False) -> None:
    """``--auth-ab``: :func:`_gets` on two pods at once, ``pods[True]`` with block
    authenticators on and ``pods[False]`` with them off, the arms alternated round by
    round (:func:`arm_order`). Each row as :func:`_gets` (the best of ``repeat``), the
    "off" one suffixed :data:`AUTH_OFF_SUFFIX`, each with its pod's two nodes' CPU per GB
    (the holder makes the authenticators, the fetching node checks them) and ``limit``
    (the socket's)."""
    n = max(1, (total_mib << 20) // BIG.block_nbytes)
    keys = chain_hashes(range(BIG.tokens_per_block * n), BIG.tokens_per_block)
    rng = np.random.default_rng(1)
    data = [rng.integers(0, 255, BIG.block_nbytes, dtype=np.uint8) for _ in range(n)]
    bufs = [np.empty(BIG.block_nbytes, np.uint8) for _ in range(n)]
    nbytes = n * BIG.block_nbytes
    times: dict[bool, dict[str, list[float]]] = {on: {"local": [], "remote": []}
                                                 for on in (True, False)}
    meters: dict[bool, CpuMeter] = {}
    with ExitStack() as stack:
        spaces: dict[bool, tuple[Any, Any]] = {}
        fetchers: dict[bool, Client] = {}
        for on, pod in pods.items():
            c1 = stack.enter_context(Client(pod.nodes[0].endpoint, transport="tcp"))
            c2 = stack.enter_context(Client(pod.nodes[1].endpoint, transport="tcp"))
            ns1 = c1.open_namespace(BIG, model_id="bench")
            ns2 = c2.open_namespace(BIG, model_id="bench")
            ns1.put(keys, data)
            _wait(functools.partial(_all_found, ns2, keys), "the index to publish")
            spaces[on], fetchers[on] = (ns1, ns2), c2
            meters[on] = CpuMeter(functools.partial(_nodes_cpu, [c1, c2]))
            meters[on].calibrate()
        for r in range(repeat):
            for on in arm_order(r):
                ns1, ns2 = spaces[on]
                with meters[on].phase("local", nbytes):
                    t = time.perf_counter()
                    assert ns1.get(keys, bufs) == n
                    times[on]["local"].append(time.perf_counter() - t)
                with meters[on].phase("remote", nbytes):
                    t = time.perf_counter()
                    got = ns2.get(keys, bufs)
                    times[on]["remote"].append(time.perf_counter() - t)
                if got != n:
                    raise RuntimeError(f"cross-node get ({ARMS[on]}) returned {got} of {n} "
                                       "blocks")
                if rdma and fetchers[on].stats()["pod_peer_rdma_blocks"] < n * (r + 1):
                    raise RuntimeError("cross-node get over RDMA: some blocks went over TCP "
                                       "(pod_peer_rdma_blocks); see the nodes' logs")
                if not all(np.array_equal(a, b) for a, b in zip(bufs, data, strict=True)):
                    raise RuntimeError(f"cross-node get ({ARMS[on]}) returned wrong bytes")
                ns2.delete(keys)  # the next round fetches from the peer again
    for on in (True, False):
        suffix = "" if on else AUTH_OFF_SUFFIX
        for phase, name in (("local", f"local get, TCP ({label})"),
                            ("remote", f"cross-node get, peer fetch ({label})")):
            out.append(Result(name + suffix, nbytes / min(times[on][phase]) / GB, "GB/s",
                              limit, meters[on].per_gb(phase)[0]))


def _shared_flash_ab(workdir: Path, blocks: int, rounds: int, out: list[Result]) -> None:
    """``--auth-ab``: the shared-flash rows (bench/pod_flash.py: writer and reader nodes in
    one child process) ``rounds`` times per arm, alternated; each row the median of its
    arm's runs, with the O_DIRECT limit of the same runs (the best), no CPU figure."""
    runs: dict[bool, list[list[FlashRow]]] = {True: [], False: []}
    for r in range(rounds):
        for on in arm_order(r):
            rows, stderr = shared_flash_run(workdir, blocks=blocks, batch=min(32, blocks),
                                            env=arm_env(on))
            check_output(stderr, on, f"the {ARMS[on]} shared-flash bench", "its stderr")
            runs[on].append(rows)
    for on in (True, False):
        suffix = "" if on else AUTH_OFF_SUFFIX
        for i, first in enumerate(runs[on][0]):
            same = [rows[i] for rows in runs[on]]
            value = statistics.median(row.value for row in same)
            limit = max(row.limit for row in same)
            out.append(Result(f"cross-node get, shared flash: {first.name}{suffix}", value,
                              first.unit, limit))


def _lookups(pod: LocalPod, calls: int, out: list[Result]) -> None:
    n1, n2 = pod.nodes[0], pod.nodes[1]
    keys = chain_hashes(range(SMALL.tokens_per_block * 10_000), SMALL.tokens_per_block)
    blocks = [np.full(SMALL.block_nbytes, i % 251, np.uint8) for i in range(10_000)]
    with Client(n1.endpoint) as c1, Client(n2.endpoint) as c2:
        c2.open_namespace(SMALL, model_id="local").put(keys, blocks)
        c2.open_namespace(SMALL, model_id="half").put(keys[:5000], blocks[:5000])
        c1.open_namespace(SMALL, model_id="half").put(keys[5000:], blocks[5000:])
        local = c2.open_namespace(SMALL, model_id="local")
        half = c2.open_namespace(SMALL, model_id="half")
        _wait(lambda: half.lookup(keys).num_hits == 10_000, "the index to publish")
        # Alternated call by call, so both cases see the same load on a shared machine.
        times: dict[str, list[float]] = {"all local": [], "half remote": []}
        for _ in range(calls):
            for name, ns in (("all local", local), ("half remote", half)):
                t = time.perf_counter()
                r = ns.lookup(keys)
                times[name].append(time.perf_counter() - t)
                assert r.num_hits == 10_000
        for name, ts in times.items():
            ts.sort()
            out.append(Result(f"10,000-key Lookup, {name}, p50", statistics.median(ts)
                              * 1e3, "ms"))
            out.append(Result(f"10,000-key Lookup, {name}, p99",
                              ts[min(len(ts) - 1, int(len(ts) * 0.99))] * 1e3, "ms"))
        # The remote part's own cost (the index round trip for 5,000 keys), by call pair.
        extra = sorted(h - lo for lo, h in zip(times["all local"], times["half remote"],
                                               strict=True))
        out.append(Result("10,000-key Lookup, remote part (half remote - all local), "
                          "median of call pairs", statistics.median(extra) * 1e3, "ms"))


def _parser() -> argparse.ArgumentParser:
    """The command's argument parser (also what tests/deploy/test_doc_shell_blocks.py
    checks the documented command lines with)."""
    ap = argparse.ArgumentParser(prog="ctxmem bench pod", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total-mib", type=int, default=64, help="MiB per get batch")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--lookups", type=int, default=50,
                    help="Lookup calls timed per case (0: no Lookup rows)")
    ap.add_argument("--flash-blocks", type=int, default=256,
                    help="blocks per size in the shared-flash rows")
    ap.add_argument("--workdir", default="/var/tmp",
                    help="where the shared-flash file goes (O_DIRECT: not tmpfs)")
    ap.add_argument("--rdma-listen", default="",
                    help="IP of an RDMA device: add the cross-node get over RDMA rows")
    ap.add_argument("--rdma-device", default="", help="the RDMA device (with --rdma-listen)")
    ap.add_argument("--no-shared-flash", action="store_true",
                    help="skip the shared-flash rows (no O_DIRECT filesystem at --workdir)")
    ap.add_argument("--peer", choices=["mooncake"], default=None,
                    help="also run Mooncake Store's cross-client get (its master and a "
                         "holder process; bench/peer_mooncake.py) in the same run")
    ap.add_argument("--auth-ab", action="store_true",
                    help="block authenticators on and off: two pods of each kind at once, "
                         "one whose nodes run with them off (a benchmark harness, "
                         "bench/auth_ab.py), the rounds alternated on/off, off/on; the get "
                         "and shared-flash rows (no Lookup rows), each printed with both "
                         "figures, on/off and the nodes' CPU per GB of each")
    ap.add_argument("--json", default="")
    return ap


def run(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if not args.no_shared_flash and not Path(args.workdir).is_dir():
        ap.error(f"--workdir {args.workdir}: not an existing directory (the shared-flash "
                 "rows put their device file there; create it, or give --no-shared-flash)")
    if args.auth_ab and args.peer:
        ap.error("--auth-ab measures ctxmem against itself: it takes no --peer")
    if args.peer:
        from ctxmem_tools.bench import peer_mooncake

        try:
            peer_mooncake.mooncake_version()
            peer_mooncake.master_binary()
        except peer_mooncake.PeerUnavailable as exc:
            ap.error(str(exc))
    socket_gbs = loopback_rate() / GB
    out = [Result("TCP loopback socket, 1 stream", socket_gbs, "GB/s")]
    cfg: dict[str, Any] = {"dram_size": "512MiB", "dram_slab": "16MiB", "flash_size": None}
    off_counts: dict[str, tuple[int, int] | None] = {}
    with tempfile.TemporaryDirectory(prefix="ctxmem-bench-pod-") as tmp:
        root = Path(tmp)

        def gets(kind: str, label: str, rdma: bool = False, **pod: Any) -> None:
            """The get rows of one kind of pod: one pod, or an "on" and an "off" one."""
            if not args.auth_ab:
                with LocalPod(root / kind, 2, pod=pod, **cfg) as one:
                    _gets(one, args.total_mib, args.repeat, label, out, rdma=rdma)
                    if kind == "plain" and args.lookups:
                        _lookups(one, args.lookups, out)
                return
            logs: dict[bool, list[Path]] = {}
            with ExitStack() as stack:
                pods: dict[bool, LocalPod] = {}
                for on in (True, False):
                    pods[on] = stack.enter_context(LocalPod(
                        root / f"{kind}-{ARMS[on]}", 2, pod=pod, env=arm_env(on), **cfg))
                    logs[on] = [node.log_path for node in pods[on].nodes]
                for on in (True, False):  # at start and at the end
                    for i, log in enumerate(logs[on]):
                        check_arm(log, on, f"node {i + 1} of the {ARMS[on]} pod ({kind})")
                _gets_ab(pods, args.total_mib, args.repeat, label, out, socket_gbs, rdma)
                for on in (True, False):
                    for i, log in enumerate(logs[on]):
                        check_arm(log, on, f"node {i + 1} of the {ARMS[on]} pod ({kind})")
            off_counts[kind] = _summed([exit_counts(log) for log in logs[False]])

        gets("plain", "plaintext")
        pki = make_pki(root / "pki", tenants=())
        cert, key = member_cert(pki, "member")
        gets("tls", "mTLS 1.3 between nodes", tls_cert_file=str(cert),
             tls_key_file=str(key), tls_ca_file=str(pki.ca))
        if args.rdma_listen:
            gets("rdma", "RDMA between nodes", rdma=True, rdma_listen=args.rdma_listen,
                 rdma_device=args.rdma_device)
        if args.peer:
            for block, size in ((2 << 20, "2MiB"), (64 << 10, "64KiB")):
                times = peer_mooncake.cross_client_gets(
                    root / f"mooncake-{size}", block, args.total_mib << 20, args.repeat)
                nbytes = max(1, (args.total_mib << 20) // block) * block
                out.append(Result(f"cross-node get, Mooncake B <- A over TCP ({size})",
                                  nbytes / min(times) / GB, "GB/s", socket_gbs))
            mc = {r.name: r.value for r in out}
            ours = mc["cross-node get, peer fetch (plaintext)"]
            theirs = mc["cross-node get, Mooncake B <- A over TCP (2MiB)"]
            out.append(Result("cross-node get 2 MiB, ctxmem plaintext / Mooncake (ratio)",
                              ours / theirs, "x"))
    # Shared flash: a get straight from a device several nodes attach, next to the
    # device's own O_DIRECT read of the same extents (alternated in the same rounds).
    if args.auth_ab and not args.no_shared_flash:
        _shared_flash_ab(Path(args.workdir), args.flash_blocks, max(1, args.repeat // 2),
                         out)
    else:
        flash = [] if args.no_shared_flash else measure_shared_flash(
            Path(args.workdir), blocks=args.flash_blocks, batch=min(32, args.flash_blocks))
        for f in flash:
            out.append(Result(f"cross-node get, shared flash: {f.name}", f.value, f.unit,
                              f.limit))
    width = max(len(r.name) for r in out)
    for r in out:
        limit = "" if r.limit != r.limit else f"   limit {r.limit:9.3f} {r.unit} " \
            f"({r.value / r.limit:.2f})"
        print(f"{r.name:<{width}}  {r.value:9.3f} {r.unit}{limit}")
    doc: dict[str, Any] = {"results": [asdict(r) for r in out]}
    if args.auth_ab:
        ab = pair_rows(out, AUTH_OFF_SUFFIX, units=("GB/s", "us"))
        print_rows(ab, args.repeat)
        print("  (GB/s rows: the best of the rounds, as without --auth-ab; shared-flash "
              "rows: the median of the runs, 'us' rows are latencies: on/off above 1 is "
              "the cost)")
        for kind, counts in off_counts.items():
            said = "no count logged at exit" if counts is None else \
                f"{counts[0]} tags and {counts[1]} checks not computed"
            print(f"  'off' pod ({kind}), both nodes: {said}")
        doc["auth_ab"] = [asdict(r) for r in ab]
        doc["auth_off_counts"] = {k: None if c is None else {"tags": c[0], "verifies": c[1]}
                                  for k, c in off_counts.items()}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


def _summed(counts: list[tuple[int, int] | None]) -> tuple[int, int] | None:
    """The (tags, checks) of several "off" nodes together; None if one logged none."""
    if any(c is None for c in counts):
        return None
    return (sum(c[0] for c in counts if c), sum(c[1] for c in counts if c))
