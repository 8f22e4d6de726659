"""Pod peer-port cases (issue 25): the peer handshake and requests of
:mod:`ctxmem_common.peer_wire`, against one node of a real pod.

Cases are drawn from one seeded RNG: random bytes; a hello with a mutated or odd node id,
or a good hello followed by a wrong, short or long proof (:meth:`PeerCases.hello_case`);
and, after a correct handshake (the fuzzer holds the pod's keys, as a member would), a
request whose namespace proof is wrong (zero, random, or the right proof with one bit
flipped: never the right one), with a real or random namespace digest, a good or bad magic,
a key count of 0, the real count, ``MAX_KEYS + 1`` or ``2^32 - 1``, half of them byte-mutated
(:meth:`PeerCases.request_case`). Every case sends, half-closes and reads until the node
closes, so none waits out a timeout. A request case that reads back any of the victim
blocks' bytes is counted in :attr:`PeerTarget.unproven_served` (none proved the key).

:class:`PeerFuzz` runs these cases inside ``ctxmem fuzz --targets peer``: a
:class:`~ctxmem_tools.pod_launcher.LocalPod` of two nodes (a real ``redis-server``), and
after every batch the checks of :meth:`PeerFuzz.check`.
"""

from __future__ import annotations

import contextlib
import random
import re
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ctxmem.client import Client
from ctxmem_common import peer_wire as w
from ctxmem_common.keys import namespace_digest
from ctxmem_common.layout import KVLayout
from ctxmem_common.podkeys import PodKeys
from ctxmem_tools.pod_launcher import LocalPod

#: The kinds of case, as :meth:`PeerCases.case` labels their first word.
KINDS = ("random", "hello", "request")
PEER_LAYOUT = KVLayout(dtype="bfloat16", num_layers=4, num_kv_heads=2, head_dim=64,
                       tokens_per_block=16)
_KEY_LEN = struct.Struct("!B")


def mutate(rng: random.Random, raw: bytes) -> bytes:
    """1-4 edits of ``raw``: a byte replaced, the tail cut, or 1-8 random bytes inserted."""
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


def read_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionError(f"the node closed after {len(out)} of {n} bytes")
        out += got
    return out


def handshake(sock: socket.socket, peer_key: bytes, node_id: str, expect_id: str
              ) -> w.Transcript:
    """The client's side of the peer handshake on a blocking socket; raises
    ``ConnectionError`` when the server closes (it refused this node's proof) or
    ``AssertionError`` when the server's challenge or proof is wrong."""
    nonce = w.new_nonce()
    sock.sendall(w.pack_hello(w.HELLO_MAGIC, nonce, node_id))
    magic, version, s_nonce, n = w.HELLO.unpack(read_exactly(sock, w.HELLO.size))
    assert (magic, version) == (w.CHALLENGE_MAGIC, w.VERSION), (magic, version)
    s_id = read_exactly(sock, n).decode()
    assert s_id == expect_id, (s_id, expect_id)
    t = w.Transcript(nonce, node_id, s_nonce, s_id)
    sock.sendall(t.proof(peer_key, b"c2s"))
    ok = read_exactly(sock, 1 + w.PROOF_BYTES)
    assert ok[:1] == b"\x01" and w.check(t.proof(peer_key, b"s2c"), ok[1:]), \
        "the node's handshake proof does not verify under the pod's peer key"
    return t


