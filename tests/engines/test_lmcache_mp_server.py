"""A real ``lmcache server`` (LMCache 0.5.6's MP server) with ctxmem as its L2 adapter.

The server is LMCache's own CLI process, started with docs/deploy.md's ``lmcache
server`` command line as written (its flags and its ``--l2-adapter`` JSON, pointed at a
real ctxmem service; a documented flag LMCache refuses, or a missing ``--disable-metrics``
in this venv without OpenTelemetry's Prometheus exporter, fails here), plus the test's own
loopback ports, a small CPU L1 and ``--supported-transfer-mode auto``. The client is
LMCache's own MP client, the one vLLM's ``LMCacheMPConnector`` drives: ``LMCacheMPWorkerAdapter``
(registers the worker's paged KV and stores/retrieves blocks over ZMQ) and
``LMCacheMPSchedulerAdapter`` (lookups, which prefetch from L2 into L1). The paged KV is
a CPU tensor in vLLM's flash layout; LMCache's CPU transfer context moves it.

The server is restarted between store and load, so the loaded bytes came from ctxmem.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
lmcache = pytest.importorskip("lmcache", reason="LMCache 0.5.6 is installed by "
                              "deploy/setup.sh (plain pip) into the main venv")
torch = pytest.importorskip("torch")
pytest.importorskip("fastapi", reason="`lmcache server` needs fastapi/uvicorn/"
                    "opentelemetry/blake3: deploy/setup.sh installs them")
pytest.importorskip("blake3", reason="`lmcache server` hashes tokens with blake3")
zmq = pytest.importorskip("zmq")

from lmcache.integration.vllm.vllm_multi_process_adapter import (  # noqa: E402
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
    ParallelStrategy,
)

from tests import kit  # noqa: E402
from tests.engines.lmcache_proc import LMCacheServerProcess  # noqa: E402
from tests.engines.test_lmcache_mp import (  # noqa: E402
    documented_l2_adapter,
    documented_server_args,
)

CHUNK, BLOCK, LAYERS, HEADS, HEAD, BLOCKS = 16, 16, 2, 2, 8, 8
MODEL = "tiny-llama-mp"
LMCACHE_BIN = Path(sys.executable).with_name("lmcache")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LMCacheServer(LMCacheServerProcess):
    """``lmcache server`` as a subprocess; ``start`` waits (bounded) for its ZMQ port."""

    def __init__(self, workdir: Path, endpoint: str) -> None:
        super().__init__(workdir, free_port())
        spec = documented_l2_adapter()
        spec["adapter_params"] = {**spec["adapter_params"], "endpoint": endpoint,
                                  "timeout_s": 10.0}
        # docs/deploy.md's command as given (its flags, e.g. --disable-metrics, which this
        # venv needs: it has no OpenTelemetry Prometheus exporter), the adapter's endpoint
        # pointed at the test's service; then what a test needs on top (argparse keeps
        # the last value): loopback ports of its own, a small L1 and chunk, and the CPU
        # transfer mode docs/deploy.md names for CPU-only hosts.
        doc = documented_server_args()
        doc[doc.index("--l2-adapter") + 1] = json.dumps(spec)
        self.args = [str(LMCACHE_BIN), "server", *doc, "--host", "127.0.0.1",
                     "--port", str(self.port), "--chunk-size", str(CHUNK),
                     "--l1-size-gb", "0.05", "--supported-transfer-mode", "auto",
                     "--http-host", "127.0.0.1", "--http-port", str(free_port())]


@pytest.fixture
def lmcache_server(service: Any, tmp_path: Path) -> Iterator[LMCacheServer]:
    srv = LMCacheServer(tmp_path, service.endpoint)
    srv.start()
    yield srv
    srv.stop()


def strategy() -> ParallelStrategy:
    return ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0,
                            tp_size=1, pp_size=1, n_servers=1)


def paged_kv() -> dict[str, Any]:
    """vLLM's flash layout per layer: ``[2, blocks, block size, heads, head]``."""
    return {f"model.layers.{i}.self_attn.attn":
            torch.zeros(2, BLOCKS, BLOCK, HEADS, HEAD, dtype=torch.bfloat16)
            for i in range(LAYERS)}


def clients(url: str, ctx: Any) -> tuple[Any, Any, dict[str, Any]]:
    extra = {"lmcache.mp.mq_timeout": 20.0}
    sched = LMCacheMPSchedulerAdapter([url], ctx, MODEL, BLOCK, strategy(),
                                      extra_config=extra)
    worker = LMCacheMPWorkerAdapter(url, ctx, MODEL, BLOCK, strategy(), extra_config=extra)
    kv = paged_kv()
    worker.register_kv_caches(kv, layout_hints={"kv_layout": "NHD"})
    return sched, worker, kv


def until(what: str, poll: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    """``poll``'s first true value (see :func:`tests.kit.until`)."""
    return kit.until(poll, timeout_s, f"LMCache's MP client: {what} to finish")


def lookup(sched: Any, rid: str, tokens: list[int]) -> int:
    sched.maybe_submit_lookup_request(rid, tokens)
    got: list[int] = []

    def poll() -> bool:
        result = sched.check_lookup_result(rid)
        if result is not None:
            got.append(int(result))
        return bool(got)

    until(f"lookup {rid}", poll)
    return got[0]


def test_real_lmcache_server_stores_into_ctxmem_and_loads_after_restart(
        lmcache_server: LMCacheServer) -> None:
    tokens = list(range(1000, 1000 + 3 * CHUNK))
    blocks = [[1, 2, 3]]
    g = torch.Generator().manual_seed(11)
    ctx = zmq.Context()
    try:
        sched, worker, kv = clients(lmcache_server.url, ctx)
        for t in kv.values():
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        want = {n: t[:, 1:4].clone() for n, t in kv.items()}
        op = LoadStoreOp(token_ids=tokens, block_ids=blocks, start=0, end=len(tokens))
        worker.submit_store_request("store-1", op, None)
        until("store", lambda: "store-1" in (worker.get_finished({"store-1"})[0] or ()))
        worker.shutdown()
        sched.shutdown()

        lmcache_server.stop()  # its L1 is gone: what loads now comes from ctxmem
        lmcache_server.start()
        sched, worker, kv = clients(lmcache_server.url, ctx)
        assert lookup(sched, "load-1", tokens) == 3 * CHUNK
        op = LoadStoreOp(token_ids=tokens, block_ids=[[4, 5, 6]], start=0, end=len(tokens))
        worker.submit_retrieve_request("load-1", op, None)
        until("retrieve", lambda: "load-1" in (worker.get_finished(set())[1] or ()))
        assert not worker.get_block_ids_with_load_errors()
        for name, t in kv.items():
            got = t[:, 4:7].contiguous().view(torch.uint8)
            assert torch.equal(got, want[name].contiguous().view(torch.uint8)), name
        assert lookup(sched, "miss-1", [7] * (2 * CHUNK)) == 0
        worker.shutdown()
        sched.shutdown()
    finally:
        ctx.destroy(linger=0)
