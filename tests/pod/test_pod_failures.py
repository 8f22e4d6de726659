"""Issue 14, failure cases with real processes: a holder killed mid-fetch, the index
stopped and restarted, stale entries, a lying peer, two writers of one key, pod auth."""

from __future__ import annotations

import signal
import socket
import threading
import time

import numpy as np
import pytest
import redis
from crc32c import crc32c

import ctxmem
from ctxmem_common import peer_wire as w
from ctxmem_common.podkeys import PodKeys
from ctxmem_dpu.pod.entries import (
    NODES_KEY,
    RemoteEntry,
    alive_key,
    pack_entry,
)
from ctxmem_tools.pod_launcher import LocalPod
from tests.pod.peerkit import handshake, index_names, pod_keys, read_exactly
from tests.pod.podtest import LAYOUT, Clients, blocks, wait_for


def test_holder_killed_mid_fetch_gives_misses_never_wrong_bytes(pod: LocalPod,
                                                                 clients: Clients) -> None:
    n1, n2, _ = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 200), 16)
    data = blocks(len(keys), 3)
    clients.put(n1.endpoint, keys, data)
    wait_for(lambda: clients.hits(n2.endpoint, keys) == 200, what="publish")
    killer = threading.Timer(0.02, n1.kill)
    killer.start()
    try:
        n = clients.get(n2.endpoint, keys, data)  # byte-checked: a prefix, then misses
    finally:
        killer.join()
    assert 0 <= n <= 200
    # Once its entries are ignored, the copies fetched from it are misses too: a copy is
    # served only while the index names its entry (docs/pod.md, "Deletes and re-puts
    # across nodes").
    wait_for(lambda: clients.hits(n2.endpoint, keys) == 0, timeout_s=15,
             what="the dead holder's entries to be ignored")
    assert clients.get(n2.endpoint, keys, data) == 0
    assert clients.stats(n2.endpoint)["pod_fetch_bad"] == 0


def test_a_frozen_holder_is_a_bounded_miss(pod: LocalPod, clients: Clients) -> None:
    """SIGSTOP: the holder accepts (the kernel does) but never answers, mid-fetch for
    every request from then on; the get is a miss within pod.fetch_timeout_s."""
    n1, n2, _ = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 4), 16)
    data = blocks(4, 13)
    clients.put(n1.endpoint, keys, data)
    wait_for(lambda: clients.hits(n2.endpoint, keys) == 4, what="publish")
    assert n1.proc is not None
    n1.proc.send_signal(signal.SIGSTOP)
    try:
        t = time.monotonic()
        assert clients.get(n2.endpoint, keys, data) == 0
        assert time.monotonic() - t < 5.0 + 3.0  # pod.fetch_timeout_s (5 s) + slack
        assert clients.stats(n2.endpoint)["pod_peer_errors"] >= 1
    finally:
        n1.proc.send_signal(signal.SIGCONT)
    n1.kill()


def test_index_stopped_and_restarted(pod: LocalPod, clients: Clients) -> None:
    n1, n2, n3 = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 8), 16)
    data = blocks(8, 4)
    clients.put(n1.endpoint, keys[:4], data[:4])
    clients.put(n2.endpoint, keys[4:], data[4:])
    wait_for(lambda: clients.hits(n3.endpoint, keys) == 8, what="publish")
    pod.redis.stop()
    # Every node keeps serving its own blocks; cross-node hits are misses.
    assert clients.get(n1.endpoint, keys[:4], data[:4]) == 4
    assert clients.hits(n3.endpoint, keys) == 0
    assert clients.get(n3.endpoint, keys, data) == 0
    more = ctxmem.chain_hashes(range(1000, 1000 + 16 * 2), 16)
    clients.put(n1.endpoint, more, data[:2])  # committed while the index is down
    assert clients.stats(n3.endpoint)["pod_index_errors"] >= 1
    pod.redis.start()  # empty: no persistence; the nodes republish on their heartbeat
    wait_for(lambda: clients.hits(n3.endpoint, keys) == 8, timeout_s=15, what="republish")
    wait_for(lambda: clients.hits(n3.endpoint, more) == 2, timeout_s=15, what="backlog")
    assert clients.get(n3.endpoint, keys, data) == 8
    assert clients.get(n3.endpoint, more, data[:2]) == 2


