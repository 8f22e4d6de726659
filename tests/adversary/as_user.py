"""Run ctxmem client operations as another local user (a test helper, run as root).

``python as_user.py UID ENDPOINT TENANT OPS_JSON``: imports everything first (the project
and its interpreter may live where that user cannot read), then drops to ``UID`` (and
group ``UID``, no supplementary groups), connects over loopback TCP and runs each op of
``OPS_JSON`` (a list of ``[name, *args]``), printing one JSON list of results:

* ``["tenant"]``: the tenant the service says the session acts for;
* ``["put", start, n, seed]``: blocks ``start..start+n`` with bytes from ``seed``;
* ``["get", start, n, seed]``: ``[blocks returned, of them equal to seed's bytes]``;
* ``["lookup", start, n]``: leading blocks the service holds;
* ``["delete", start, n]``: blocks deleted;
* ``["stats"]``: the ``tenant.*`` stats names this user sees;
* ``["revision", rev]``: look up block 0 in a namespace with weights revision ``rev``
  (the shim checks the service's digest against the tenant it acts for);
* ``["touch", name]``: open a session under tenant ``name`` (kept open): ``"ok"``;
* ``["pause"]``: print the results so far, then wait (sessions open) until stdin ends.

An op that fails prints ``{"error": CLASS, "message": TEXT}`` in its place.
"""

from __future__ import annotations

import encodings.idna  # noqa: F401  (getaddrinfo needs it after the privileges drop)
import functools
import json
import os
import sys
from typing import Any

import numpy as np

import ctxmem
from ctxmem_common.errors import CtxmemError
from tests import kit

LAYOUT = kit.model_layout()
keys = functools.partial(kit.chain_keys, LAYOUT)  # keys(start, n): blocks start..start+n


def blocks(n: int, seed: int) -> list[np.ndarray]:
    return kit.blocks(n, LAYOUT.block_nbytes, seed)


def run(client: ctxmem.Client, tenant: str, op: list[Any]) -> Any:
    name, *args = op
    if name == "touch":  # a session under another name, kept open
        client.open_namespace(LAYOUT, model_id="m", tenant=args[0]).lookup(keys(0, 1))
        return "ok"
    if name == "revision":  # a namespace with a weights revision (its digest checked)
        return client.open_namespace(LAYOUT, model_id="m", tenant=tenant,
                                     weights_revision=args[0]).lookup(keys(0, 1)).num_hits
    ns = client.open_namespace(LAYOUT, model_id="m", tenant=tenant)
    if name == "tenant":
        return ns.acting_tenant
    if name == "put":
        start, n, seed = args
        return ns.put(keys(start, n), blocks(n, seed)).stored
    if name == "get":
        start, n, seed = args
        want = blocks(n, seed)
        out = [np.zeros_like(b) for b in want]
        got = ns.get(keys(start, n), out)
        return [got, sum(int(np.array_equal(out[i], want[i])) for i in range(got))]
    if name == "lookup":
        return ns.lookup(keys(*args)).num_hits
    if name == "delete":
        return ns.delete(keys(*args))
    if name == "stats":
        return sorted({k.rpartition(".")[0] for k in client.stats() if k.startswith("tenant.")})
    raise ValueError(f"unknown op {name!r}")


def drop(uid: int) -> None:
    """Become ``uid`` (group ``uid``, no supplementary groups), having imported first
    what the shim imports lazily."""
    import ctxmem.transport.tcp  # noqa: F401

    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def main() -> None:
    uid, endpoint, tenant, ops = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    blocks(1, 0)  # numpy.random imports more on first use
    drop(uid)
    out: list[Any] = []
    with ctxmem.Client(endpoint, transport="tcp") as client:
        for op in json.loads(ops):
            if op == ["pause"]:  # results so far, then hold the sessions until stdin ends
                print(json.dumps(out), flush=True)
                sys.stdin.read()
                continue
            try:
                out.append(run(client, tenant, op))
            except CtxmemError as exc:
                out.append({"error": type(exc).__name__, "message": str(exc)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
