"""Block groups across a pod (issue 29, item 1): a group get on one node pulls every
member's blocks from the nodes that hold them, and is a whole miss when one member's
holder is dead, never a part of the group. Real processes: Redis and three services."""

from __future__ import annotations

import numpy as np

import ctxmem
from ctxmem_tools.pod_launcher import LocalPod
from tests.pod.podtest import Clients, wait_for

KV = ctxmem.KVLayout(dtype="bfloat16", num_layers=4, num_kv_heads=2, head_dim=64,
                     tokens_per_block=16)
STATE = ctxmem.KVLayout(dtype="bfloat16", num_layers=1, num_kv_heads=1, head_dim=256,
                        tokens_per_block=16)


def _members(clients: Clients, endpoint: str) -> tuple[ctxmem.Namespace, ctxmem.Namespace]:
    c = clients.client(endpoint)
    return (c.open_namespace(KV, model_id="hybrid", tags={"pool": "kv"}),
            c.open_namespace(STATE, model_id="hybrid", tags={"pool": "mamba"}))


def _data(n: int, nbytes: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, nbytes, dtype=np.uint8) for _ in range(n)]


def _group_get(clients: Clients, endpoint: str, keys: list[bytes],
               want: list[list[np.ndarray]]) -> int:
    kv, state = _members(clients, endpoint)
    group = clients.client(endpoint).open_group([kv, state])
    out = [[np.zeros(KV.block_nbytes, np.uint8) for _ in keys],
           [np.zeros(STATE.block_nbytes, np.uint8) for _ in keys]]
    n = group.get(keys, out)
    for member, expect in zip(out, want, strict=True):
        for i in range(n):
            assert np.array_equal(member[i], expect[i]), f"block {i}: wrong bytes"
    return n


def _group_hits(clients: Clients, endpoint: str, keys: list[bytes]) -> int:
    kv, state = _members(clients, endpoint)
    return clients.client(endpoint).open_group([kv, state]).lookup(keys).num_hits


def test_a_group_member_whose_holder_died_is_a_whole_miss(pod: LocalPod,
                                                          clients: Clients) -> None:
    n1, n2, n3 = pod.nodes
    # Control: a group stored on n1 is fetched whole by n3.
    ka = [bytes([0xA0, i]) * 16 for i in range(4)]
    da = [_data(4, KV.block_nbytes, 1), _data(4, STATE.block_nbytes, 2)]
    kv1, st1 = _members(clients, n1.endpoint)
    assert clients.client(n1.endpoint).open_group([kv1, st1]).put(ka, da).stored == 8
    wait_for(lambda: _group_hits(clients, n3.endpoint, ka) == 4, what="publish")
    assert _group_get(clients, n3.endpoint, ka, da) == 4
    # The case: n1 holds the KV member of these keys, n2 their state member.
    kb = [bytes([0xB0, i]) * 16 for i in range(4)]
    db = [_data(4, KV.block_nbytes, 3), _data(4, STATE.block_nbytes, 4)]
    assert kv1.put(kb, db[0]).stored == 4
    _kv2, st2 = _members(clients, n2.endpoint)
    assert st2.put(kb, db[1]).stored == 4
    wait_for(lambda: _group_hits(clients, n3.endpoint, kb) == 4, what="publish")
    n2.kill()  # the state member's holder dies
    assert _group_get(clients, n3.endpoint, kb, db) == 0  # a whole miss, never the KV part
    # The KV member alone is still served from n1: only the group is a miss.
    kv3, _st3 = _members(clients, n3.endpoint)
    out = [np.zeros(KV.block_nbytes, np.uint8) for _ in kb]
    assert kv3.get(kb, out) == 4
    assert all(np.array_equal(a, b) for a, b in zip(out, db[0], strict=True))
    assert clients.stats(n3.endpoint)["pod_fetch_bad"] == 0
    # Once the dead node's entries are ignored, Lookup counts no group hit either.
    wait_for(lambda: _group_hits(clients, n3.endpoint, kb) == 0, timeout_s=15,
             what="the dead holder's entries to be ignored")
    assert _group_get(clients, n3.endpoint, kb, db) == 0
