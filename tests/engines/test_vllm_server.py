"""A real OpenAI-compatible vLLM server (vllm-cpu 0.32.0) with ctxmem's documented flags.

Issue 30 item 5: CI starts an engine server, so a documented command that does not serve
fails here. The server is the command docs/engines.md gives for ``CtxmemConnector``,
taken from the doc as the shell reads it (``vllm_flags_check.vllm_commands``: its
environment, ``python -m vllm.entrypoints.openai.api_server`` and its flags), with
``MODEL`` and the endpoint filled in and what a small CI run adds on top: a tiny
random-weight Llama with a word-level tokenizer built locally (no hub,
``ctxmem_tools.bench.engine.build_tiny_model``), vLLM's own prefix cache off (so a
repeated prefix can only come from ctxmem), 32-token blocks, a loopback port, and
``VLLM_CPU_OMP_THREADS_BIND`` pinning it to one core. ctxmem's package metadata (its
wheel, built from this checkout) is on the path after the source roots, as for the flag
check. Against a real ``ctxmem serve`` with a flash file:

1. a prompt of 4 blocks plus a tail: stored (``vllm:ctxmem_saved_blocks``);
2. the same prompt again: its 4 prefix blocks loaded from ctxmem -- vLLM's ``/metrics``
   (``vllm:ctxmem_loaded_blocks_total``) and the service's Stats (``hits_dram`` +
   ``hits_flash``) both count 4 more, and the greedy completion text equals the first's;
3. the ctxmem service restarted under the running server (same config and flash file:
   the blocks survive), then the prompt a third time: 4 more loaded, the text unchanged,
   every request answered within its timeout (the server did not hang).

Every wait is bounded: the server's readiness (``/health`` polled, 300 s), each request
(120 s), each metrics poll (30 s). Measured on the shared 2-core machine: see
docs/testing.md ("Engine server").
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ctxmem.client import Client
from ctxmem_tools.bench.engine import (
    BLOCK,
    ROOTS,
    SERVER,
    VllmServer,
    build_tiny_model,
    complete,
    engine_python,
    words_prompt,
)
from ctxmem_tools.launcher import ServiceProcess, local_config
from tests.engines.test_vllm_real import ctxmem_site  # noqa: F401  (a fixture)
from tests.engines.vllm_flags_check import split_command, vllm_commands
from tests.kit import read_until

PREFIX_BLOCKS = 4
REQUEST_S = 120.0
METRICS_S = 30.0


@pytest.fixture(scope="module")
def vllm_python() -> str:
    if os.environ.get("CTXMEM_SKIP_ENGINE_VENVS") == "1":
        pytest.skip("CTXMEM_SKIP_ENGINE_VENVS=1: the vllm-cpu side environment is off")
    return engine_python("vllm-cpu")


def documented_command(endpoint: str, model: Path) -> tuple[dict[str, str], list[str]]:
    """docs/engines.md's ``CtxmemConnector`` server command: (env, flags), ``MODEL`` and
    the service endpoint filled in."""
    found = [(where, words) for where, words in vllm_commands()
             if where.startswith("docs/engines.md") and "CtxmemConnector" in " ".join(words)]
    assert len(found) == 1, f"docs/engines.md: want one CtxmemConnector block, got {found}"
    env, program, args = split_command(list(found[0][1]))
    assert program == ["python", *SERVER], f"docs/engines.md starts vLLM as {program}"
    assert args.count("MODEL") == 1, args
    args[args.index("MODEL")] = str(model)
    i = args.index("--kv-transfer-config") + 1
    cfg = json.loads(args[i])
    assert cfg["kv_connector_extra_config"]["ctxmem.endpoint"] == "127.0.0.1:50051", cfg
    cfg["kv_connector_extra_config"]["ctxmem.endpoint"] = endpoint
    args[i] = json.dumps(cfg)
    return env, args


@pytest.fixture
def service(tmp_path: Path) -> Iterator[ServiceProcess]:
    svc = ServiceProcess(tmp_path / "svc", local_config(tmp_path / "svc"))
    yield svc
    svc.stop()


def hits(endpoint: str) -> int:
    with Client(endpoint) as c:
        s = c.stats()
    return int(s.get("hits_dram", 0) + s.get("hits_flash", 0))


def wait_metric(srv: VllmServer, name: str, want: float) -> float:
    """Poll ``/metrics`` until ``name`` reaches ``want`` (bounded); its last value."""
    return read_until(lambda: srv.metrics().get(name, 0.0), lambda got: got >= want,
                      METRICS_S, 0.5)


def test_vllm_server_loads_prefix_from_ctxmem_across_a_service_restart(
        vllm_python: str, ctxmem_site: Path, service: ServiceProcess,  # noqa: F811
        tmp_path: Path) -> None:
    t_start = time.monotonic()
    model = build_tiny_model(vllm_python, tmp_path / "tiny")
    env, args = documented_command(service.endpoint, model)
    args += ["--served-model-name", "tiny", "--dtype", "bfloat16", "--max-model-len", "512",
             "--block-size", str(BLOCK), "--no-enable-prefix-caching", "--enforce-eager",
             "--max-num-seqs", "2"]
    srv = VllmServer(vllm_python, args, tmp_path, cpus="0", env=env,
                     path=[*ROOTS, str(ctxmem_site)])
    prompt = words_prompt(PREFIX_BLOCKS * BLOCK, seed=7) + " w5 w6 w7"
    loaded = "vllm:ctxmem_loaded_blocks_total"
    try:
        startup = srv.start(timeout_s=300)

        def ask() -> str:
            return complete(srv.url, "tiny", prompt, max_tokens=4, timeout_s=REQUEST_S)[1]

        first = ask()
        saved = wait_metric(srv, "vllm:ctxmem_saved_blocks_total", PREFIX_BLOCKS)
        assert saved >= PREFIX_BLOCKS, (f"the first request saved {saved} blocks to ctxmem "
                                        f"(want {PREFIX_BLOCKS}); server log:\n{srv.log()}")
        m0, h0 = srv.metrics().get(loaded, 0.0), hits(service.endpoint)
        assert m0 == 0, f"a cold request loaded {m0} blocks"

        second = ask()
        m1 = wait_metric(srv, loaded, m0 + PREFIX_BLOCKS)
        h1 = hits(service.endpoint)
        assert second == first, f"the repeat (loaded from ctxmem) {second!r} != {first!r}"
        assert m1 - m0 == PREFIX_BLOCKS, (f"vLLM's /metrics counts {m1 - m0} blocks loaded "
                                          f"from ctxmem (want {PREFIX_BLOCKS})")
        assert h1 - h0 == m1 - m0, (f"ctxmem's Stats count {h1 - h0} hits, vLLM's /metrics "
                                    f"{m1 - m0} loaded blocks")

        # The service restarted under the running server: same config, same flash file.
        service.restart()
        h2 = hits(service.endpoint)
        t0 = time.monotonic()
        third = ask()
        took = time.monotonic() - t0
        m3 = wait_metric(srv, loaded, m1 + PREFIX_BLOCKS)
        h3 = hits(service.endpoint)
        assert third == first, f"after a ctxmem restart: {third!r} != {first!r}"
        assert m3 - m1 == PREFIX_BLOCKS, (
            f"after a ctxmem restart vLLM loaded {m3 - m1} blocks (want {PREFIX_BLOCKS}: "
            f"the blocks survive on flash); server log:\n{srv.log()}")
        assert h3 - h2 == m3 - m1, (f"after the restart ctxmem's Stats count {h3 - h2} "
                                    f"hits, vLLM's /metrics {m3 - m1}")
        assert srv.metrics().get("vllm:ctxmem_failed_blocks_total", 0.0) == 0
        print(f"server start {startup:.1f} s, request after the restart {took:.2f} s, "
              f"test {time.monotonic() - t_start:.1f} s")
    finally:
        srv.stop()