def test_stale_entries_are_misses_and_get_cleaned(pod: LocalPod, clients: Clients) -> None:
    n1, n2, _ = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 6), 16)
    data = blocks(6, 5)
    clients.put(n1.endpoint, keys, data)
    wait_for(lambda: clients.hits(n2.endpoint, keys) == 6, what="publish")
    r = redis.Redis.from_url(pod.redis.url)
    # The holder lost the blocks without telling the index: an entry naming node1 for keys
    # it never had (bytes it would have to make up).
    ghost = ctxmem.chain_hashes(range(5000, 5000 + 16 * 2), 16)
    name, fields = index_names(pod_keys(pod), ghost)
    for f in fields:
        r.hset(name, f, pack_entry(RemoteEntry("node1", "dram", 1, LAYOUT.block_nbytes, 123)))
    assert clients.hits(n2.endpoint, ghost) == 2  # the index says so ...
    assert clients.get(n2.endpoint, ghost, data[:2]) == 0  # ... but it is a miss, not an error
    # Deleted on the holder: unpublished, so a miss everywhere.
    assert clients.ns(n1.endpoint).delete(keys[3:]) == 3
    wait_for(lambda: clients.hits(n2.endpoint, keys) == 3, what="unpublish")
    assert clients.get(n2.endpoint, keys, data) == 3
    # A dead node's entries are ignored at once and deleted lazily.
    r.hset(NODES_KEY, "node9", "127.0.0.1:9")
    r.hset(name, fields[0], pack_entry(RemoteEntry("node9", "dram", 1,
                                                   LAYOUT.block_nbytes, 1)))
    assert clients.hits(n2.endpoint, ghost[:1]) == 0
    wait_for(lambda: r.hget(name, fields[0]) is None, what="lazy cleanup")


class LyingPeer:
    """A peer that passes the handshake (it holds the pod's peer key: the worst case short
    of the master key itself) and answers every key with made-up bytes, the index's
    CRC32C for them, and an authenticator it cannot make under the namespace's key."""

    def __init__(self, keys: PodKeys, crc: int, nbytes: int) -> None:
        self.keys, self.crc, self.nbytes = keys, crc, nbytes
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.served = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    self._serve(conn)
                except (ConnectionError, OSError):
                    continue

    def _serve(self, conn: socket.socket) -> None:
        _m, _v, c_nonce, n = w.HELLO.unpack(read_exactly(conn, w.HELLO.size))
        c_id = read_exactly(conn, n).decode()
        t = w.Transcript(c_nonce, c_id, w.new_nonce(), "liar")
        conn.sendall(w.pack_hello(w.CHALLENGE_MAGIC, t.server_nonce, "liar"))
        read_exactly(conn, w.PROOF_BYTES)
        conn.sendall(b"\x01" + t.proof(self.keys.peer_key, b"s2c"))
        _m, _ns, _proof, count = w.REQUEST.unpack(read_exactly(conn, w.REQUEST.size))
        for _ in range(count):
            read_exactly(conn, read_exactly(conn, 1)[0])
        for _ in range(count):
            conn.sendall(w.ANSWER.pack(1, self.crc, self.nbytes, 1, bytes(w.TAG_BYTES))
                         + bytes(self.nbytes))
            self.served += 1

    def close(self) -> None:
        self.sock.close()


