"""Helpers of the tests that speak the peer wire or read the index themselves: the pod's
keys from its master key and token, a blocking client handshake, and the index's keyed
names of a namespace's blocks."""

from __future__ import annotations

import socket
from collections.abc import Sequence

from ctxmem_common.keys import namespace_digest
from ctxmem_dpu.pod import peer_wire as w
from ctxmem_dpu.pod.entries import blocks_key
from ctxmem_dpu.pod.podkeys import PodKeys
from ctxmem_tools.pod_launcher import LocalPod
from tests.pod.podtest import LAYOUT


def pod_keys(pod: LocalPod) -> PodKeys:
    """The keys every node of ``pod`` derives."""
    return PodKeys(pod.master_key, pod.token.encode())


#: A fixed master key for tests that must know the index's names before the pod starts.
FIXED_MASTER = bytes(range(32))


def index_keys(master: bytes = FIXED_MASTER) -> PodKeys:
    """Keys that name the index's entries (they depend on the master key only)."""
    return PodKeys(master)


def index_names(keys: PodKeys, block_keys: Sequence[bytes], model: str = "m",
                tenant: str = "default") -> tuple[str, list[bytes]]:
    """The Redis hash of the namespace (tenant, model, the tests' layout) and the fields
    of ``block_keys`` in it."""
    digest = namespace_digest(tenant, model, LAYOUT)
    return (blocks_key(keys.index_tag(digest)),
            keys.index_fields(digest, list(block_keys)))


def read_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += got
    return out


def handshake(sock: socket.socket, peer_key: bytes, node_id: str, expect_id: str
              ) -> w.Transcript:
    """The client's side of the peer handshake on a blocking socket; raises
    ``ConnectionError`` when the server closes (it refused this node's proof) or
    ``AssertionError`` when the server's proof is wrong."""
    nonce = w.new_nonce()
    sock.sendall(w.pack_hello(w.HELLO_MAGIC, nonce, node_id))
    magic, version, s_nonce, n = w.HELLO.unpack(read_exactly(sock, w.HELLO.size))
    assert (magic, version) == (w.CHALLENGE_MAGIC, w.VERSION)
    s_id = read_exactly(sock, n).decode()
    assert s_id == expect_id
    t = w.Transcript(nonce, node_id, s_nonce, s_id)
    sock.sendall(t.proof(peer_key, b"c2s"))
    ok = read_exactly(sock, 1 + w.PROOF_BYTES)
    assert ok[:1] == b"\x01" and w.check(t.proof(peer_key, b"s2c"), ok[1:])
    return t