class PeerTarget:
    """Seeded cases against one node's peer port ``address`` (``node_id``), by a fuzzer
    holding the pod's keys ``keys``; requests name namespace ``digest`` and block
    ``keys_`` (the victim's). ``secrets``: byte strings of the victim's blocks that no
    case may read back."""

    def __init__(self, address: tuple[str, int], node_id: str, keys: PodKeys,
                 digest: bytes, block_keys: list[bytes], secrets: list[bytes],
                 rng: random.Random, *, timeout_s: float = 10.0) -> None:
        self.address = address
        self.node_id = node_id
        self.keys = keys
        self.digest = digest
        self.block_keys = block_keys
        self.secrets = secrets
        self.rng = rng
        self.timeout_s = timeout_s
        #: Request cases that read back a victim block's bytes (none proved the key).
        self.unproven_served = 0
        #: Request cases the node answered with any bytes at all (it should close).
        self.unproven_answered = 0

    def _send(self, payload: bytes) -> str:
        """Connect, send, half-close, read until the node closes; a label."""
        with socket.create_connection(self.address, timeout=self.timeout_s) as s:
            with contextlib.suppress(OSError):
                s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
            return "answered" if self._drain(s) else "closed"

    def _drain(self, s: socket.socket) -> bytes:
        got = bytearray()
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):  # the node closes: bounded by EOF (or timeout)
                got += chunk
        return bytes(got)

    def random_case(self) -> str:
        return "random:" + self._send(self.rng.randbytes(self.rng.randint(0, 200)))

    def hello_case(self) -> str:
        """A mutated hello, or a good hello and a wrong, short or long proof."""
        r = self.rng
        hello = w.pack_hello(w.HELLO_MAGIC, r.randbytes(32),
                             r.choice(["fuzz", "node2", "x" * 255, ""]))
        tail = r.randbytes(r.choice([0, 1, 31, 32, 33, 64]))
        mutated = r.random() < 0.5
        return "hello:" + self._send(mutate(r, hello) + tail if mutated else hello + tail)

    def request_case(self) -> str:
        """A correct handshake, then a request without the namespace's proof (mutated or
        not); the node must close without serving anything."""
        r = self.rng
        with socket.create_connection(self.address, timeout=self.timeout_s) as s:
            t = handshake(s, self.keys.peer_key, "fuzz", self.node_id)
            good = t.ns_proof(self.keys.namespace(self.digest).request_key, self.digest)
            bit = r.randrange(8 * len(good))
            flipped = bytearray(good)
            flipped[bit // 8] ^= 1 << (bit % 8)
            proof = r.choice([bytes(32), r.randbytes(32), bytes(flipped)])
            count = r.choice([0, 1, len(self.block_keys), w.MAX_KEYS + 1, 2**32 - 1])
            req = w.REQUEST.pack(r.choice([w.REQUEST_MAGIC, w.RDMA_REQUEST_MAGIC, b"XXXX"]),
                                 r.choice([self.digest, r.randbytes(16)]), proof, count)
            req += b"".join(_KEY_LEN.pack(len(k)) + k for k in self.block_keys)
            with contextlib.suppress(OSError):
                s.sendall(mutate(r, req) if r.random() < 0.5 else req)
                s.shutdown(socket.SHUT_WR)
            got = self._drain(s)
        if got:
            self.unproven_answered += 1
        if any(sec in got for sec in self.secrets):
            self.unproven_served += 1
            return "request:SERVED"
        return "request:" + ("answered" if got else "closed")

    def case(self) -> str:
        """One case: its label, ``kind:outcome`` (kind one of :data:`KINDS`)."""
        pick = self.rng.random()
        try:
            if pick < 0.2:
                return self.random_case()
            if pick < 0.5:
                return self.hello_case()
            return self.request_case()
        except (ConnectionError, TimeoutError) as exc:
            kind = "random" if pick < 0.2 else "hello" if pick < 0.5 else "request"
            return f"{kind}:conn_{type(exc).__name__}"


def _blocks(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, PEER_LAYOUT.block_nbytes, dtype=np.uint8) for _ in range(n)]


