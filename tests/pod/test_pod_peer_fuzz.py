"""Issue 25: the peer port's new messages (hello, challenge proof, request with its
namespace proof), fuzzed against a real node: seeded cases of random bytes, truncated and
mutated handshakes, and, after a correct handshake, mutated requests. Each case closes
its connection once sent, so every one ends at once (no case waits out a timeout).

After the campaign: the node is alive and answers Stats; it served no block to any case
(none proved the namespace's key); its log has no traceback; a cross-node get through
another node is byte-exact."""

from __future__ import annotations

import contextlib
import random
import socket
import struct

import ctxmem
from ctxmem_common.keys import namespace_digest
from ctxmem_dpu.pod import peer_wire as w
from ctxmem_tools.pod_launcher import LocalPod
from tests.pod.peerkit import handshake, pod_keys
from tests.pod.podtest import LAYOUT, Clients, blocks, wait_for

CASES = 300


def _send(addr: tuple[str, int], payload: bytes) -> None:
    """Connect, send, close (the server sees EOF right after)."""
    # The server may have closed already: that is fine.
    with socket.create_connection(addr, timeout=10) as s, contextlib.suppress(OSError):
        s.sendall(payload)


def _hello(rng: random.Random, node_id: str = "fuzz") -> bytes:
    return w.pack_hello(w.HELLO_MAGIC, rng.randbytes(32), node_id)


def _mutate(rng: random.Random, raw: bytes) -> bytes:
    b = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        op = rng.random()
        if op < 0.4 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op < 0.7 and b:
            del b[rng.randrange(len(b)):]
        else:
            b[rng.randrange(len(b) + 1):0] = rng.randbytes(rng.randint(1, 8))
    return bytes(b)


def test_the_peer_port_survives_fuzzed_handshakes_and_requests(
        pod: LocalPod, clients: Clients) -> None:
    n1, n2, _ = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 3), 16)
    data = blocks(3, 41)
    assert clients.put(n1.endpoint, keys, data) == 3
    digest = namespace_digest("default", "m", LAYOUT)
    host, port = n1.config["pod"]["listen"].rsplit(":", 1)
    addr = (host, int(port))
    pk = pod_keys(pod)
    rng = random.Random(25)
    kinds = {"random": 0, "hello": 0, "request": 0}
    for _ in range(CASES):
        r = rng.random()
        if r < 0.2:
            kinds["random"] += 1
            _send(addr, rng.randbytes(rng.randint(0, 200)))
        elif r < 0.5:  # a mutated hello, or a good hello and a wrong or mutated proof
            kinds["hello"] += 1
            hello = _hello(rng, rng.choice(["fuzz", "node2", "x" * 255, ""]))
            tail = rng.randbytes(rng.choice([0, 1, 31, 32, 33, 64]))
            _send(addr, _mutate(rng, hello) + tail if rng.random() < 0.5 else hello + tail)
        else:  # a correct handshake, then a mutated request
            kinds["request"] += 1
            with socket.create_connection(addr, timeout=10) as s:
                s.settimeout(10)
                t = handshake(s, pk.peer_key, "fuzz", "node1")
                good = t.ns_proof(pk.namespace(digest).request_key, digest)
                proof = rng.choice([bytes(32), rng.randbytes(32), good[:31] + b"\0"])
                count = rng.choice([0, 1, len(keys), w.MAX_KEYS + 1, 2**32 - 1])
                req = struct.pack("!4s16s32sI", rng.choice([b"CXPR", b"CXPD", b"XXXX"]),
                                  rng.choice([digest, rng.randbytes(16)]), proof, count)
                req += b"".join(bytes((len(k),)) + k for k in keys)
                with contextlib.suppress(OSError):
                    s.sendall(_mutate(rng, req) if rng.random() < 0.5 else req)
                    s.shutdown(socket.SHUT_WR)
                got = b""
                with contextlib.suppress(ConnectionResetError):
                    while chunk := s.recv(65536):  # the server closes: bounded by EOF
                        got += chunk
                assert data[0].tobytes()[:512] not in got, "a block went to a fuzz case"
    assert all(kinds.values()), kinds
    st = clients.stats(n1.endpoint)
    assert st.get("pod_served_blocks", 0) == 0, st
    assert st["pod_peer_refused"] >= 1
    wait_for(lambda: clients.hits(n2.endpoint, keys) == 3, what="publish")
    assert clients.get(n2.endpoint, keys, data) == 3  # byte-checked, through node 1
    assert "Traceback" not in n1.log()
