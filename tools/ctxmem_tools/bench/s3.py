"""``ctxmem bench s3``: put/get throughput of each S3 client through ctxmem's S3 endpoint
(docs/s3.md), next to the native path (the shim), in one run against one service.

One service (encryption on, the default; DRAM sized for the data) with ``s3.listen`` on
loopback. Each round moves ``--mib`` MiB as ``--object`` sized objects (2 MiB: a KV
chunk) through:

* ``native``: the shim (``ctxmem.Client``, its default transport: shared memory on one
  host), one batched ``put`` and one ``get`` of every block;
* ``boto3``: PutObject/GetObject, ``--concurrency`` threads (one client each);
* ``nixl``: NIXL's OBJ backend (aws-sdk-cpp), one WRITE and one READ transfer of every
  object, ``num_threads`` = ``--concurrency``: the client under vLLM's ``obj`` secondary
  tier and SGLang's HiCacheNixl (needs ``import nixl``: ``deploy/ci/site.sh nixl`` on
  ``PYTHONPATH``);
* ``awscrt``: AWS CRT's S3 client (PUT_OBJECT/GET_OBJECT meta requests, all in flight at
  once), the client under LMCache's ``s3`` L2 adapter and ``s3://`` backend, path-style
  here (LMCache itself addresses ``BUCKET.HOST``);
* ``aws-cli``: ``aws s3 cp --recursive`` of a directory of the objects up and down
  (``python -m awscli`` from ``deploy/ci/site.sh awscli``; files on tmpfs when
  ``/dev/shm`` exists): the CLI's process start and file I/O included.

A client that cannot be imported is reported as skipped, with what to install. Each
figure is the median over ``--rounds`` rounds (after one warm-up round), in MB/s (10^6
bytes per second), with its ratio to the native figure of the same direction; ``--json`` writes
``{"results": [{"client", "op", "mb_s", "of_native"}], ...}``. Every get is checked
byte-exact against what was put.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ctxmem.client import Client
from ctxmem_common.keys import chain_hashes
from ctxmem_common.layout import KVLayout
from ctxmem_tools.launcher import ServiceProcess, free_port, local_config

MiB = 1 << 20
KEY_ID, SECRET = "AKIABENCHS3000001", "ctxmem-bench-s3-secret-0123456789"
REGION = "us-east-1"
REPO = Path(__file__).resolve().parents[3]

Round = Callable[[int], tuple[float, float]]  # round -> (put seconds, get seconds)


class Skip(Exception):
    """A client that cannot run here; the message says what to install."""


def _objects(count: int, size: int) -> list[np.ndarray]:
    rng = np.random.default_rng(30)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(count)]


def _check(name: str, got: list[Any], want: list[np.ndarray]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if not np.array_equal(np.frombuffer(g, dtype=np.uint8), w):
            raise RuntimeError(f"{name}: object {i} read back differs from what was put")


def native_round(svc: ServiceProcess, bufs: list[np.ndarray]) -> Round:
    size = bufs[0].nbytes
    layout = KVLayout(dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=size // 2,
                      tokens_per_block=1)
    client = Client(svc.endpoint)
    ns = client.open_namespace(layout, model_id="bench-s3-native")
    outs = [np.empty(size, dtype=np.uint8) for _ in bufs]

    def one(r: int) -> tuple[float, float]:
        keys = chain_hashes(np.arange(len(bufs)) + r * len(bufs), 1, salt=b"bench-s3")
        t0 = time.perf_counter()
        res = ns.put(keys, bufs)
        t1 = time.perf_counter()
        n = ns.get(keys, outs)
        t2 = time.perf_counter()
        if res.stored != len(bufs) or n != len(bufs):
            raise RuntimeError(f"native: stored {res.stored}, got {n} of {len(bufs)}")
        _check("native", outs, bufs)
        ns.delete(keys)
        return t1 - t0, t2 - t1

    one.close = client.close  # type: ignore[attr-defined]
    return one


def boto3_round(url: str, bufs: list[np.ndarray], threads: int) -> Round:
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:
        raise Skip("boto3 is not installed (pip install boto3)") from exc
    local = threading.local()

    def client() -> Any:
        if not hasattr(local, "c"):
            local.c = boto3.client("s3", endpoint_url=url, region_name=REGION,
                                   aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET,
                                   config=Config(s3={"addressing_style": "path"},
                                                 max_pool_connections=threads))
        return local.c

    client().create_bucket(Bucket="bench-boto3")
    pool = ThreadPoolExecutor(threads)

    def one(r: int) -> tuple[float, float]:
        keys = [f"r{r}/o{i}" for i in range(len(bufs))]
        t0 = time.perf_counter()
        list(pool.map(lambda kb: client().put_object(Bucket="bench-boto3", Key=kb[0],
                                                     Body=kb[1].tobytes()),
                      zip(keys, bufs, strict=True)))
        t1 = time.perf_counter()
        got = list(pool.map(lambda k: client().get_object(Bucket="bench-boto3",
                                                          Key=k)["Body"].read(), keys))
        t2 = time.perf_counter()
        _check("boto3", got, bufs)
        client().delete_objects(Bucket="bench-boto3", Delete={
            "Objects": [{"Key": k} for k in keys], "Quiet": True})
        return t1 - t0, t2 - t1

    one.close = lambda: pool.shutdown()  # type: ignore[attr-defined]
    return one


def nixl_round(port: int, bufs: list[np.ndarray], threads: int) -> Round:
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise Skip("nixl is not importable (bash deploy/ci/site.sh nixl; put the directory "
                   "it prints on PYTHONPATH)") from exc
    agent = nixl_agent("ctxmem-bench-s3", nixl_agent_config(backends=[]))
    agent.create_backend("OBJ", {"bucket": "bench-nixl", "scheme": "http", "region": REGION,
                                 "endpoint_override": f"http://127.0.0.1:{port}",
                                 "access_key": KEY_ID, "secret_key": SECRET,
                                 "num_threads": str(threads)})
    size = bufs[0].nbytes
    outs = [np.zeros(size, dtype=np.uint8) for _ in bufs]
    dram = agent.register_memory([(b.ctypes.data, size, 0, "") for b in bufs + outs], "DRAM")

    def xfer(op: str, src: list[np.ndarray], keys: list[str], first_dev: int) -> None:
        objs = agent.register_memory([(0, size, first_dev + i, k) for i, k in enumerate(keys)],
                                     "OBJ")
        local = agent.get_xfer_descs([(b.ctypes.data, size, 0) for b in src], "DRAM")
        remote = agent.get_xfer_descs([(0, size, first_dev + i) for i in range(len(keys))],
                                      "OBJ")
        handle = agent.initialize_xfer(op, local, remote, agent.name)
        state = agent.transfer(handle)
        deadline = time.monotonic() + 600
        while state not in ("DONE", "ERR") and time.monotonic() < deadline:
            time.sleep(0.0005)
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        agent.deregister_memory(objs)
        if state != "DONE":
            raise RuntimeError(f"nixl: {op} of {len(keys)} objects ended {state}")

    def one(r: int) -> tuple[float, float]:
        keys = [f"r{r}/o{i}" for i in range(len(bufs))]
        base = 1 + 2 * r * len(bufs)
        t0 = time.perf_counter()
        xfer("WRITE", bufs, keys, base)
        t1 = time.perf_counter()
        xfer("READ", outs, keys, base + len(bufs))
        t2 = time.perf_counter()
        _check("nixl", outs, bufs)
        for o in outs:
            o.fill(0)
        return t1 - t0, t2 - t1

    one.close = lambda: agent.deregister_memory(dram)  # type: ignore[attr-defined]
    return one


def awscrt_round(port: int, bufs: list[np.ndarray], threads: int) -> Round:
    try:
        from awscrt import auth, io, s3
        from awscrt.http import HttpHeaders, HttpRequest
    except ImportError as exc:
        raise Skip("awscrt is not installed (pip install awscrt)") from exc
    elg = io.EventLoopGroup(threads)
    bootstrap = io.ClientBootstrap(elg, io.DefaultHostResolver(elg))
    creds = auth.AwsCredentialsProvider.new_static(KEY_ID, SECRET)
    client = s3.S3Client(bootstrap=bootstrap, region=REGION, tls_mode=s3.S3RequestTlsMode.DISABLED,
                         credential_provider=creds)
    host = f"127.0.0.1:{port}"
    size = bufs[0].nbytes
    outs = [bytearray(size) for _ in bufs]

    def request(method: str, key: str, i: int) -> Any:
        headers = HttpHeaders([("Host", host)])
        body = None
        if method == "PUT":
            headers.add("Content-Length", str(size))
            body = _Stream(memoryview(bufs[i].data).cast("B"))
        out = memoryview(outs[i])

        def on_body(chunk: bytes, offset: int, **_: Any) -> None:
            out[offset:offset + len(chunk)] = chunk

        return s3.S3Request(
            client=client, request=HttpRequest(method, f"/bench-awscrt/{key}", headers, body),
            type=s3.S3RequestType.PUT_OBJECT if method == "PUT" else s3.S3RequestType.GET_OBJECT,
            on_body=on_body if method == "GET" else None, credential_provider=creds,
            region=REGION)

    def all_done(method: str, keys: list[str]) -> None:
        reqs = [request(method, k, i) for i, k in enumerate(keys)]
        for req in reqs:
            req.finished_future.result(timeout=600)

    def one(r: int) -> tuple[float, float]:
        keys = [f"r{r}/o{i}" for i in range(len(bufs))]
        t0 = time.perf_counter()
        all_done("PUT", keys)
        t1 = time.perf_counter()
        all_done("GET", keys)
        t2 = time.perf_counter()
        _check("awscrt", outs, bufs)
        return t1 - t0, t2 - t1

    return one


class _Stream:
    """A read-only stream over a memoryview (what awscrt reads a PUT body from)."""

    def __init__(self, mv: memoryview) -> None:
        self.mv, self.pos = mv, 0

    def read(self, n: int = -1) -> memoryview:
        end = len(self.mv) if n < 0 else min(len(self.mv), self.pos + n)
        out, self.pos = self.mv[self.pos:end], end
        return out

    def readinto(self, buf: Any) -> int:
        chunk = self.read(len(buf))
        memoryview(buf).cast("B")[:len(chunk)] = chunk
        return len(chunk)

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else (self.pos + offset if whence == 1
                                               else len(self.mv) + offset)
        return self.pos


def awscli_round(url: str, bufs: list[np.ndarray], threads: int, site: str | None,
                 scratch: Path) -> Round:
    if site is None:
        raise Skip("the AWS CLI's directory is not given (--awscli-site "
                   "$(bash deploy/ci/site.sh awscli))")
    env = {**os.environ, "PYTHONPATH": site, "AWS_ACCESS_KEY_ID": KEY_ID,
           "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": REGION,
           "AWS_CONFIG_FILE": str(scratch / "aws-config"),
           "AWS_SHARED_CREDENTIALS_FILE": str(scratch / "absent"),
           "AWS_EC2_METADATA_DISABLED": "true"}
    (scratch / "aws-config").write_text(
        f"[default]\ns3 =\n  max_concurrent_requests = {threads}\n")
    up, down = scratch / "up", scratch / "down"
    up.mkdir()
    for i, b in enumerate(bufs):
        (up / f"o{i:05d}").write_bytes(b.tobytes())

    def aws(*args: str) -> None:
        quiet = ["--only-show-errors"] if args[1] in ("cp", "rm") else []
        out = subprocess.run([sys.executable, "-m", "awscli", "--endpoint-url", url, *args,
                              *quiet], capture_output=True, text=True, timeout=900, env=env)
        if out.returncode:
            raise RuntimeError(f"aws {' '.join(args)}: {out.stderr[-2000:]}")

    aws("s3", "mb", "s3://bench-cli")

    def one(r: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        aws("s3", "cp", "--recursive", str(up), f"s3://bench-cli/r{r}/")
        t1 = time.perf_counter()
        aws("s3", "cp", "--recursive", f"s3://bench-cli/r{r}/", str(down))
        t2 = time.perf_counter()
        _check("aws-cli", [(down / f"o{i:05d}").read_bytes() for i in range(len(bufs))], bufs)
        shutil.rmtree(down)
        aws("s3", "rm", "--recursive", f"s3://bench-cli/r{r}/")
        return t1 - t0, t2 - t1

    return one


@contextlib.contextmanager
def _service(base: Path, mib: int, chunk: int) -> Iterator[tuple[ServiceProcess, int]]:
    port = free_port()
    cfg = local_config(base / "svc", dram_size=f"{max(512, 3 * mib)}MiB", dram_slab="32MiB",
                       s3={"listen": f"127.0.0.1:{port}", "chunk_size": f"{chunk // MiB}MiB",
                           "access_keys": {KEY_ID: {"tenant": "bench", "secret": SECRET}}})
    with ServiceProcess(base / "svc", cfg) as svc:
        yield svc, port


def run(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ctxmem bench s3", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256, help="MiB moved per round and client")
    p.add_argument("--object-mib", type=int, default=2, help="object (and block) size in MiB")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4,
                   help="requests in flight per S3 client (threads, NIXL's num_threads)")
    p.add_argument("--clients", default="native,boto3,nixl,awscrt,aws-cli")
    p.add_argument("--awscli-site", default=os.environ.get("CTXMEM_AWSCLI_SITE"),
                   help="the AWS CLI's package directory (deploy/ci/site.sh awscli)")
    p.add_argument("--quick", action="store_true", help="16 MiB, one round (smoke test)")
    p.add_argument("--json", help="write the results as JSON here")
    args = p.parse_args(argv)
    mib, rounds = (16, 1) if args.quick else (args.mib, args.rounds)
    size = args.object_mib * MiB
    count = max(1, mib * MiB // size)
    bufs = _objects(count, size)
    nbytes = count * size
    wanted = [c.strip() for c in args.clients.split(",") if c.strip()]
    print(f"ctxmem bench s3: {count} objects of {args.object_mib} MiB ({nbytes / MiB:.0f} MiB) "
          f"per round, {rounds} round(s), {args.concurrency} in flight per S3 client, "
          f"plain HTTP on loopback, encryption on; cpus {os.cpu_count()}")
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    tmp_root = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="ctxmem-bench-s3-") as tmp, \
            tempfile.TemporaryDirectory(prefix="ctxmem-bench-s3-files-", dir=tmp_root) as files, \
            _service(Path(tmp), nbytes // MiB, size if size <= 2 * MiB else 2 * MiB) as (svc, port):
        url = f"http://127.0.0.1:{port}"
        makers: dict[str, Callable[[], Round]] = {
            "native": lambda: native_round(svc, bufs),
            "boto3": lambda: boto3_round(url, bufs, args.concurrency),
            "nixl": lambda: nixl_round(port, bufs, args.concurrency),
            "awscrt": lambda: awscrt_round(port, bufs, args.concurrency),
            "aws-cli": lambda: awscli_round(url, bufs, args.concurrency, args.awscli_site,
                                            Path(files)),
        }
        native: dict[str, float] = {}
        for name in wanted:
            if name not in makers:
                p.error(f"unknown client {name!r} (one of {', '.join(makers)})")
            try:
                one = makers[name]()
            except Skip as exc:
                skipped[name] = str(exc)
                print(f"  {name:8s} skipped: {exc}", flush=True)
                continue
            one(rounds)  # a warm-up round, not counted (connections, mappings, caches)
            times = [one(r) for r in range(rounds)]
            close = getattr(one, "close", None)
            if close is not None:
                close()
            for op, idx in (("put", 0), ("get", 1)):
                mb_s = nbytes / statistics.median(t[idx] for t in times) / 1e6
                if name == "native":
                    native[op] = mb_s
                of = mb_s / native[op] if op in native else None
                results.append({"client": name, "op": op, "mb_s": round(mb_s, 1),
                                "of_native": None if of is None else round(of, 3)})
                rel = "" if of is None or name == "native" else f"  ({of:.2f} of native)"
                print(f"  {name:8s} {op}  {mb_s:8.1f} MB/s{rel}", flush=True)
    digest = hashlib.sha256(b"".join(b.tobytes()[:64] for b in bufs)).hexdigest()[:12]
    if args.json:
        Path(args.json).write_text(json.dumps({
            "results": results, "skipped": skipped, "objects": count,
            "object_bytes": size, "rounds": rounds, "concurrency": args.concurrency,
            "data": digest}, indent=2) + "\n")
    return 0