def _keys(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


class PeerFuzz:
    """``ctxmem fuzz``'s peer target: a pod of two nodes (``workdir``), cases against
    node 1's peer port, and the checks after each batch (:meth:`check`).

    The victim (tenant ``default``, model ``fuzz``) puts blocks on node 1; the cases
    name its namespace and keys. A check: both nodes alive; node 1 answers Stats; its
    ``pod_served_blocks`` grew by nothing since the previous check's cross-node get (only
    the fuzz cases ran in between, and none proved the namespace's key); no fuzz case
    read back a victim block; then a fresh set of blocks put on node 1 and read through
    node 2, byte-exact (node 2 fetches them from node 1 over the peer port)."""

    BLOCKS = 3

    def __init__(self, workdir: Path, rng: random.Random, seed: int,
                 fail: Callable[[str], None]) -> None:
        self.rng = rng
        self.seed = seed
        self._fail = fail
        self.failed = 0
        self.gets = self.wrong_blocks = self.get_misses = self.served_unproven = 0
        self.stats_failures = 0
        self._served = 0.0
        self._round = 0
        self.pod = LocalPod(workdir, 2)
        self.client: dict[str, Client] = {}
        try:
            self._setup(seed, rng)
        except BaseException:
            self.close()
            raise

    def _setup(self, seed: int, rng: random.Random) -> None:
        self.client = {n.endpoint: Client(n.endpoint, timeout_s=15) for n in self.pod.nodes}
        n1 = self.pod.nodes[0]
        host, port = n1.config["pod"]["listen"].rsplit(":", 1)
        keys = _keys(self.BLOCKS, seed ^ 0x9EE1)
        self.victim = (keys, _blocks(self.BLOCKS, seed & 0xFFFF))
        self._put(n1.endpoint, *self.victim)
        self.target = PeerTarget(
            (host, int(port)), "node1", PodKeys(self.pod.master_key, self.pod.token.encode()),
            namespace_digest("default", "fuzz", PEER_LAYOUT), keys,
            [b.tobytes()[:512] for b in self.victim[1]], rng)

    def fail(self, what: str) -> None:
        """Record a failure (the run's list, and :attr:`failed`)."""
        self.failed += 1
        self._fail(f"peer: {what}")

    def _ns(self, endpoint: str) -> Any:
        return self.client[endpoint].open_namespace(PEER_LAYOUT, model_id="fuzz")

    def _put(self, endpoint: str, keys: list[bytes], data: list[np.ndarray]) -> None:
        stored = self._ns(endpoint).put(keys, data).stored
        if stored != len(keys):
            raise RuntimeError(f"peer target: node 1 stored {stored} of {len(keys)} blocks")

    def case(self, at: int) -> str:
        """One case of :class:`PeerTarget`; a correct handshake the node refused (or
        answered with a wrong challenge or proof) is a failure."""
        try:
            label = self.target.case()
        except AssertionError as exc:
            self.fail(f"case {at}: the node's side of a correct handshake is wrong: {exc}")
            return "request:bad_handshake"
        if label.startswith("request:conn_"):
            self.fail(f"case {at}: the node refused a correct handshake ({label})")
        return label

    def _alive(self, at: int) -> bool:
        for node in self.pod.nodes:
            if node.proc is None or node.proc.poll() is not None:
                code = None if node.proc is None else node.proc.returncode
                self.fail(f"crash: pod node {node.workdir.name} exited ({code}) by case {at}")
                return False
        return True

    def _stat(self, endpoint: str, name: str) -> float:
        return float(self.client[endpoint].stats().get(name, 0))

    def check(self, at: int) -> bool:
        """The checks of the class doc; False: stop (a node died or stopped answering)."""
        if not self._alive(at):
            return False
        n1, n2 = self.pod.nodes
        try:
            served = self._stat(n1.endpoint, "pod_served_blocks")
        except Exception as exc:
            self.stats_failures += 1
            self.fail(f"hang: pod node 1 Stats failed by case {at}: {exc!r}"[:300])
            return False
        if served != self._served:
            self.served_unproven += int(served - self._served)
            self.fail(f"node 1 served {served - self._served:.0f} blocks to fuzz cases by "
                      f"case {at} (none proved the namespace's key)")
        if self.target.unproven_served > self.served_unproven:
            self.served_unproven = self.target.unproven_served
            self.fail(f"a fuzz case read back a victim block by case {at}")
        self._round += 1
        keys = _keys(self.BLOCKS, (self.seed << 8) + self._round)
        data = _blocks(self.BLOCKS, (self.seed + self._round) & 0xFFFF_FFFF)
        try:
            self._put(n1.endpoint, keys, data)
            ns2 = self._ns(n2.endpoint)
            deadline = time.monotonic() + 10.0
            while ns2.lookup(keys).num_hits < len(keys) and time.monotonic() < deadline:
                time.sleep(0.05)  # node 1 publishes to the index
            out = [np.zeros(PEER_LAYOUT.block_nbytes, np.uint8) for _ in keys]
            hits = ns2.get(keys, out)
        except Exception as exc:
            self.fail(f"cross-node get failed by case {at}: {exc!r}"[:300])
            self.get_misses += len(keys)
            return True
        self.gets += 1
        self.get_misses += len(keys) - hits
        for i in range(hits):
            if not np.array_equal(out[i], data[i]):
                self.wrong_blocks += 1
                self.fail(f"wrong bytes: cross-node block {i} by case {at}")
        if hits < len(keys):
            self.fail(f"cross-node get by case {at}: {hits} of {len(keys)} blocks")
        # Node 1 counts what it served to node 2: the new baseline.
        deadline = time.monotonic() + 10.0
        while True:
            self._served = self._stat(n1.endpoint, "pod_served_blocks")
            if self._served >= served + hits or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return True

    def tracebacks(self) -> tuple[int, list[str]]:
        """``Traceback`` count in the nodes' logs, and samples."""
        n, samples = 0, []
        for node in self.pod.nodes:
            text = node.log_path.read_text(errors="replace") if node.log_path.exists() \
                else ""
            n += len(re.findall(r"^Traceback \(most recent call last\)", text, flags=re.M))
            samples += [m.group(0)[-1500:] for m in re.finditer(
                r"^Traceback \(most recent call last\):\n(?:[ \t].*\n)+.*", text, flags=re.M)]
        return n, samples

    def report(self) -> dict[str, Any]:
        t = self.target
        return {"cross_node_gets": self.gets, "cross_node_wrong_blocks": self.wrong_blocks,
                "cross_node_misses": self.get_misses,
                "served_unproven": self.served_unproven,
                "answered_unproven": t.unproven_answered}

    def close(self) -> None:
        for c in self.client.values():
            with contextlib.suppress(Exception):
                c.close()
        self.pod.close()