def test_a_lying_peer_is_a_miss_never_wrong_bytes(pod: LocalPod, clients: Clients) -> None:
    _, n2, _ = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 3), 16)
    data = blocks(3, 6)
    pk = pod_keys(pod)
    liar = LyingPeer(pk, crc32c(bytes(LAYOUT.block_nbytes)), LAYOUT.block_nbytes)
    r = redis.Redis.from_url(pod.redis.url)
    r.hset(NODES_KEY, "liar", f"127.0.0.1:{liar.port}")
    r.set(alive_key("liar"), f"127.0.0.1:{liar.port}", px=60_000)
    name, fields = index_names(pk, keys)
    for f in fields:  # the CRC32C of the liar's bytes: the index vouches for them
        r.hset(name, f, pack_entry(RemoteEntry(
            "liar", "dram", 1, LAYOUT.block_nbytes, crc32c(bytes(LAYOUT.block_nbytes)))))
    try:
        wait_for(lambda: clients.hits(n2.endpoint, keys) == 3, what="the liar's liveness")
        assert clients.get(n2.endpoint, keys, data) == 0
        assert liar.served >= 1
        st = clients.stats(n2.endpoint)
        assert st["pod_fetch_unauthenticated"] >= 1 and st.get("pod_fetch_blocks_peer", 0) == 0
    finally:
        liar.close()


def test_two_nodes_write_the_same_key_at_once(pod: LocalPod, clients: Clients) -> None:
    n1, n2, n3 = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 16), 16)
    a, b = blocks(16, 7), blocks(16, 8)
    ts = [threading.Thread(target=clients.put, args=(n.endpoint, keys, d))
          for n, d in ((n1, a), (n2, b))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wait_for(lambda: clients.hits(n3.endpoint, keys) == 16, what="publish")
    out = [np.zeros(LAYOUT.block_nbytes, np.uint8) for _ in keys]
    assert clients.ns(n3.endpoint).get(keys, out) == 16
    for i, o in enumerate(out):  # each block exactly one writer's, never a mix
        assert np.array_equal(o, a[i]) or np.array_equal(o, b[i]), f"block {i}"


def test_peer_fetch_refuses_without_the_pod_keys(pod: LocalPod, clients: Clients) -> None:
    """A client that cannot prove it holds the pod's peer key (the right pod token but
    another master key, or the old token hello) is closed after the challenge."""
    n1 = pod.nodes[0]
    host, port = n1.config["pod"]["listen"].rsplit(":", 1)
    wrong = PodKeys(bytes(32), pod.token.encode())
    with socket.create_connection((host, int(port)), timeout=5) as s, \
            pytest.raises(ConnectionError):
        handshake(s, wrong.peer_key, "intruder", "node1")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        tok = pod.token.encode()  # version 1's bearer-token hello
        s.sendall(b"CXPH\x01" + len(tok).to_bytes(2, "big") + tok + bytes(64))
        s.settimeout(5)
        assert s.recv(1) == b""  # closed, nothing served
    assert clients.stats(n1.endpoint)["pod_peer_refused"] == 2


def test_peer_fetch_bounds_hostile_connections(pod: LocalPod, clients: Clients) -> None:
    """A connection that never says hello is closed after the read timeout (10 s); a
    member's request for more than MAX_KEYS keys is refused with nothing served; the node
    serves peers as before afterwards."""
    n1, n2, _ = pod.nodes
    host, port = n1.config["pod"]["listen"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as silent, \
            socket.create_connection((host, int(port)), timeout=5) as greedy:
        greedy.settimeout(5)
        handshake(greedy, pod_keys(pod).peer_key, "greedy", "node1")  # a pod member
        greedy.sendall(w.REQUEST.pack(w.REQUEST_MAGIC, bytes(16), bytes(32),
                                      w.MAX_KEYS + 1))
        assert greedy.recv(64) == b""  # refused: closed, nothing served
        t0 = time.monotonic()
        silent.settimeout(30)
        assert silent.recv(1) == b""  # closed by the server, not by us
        assert time.monotonic() - t0 < 20
    assert clients.stats(n1.endpoint).get("pod_served_blocks", 0) == 0
    keys = ctxmem.chain_hashes(range(16 * 2), 16)
    data = blocks(2, 11)
    assert clients.put(n1.endpoint, keys, data) == 2
    wait_for(lambda: clients.hits(n2.endpoint, keys) == 2, what="publish")
    assert clients.get(n2.endpoint, keys, data) == 2
