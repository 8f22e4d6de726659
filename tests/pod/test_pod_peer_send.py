"""Issue 28 item 2, the holder's side: plaintext peer-fetch answers are sent by sender
threads, from the pinned slots, on the real service (one node, the test speaking the
peer wire with the pod's keys, :mod:`tests.pod.peerkit`).

* A requester that takes no byte of a 24 MiB answer (its receive window 4 KiB, it never
  reads) holds one sender thread; another connection's answer is still sent whole,
  byte-exact, each block's authenticator verifying under the namespace's key, and only
  the complete answer is counted (``pod_served_blocks``).
* The node stopped while that answer is stuck stops cleanly (exit status 0), well before
  the answer's own timeout (``data_plane.read_timeout_s``, 120 s here): the stop shuts the
  stuck socket down, the sender thread ends, and the slots are unpinned after it.
"""

from __future__ import annotations

import select
import socket
import time
from pathlib import Path

import numpy as np

import ctxmem
from ctxmem_common import peer_wire as w
from ctxmem_common.keys import chain_hashes, namespace_digest
from ctxmem_tools.pod_launcher import LocalPod
from tests.kit import byte_layout
from tests.pod.peerkit import handshake, pod_keys, read_exactly

BIG = byte_layout(4 << 20, tokens_per_block=2)  # 4 MiB blocks
N = 12


def _request(sock: socket.socket, pod: LocalPod, digest: bytes, keys: list[bytes]
             ) -> w.Transcript:
    pk = pod_keys(pod)
    t = handshake(sock, pk.peer_key, "tester", "node1")
    sock.sendall(w.pack_keys(digest, keys, w.REQUEST_MAGIC,
                             t.ns_proof(pk.namespace(digest).request_key, digest)))
    return t


def test_an_answer_nobody_reads_holds_up_no_other_and_not_the_stop(tmp_path: Path) -> None:
    with LocalPod(tmp_path / "pod", 1, dram_size="128MiB", dram_slab="16MiB",
                  flash_size=None, data_plane={"read_timeout_s": 120.0}) as pod:
        (n1,) = pod.nodes
        keys = chain_hashes(range(BIG.tokens_per_block * N), BIG.tokens_per_block)
        rng = np.random.default_rng(5)
        data = [rng.integers(0, 255, BIG.block_nbytes, dtype=np.uint8) for _ in range(N)]
        with ctxmem.Client(n1.endpoint) as c:
            assert c.open_namespace(BIG, model_id="m").put(keys, data).stored == N
        digest = namespace_digest("default", "m", BIG)
        host, port = n1.config["pod"]["advertise"].rsplit(":", 1)
        stuck = socket.socket()
        try:
            stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stuck.settimeout(10)
            stuck.connect((host, int(port)))
            _request(stuck, pod, digest, keys)
            # The answer started (bytes wait for us); we read none of its 24 MiB.
            assert select.select([stuck], [], [], 20)[0], "the holder never answered"
            # Another requester gets its whole answer meanwhile.
            with socket.create_connection((host, int(port)), timeout=20) as s:
                t = _request(s, pod, digest, keys[:2])
                nk = pod_keys(pod).namespace(digest)
                for k, d in zip(keys[:2], data[:2], strict=True):
                    status, _crc, n, seq, tag = w.ANSWER.unpack(read_exactly(s, w.ANSWER.size))
                    body = read_exactly(s, n)
                    assert status == 1 and body == d.tobytes()
                    assert nk.auth.verify(k, body, tag, t.answer_context(seq))
            with ctxmem.Client(n1.endpoint) as c:
                assert c.stats()["pod_served_blocks"] == 2  # the stuck answer: not counted
            # Stopped with the answer still stuck: a clean exit, not the answer's timeout
            # (nor a kill at the stop's own bound).
            t0 = time.monotonic()
            assert n1.stop(timeout_s=60) == 0, n1.log()
            assert time.monotonic() - t0 < 60
        finally:
            stuck.close()
