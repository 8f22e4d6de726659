"""ctxmem as an L2 adapter of LMCache's multi-process server, through LMCache's own code.

The adapter is built exactly as ``lmcache server --l2-adapter '<JSON>'`` builds it:
LMCache's ``--l2-adapter`` argument parser, its ``plugin`` adapter type (which imports
``module_path`` and checks the class is an ``L2AdapterInterface``) and its factory
(``create_l2_adapter``). The objects are LMCache ``TensorMemoryObj``\\ s; completion is
signalled on LMCache's event notifiers and read back as LMCache ``Bitmap``\\ s; the
service is a real ctxmem process. Not covered here: the MP server process with a vLLM
``LMCacheMPConnector`` in front of it (vLLM's side of MP needs a GPU-side connector).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import shlex
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
lmcache = pytest.importorskip("lmcache", reason="LMCache 0.5.6 is installed by "
                              "deploy/setup.sh (plain pip) into the main venv")
torch = pytest.importorskip("torch")

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import (  # noqa: E402
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj  # noqa: E402

from tests.kit import until  # noqa: E402

SHAPE = (2, 4, 16, 8)  # an LMCache KV chunk of one rank: [K/V, layers, tokens, hidden]
DTYPE = torch.bfloat16


def documented_l2_adapter() -> dict[str, Any]:
    """The ``--l2-adapter`` JSON docs/deploy.md gives (kept copy-pasteable by this test)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "deploy.md").read_text()
    found = re.findall(r"--l2-adapter '(\{.*?\})'", text, flags=re.S)
    assert len(found) == 1, "docs/deploy.md should give one --l2-adapter example"
    return dict(json.loads(found[0]))


def documented_server_args() -> list[str]:
    """The ``lmcache server`` command docs/deploy.md gives, split as the shell splits it
    (continuation lines, quotes), without ``lmcache server`` itself."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "deploy.md").read_text()
    found = [b for b in re.findall(r"^```(?:bash|sh)\n(.*?)^```", text, flags=re.S | re.M)
             if b.lstrip().startswith("lmcache server")]
    assert len(found) == 1, "docs/deploy.md should give one `lmcache server` command"
    words = shlex.split(found[0].replace("\\\n", " "), comments=True)
    assert words[:2] == ["lmcache", "server"], words[:2]
    return words[2:]


def make_adapter(endpoint: str, **params: Any) -> Any:
    """Parse ``--l2-adapter`` as ``lmcache server`` does and build the adapter."""
    spec = documented_l2_adapter()
    spec["adapter_params"] = {**spec["adapter_params"], "endpoint": endpoint, **params}
    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    args = parser.parse_args(["--l2-adapter", json.dumps(spec)])
    config = parse_args_to_l2_adapters_config(args)
    return create_l2_adapter(config.adapters[0])


def obj(seed: int | None) -> Any:
    data = (torch.zeros(SHAPE) if seed is None else
            torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))).to(DTYPE)
    nbytes = data.numel() * data.element_size()
    return TensorMemoryObj(raw_data=data, metadata=MemoryObjMetadata(
        shape=torch.Size(SHAPE), dtype=DTYPE, address=0, phy_size=nbytes, ref_count=1),
        parent_allocator=None)


def key(i: int, rank: int = 0, salt: str = "") -> Any:
    return ObjectKey(chunk_hash=i.to_bytes(8, "big") * 4, model_name="tiny-llama",
                     kv_rank=rank, cache_salt=salt)


def wait(fd: int, poll: Any, timeout_s: float = 20.0) -> Any:
    """Wait as LMCache's controllers do: poll the event fd, drain it, query."""
    def signalled() -> tuple[Any] | None:  # the result boxed: a falsy one counts too
        ready, _, _ = select.select([fd], [], [], 0.05)
        if ready:
            os.read(fd, 8)  # an eventfd: reading resets it
        out = poll()
        return (out,) if out is not None and out != {} else None
    return until(signalled, timeout_s, "the adapter to signal completion", 0)[0]


def bits(bitmap: Any, n: int) -> list[bool]:
    return [bool(bitmap.test(i)) for i in range(n)]


DESCS = {0: MemoryLayoutDesc(shapes=[torch.Size(SHAPE)], dtypes=[DTYPE])}


def test_store_then_a_restarted_adapter_looks_up_and_loads_byte_exact(service: Any) -> None:
    a = make_adapter(service.endpoint)
    keys = [key(i) for i in range(3)] + [key(0, rank=1)]
    src = [obj(i) for i in range(4)]
    task = a.submit_store_task(keys, src)
    done = wait(a.get_store_event_fd(), a.pop_completed_store_tasks)
    assert done[task].is_successful()
    assert done[task].bytes_transferred() == 4 * src[0].get_size()
    a.close()

    b = make_adapter(service.endpoint)  # the server restarted: nothing in memory
    probe = [key(0), key(1), key(9), key(2), key(0, rank=1), key(0, salt="bob")]
    t = b.submit_lookup_and_lock_task(probe, DESCS)
    found = wait(b.get_lookup_and_lock_event_fd(),
                 lambda: b.query_lookup_and_lock_result(t))
    assert bits(found, 6) == [True, True, False, True, True, False]
    assert b.query_lookup_and_lock_result(t) is None, "a result is returned once"
    dst = [obj(None) for _ in probe]
    t = b.submit_load_task(probe, dst)
    loaded = wait(b.get_load_event_fd(), lambda: b.query_load_result(t))
    assert bits(loaded, 6) == [True, True, False, True, True, False]
    for got, want in zip([dst[0], dst[1], dst[3], dst[4]], src, strict=True):
        assert torch.equal(got.tensor.view(torch.int16), want.tensor.view(torch.int16))
    assert not dst[2].tensor.any() and not dst[5].tensor.any()
    b.submit_unlock(probe)
    b.close()


def test_lookup_without_a_layout_is_a_miss_and_a_dead_service_is_too(
        service_factory: Any) -> None:
    svc = service_factory()
    a = make_adapter(svc.endpoint, timeout_s=2.0)
    t = a.submit_lookup_and_lock_task([key(0)], {})
    assert bits(wait(a.get_lookup_and_lock_event_fd(),
                     lambda: a.query_lookup_and_lock_result(t)), 1) == [False]
    svc.kill()
    t = a.submit_lookup_and_lock_task([key(0)], DESCS)
    assert bits(wait(a.get_lookup_and_lock_event_fd(),
                     lambda: a.query_lookup_and_lock_result(t)), 1) == [False]
    t = a.submit_store_task([key(5)], [obj(5)])
    done = wait(a.get_store_event_fd(), a.pop_completed_store_tasks)
    assert not done[t].is_successful()
    a.close()
