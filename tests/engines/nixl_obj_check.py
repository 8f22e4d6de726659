"""NIXL's own ``OBJ`` backend (nixl-cu12 1.5.1: aws-sdk-cpp's S3 client) against
ctxmem's S3-compatible endpoint (docs/s3.md).

Run by ``test_s3_clients.py`` with NIXL's package directory (``deploy/ci/site.sh nixl``)
on ``PYTHONPATH``, twice, as two processes (two NIXL agents that share nothing but the
store)::

    python tests/engines/nixl_obj_check.py put PORT BUCKET KEY_ID SECRET
    python tests/engines/nixl_obj_check.py get PORT BUCKET KEY_ID SECRET

``put`` writes two objects from DRAM (``WRITE`` transfers: PutObject), then checks
existence with ``query_memory`` (HeadObject): both found, an absent key not.
``get`` (the second process) checks existence again, reads one object whole and a range
of the other that crosses ctxmem's 2 MiB chunk boundary (``READ`` with the remote
descriptor's address as the offset: a ranged GetObject), and compares with the bytes
``put`` wrote (regenerated from the same seed). Prints ``NIXL OBJ OK`` on success.

The backend parameters are NIXL's (src/plugins/obj/README.md): ``bucket``,
``endpoint_override``, ``scheme``, ``region``, ``access_key``, ``secret_key``; path-style
addressing (``use_virtual_addressing`` defaults to false).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

MiB = 1 << 20
OBJECTS = {"nixl/a.bin": 3 * MiB + 17, "nixl/b.bin": 5 * MiB + 4093}
OFFSET, LENGTH = 2 * MiB - 7, 2 * MiB + 100  # a range of b.bin across a chunk boundary


def data(key: str) -> np.ndarray:
    seed = sum(key.encode())
    return np.random.default_rng(seed).integers(0, 256, OBJECTS[key], dtype=np.uint8)


def agent(name: str, port: int, bucket: str, key_id: str, secret: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    a = nixl_agent(name, nixl_agent_config(backends=[]))
    a.create_backend("OBJ", {"bucket": bucket, "endpoint_override": f"http://127.0.0.1:{port}",
                             "scheme": "http", "region": "us-east-1",
                             "access_key": key_id, "secret_key": secret})
    return a


def transfer(a: Any, op: str, buf: np.ndarray, key: str, dev_id: int, offset: int = 0,
             timeout_s: float = 60.0) -> str:
    """One NIXL transfer between ``buf`` (DRAM) and object ``key`` at ``offset``."""
    n = buf.nbytes
    addr = buf.ctypes.data
    dram = a.register_memory([(addr, n, 0, "")], "DRAM")
    objs = a.register_memory([(0, offset + n, dev_id, key)], "OBJ")
    local = a.get_xfer_descs([(addr, n, 0)], "DRAM")
    remote = a.get_xfer_descs([(offset, n, dev_id)], "OBJ")
    handle = a.initialize_xfer(op, local, remote, a.name)
    state = a.transfer(handle)
    deadline = time.monotonic() + timeout_s
    while state not in ("DONE", "ERR") and time.monotonic() < deadline:
        time.sleep(0.002)
        state = a.check_xfer_state(handle)
    a.release_xfer_handle(handle)
    a.deregister_memory(objs)
    a.deregister_memory(dram)
    return str(state)


def exists(a: Any, keys: list[str]) -> list[bool]:
    found = a.query_memory([(0, 1, 0, k) for k in keys], "OBJ", "OBJ")
    return [r is not None for r in found]


def main(mode: str, port: int, bucket: str, key_id: str, secret: str) -> int:
    ok = True

    def check(cond: bool, msg: str) -> None:
        nonlocal ok
        print(("ok   " if cond else "FAIL ") + msg, flush=True)
        ok = ok and cond

    a = agent(f"ctxmem-{mode}", port, bucket, key_id, secret)
    keys = list(OBJECTS)
    if mode == "put":
        for dev, key in enumerate(keys, 1):
            state = transfer(a, "WRITE", data(key), key, dev)
            check(state == "DONE", f"WRITE {key} ({OBJECTS[key]} bytes): {state}")
    found = exists(a, [*keys, "nixl/absent.bin"])
    check(found == [True, True, False], f"query_memory: both found, the absent key not "
                                        f"({found})")
    if mode == "get":
        whole = np.zeros(OBJECTS[keys[0]], dtype=np.uint8)
        state = transfer(a, "READ", whole, keys[0], 1)
        check(state == "DONE" and np.array_equal(whole, data(keys[0])),
              f"READ {keys[0]} whole, byte-exact ({state})")
        part = np.zeros(LENGTH, dtype=np.uint8)
        state = transfer(a, "READ", part, keys[1], 2, offset=OFFSET)
        want = data(keys[1])[OFFSET:OFFSET + LENGTH]
        check(state == "DONE" and np.array_equal(part, want),
              f"READ {keys[1]} bytes {OFFSET}..{OFFSET + LENGTH - 1}, byte-exact ({state})")
    print("NIXL OBJ OK" if ok else "NIXL OBJ FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:6]))
