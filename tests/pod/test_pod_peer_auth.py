"""Issue 25 items 1-3, as a hostile party would try them, against real service processes
and a real redis-server: nothing the index or a peer says is trusted until it verifies
under keys the service holds.

* An index writer (the Redis password alone) rewrites a victim's entries to name a node of
  its own (a real ctxmem node of the same pod token, with another master key) and the
  CRC32C of that node's bytes for the same keys: the victim's get through another node is
  a miss, nothing is adopted, and once the index is restored and the attacker gone the
  get is the victim's bytes, never the attacker's.
* What a fetcher sends to a peer the index named, before that peer proved anything: a
  hello (magic, version, a nonce, its node id) and one HMAC; no token, no namespace, no
  block key.
* With the pod token (and the protocol of today's code, or the new handshake under
  another master key), the real holder serves nothing; a client that passes the
  handshake but cannot prove it holds the namespace's key reads nothing either.
* The index holds no plaintext block key and no namespace digest.
* An index without authentication beyond loopback: the service refuses to start; on
  loopback it starts and warns; ``ctxmem config check`` says so.
* With mutual TLS, a holder of a valid member certificate that relays between two real
  nodes (TLS terminated on both legs) reads nothing: the handshake is bound to each TLS
  channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import socket
import ssl
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
import redis
import yaml
from crc32c import crc32c

import ctxmem
from ctxmem_common.configcheck import config_command
from ctxmem_common.keys import namespace_digest
from ctxmem_tools.launcher import ServiceProcess, local_config
from ctxmem_tools.pod_launcher import LocalPod, pod_section
from tests.pod.podtest import LAYOUT, Clients, blocks, wait_for

# The peer hello of this version, spelled out (the test reads the bytes as they come).
HELLO2 = struct.Struct("!4sB32sB")


def _entries_of(r: redis.Redis, node: str) -> dict[tuple[bytes, bytes], bytes]:
    """Every index entry (hash, field) → value that names ``node``: what an index writer
    sees without any key of the pod."""
    prefix = bytes((1, len(node))) + node.encode()
    out = {}
    for name in r.scan_iter(match="ctxmem:*:blocks"):
        for field, value in r.hgetall(name).items():
            if value.startswith(prefix):
                out[(name, field)] = value
    return out


def _pack_entry(node: str, nbytes: int, crc: int, seq: int = 1) -> bytes:
    """An index entry as both versions of the code read it (version 1, tier dram)."""
    raw = node.encode()
    return bytes((1, len(raw))) + raw + struct.pack("!I", 1) + struct.pack(
        "!BQQIB", 0, seq, nbytes, crc, 0)


def _join_as(r: redis.Redis, node: str, address: str) -> None:
    """An index writer makes ``node`` a live member at ``address``."""
    r.hset("ctxmem:{nodes}:members", node, address)
    r.set(f"ctxmem:{{nodes}}:alive:{node}", address, px=120_000)


def test_an_index_writer_cannot_make_a_node_adopt_attacker_bytes(
        tmp_path: Path, clients: Clients) -> None:
    with LocalPod(tmp_path / "pod", 2) as pod:
        n1, n2 = pod.nodes
        keys = ctxmem.chain_hashes(range(16 * 4), 16)
        victim = blocks(4, 101)
        evil = blocks(4, 202)
        assert clients.put(n1.endpoint, keys, victim) == 4
        # The attacker's node: same pod token, same index, its own (other) master key,
        # holding its own bytes under the victim's keys and namespace.
        d = tmp_path / "mallory"
        cfg = local_config(d)
        cfg["pod"] = pod_section(pod.redis.url, "mallory", pod.token)
        mallory = ServiceProcess(d, cfg)
        try:
            assert clients.put(mallory.endpoint, keys, evil) == 4
            wait_for(lambda: clients.hits(n2.endpoint, keys) == 4, what="publish")
            r = redis.Redis.from_url(pod.redis.url)
            wait_for(lambda: len(_entries_of(r, "node1")) == 4, what="node1's entries")
            saved = _entries_of(r, "node1")
            # The writer cannot tell which field is which key (keyed names): in four
            # rounds each field names each of the attacker's CRC32Cs once, so every key's
            # entry names the CRC32C of the attacker's block of that key in one round. A
            # fetcher that trusted the index's CRC32C would adopt it then.
            for shift in range(4):
                for i, ((name, field), _v) in enumerate(saved.items()):
                    r.hset(name, field, _pack_entry(
                        "mallory", LAYOUT.block_nbytes,
                        crc32c(evil[(i + shift) % 4].tobytes())))
                wait_for(lambda: clients.hits(n2.endpoint, keys) == 4,  # the index says so
                         what="node2 to see the attacker's node alive")
                assert clients.get(n2.endpoint, keys, victim) == 0  # ... a miss (checked)
            st = clients.stats(n2.endpoint)
            assert st.get("pod_fetch_blocks_peer", 0) == 0, st  # nothing adopted
            assert st["blocks"] == 0
        finally:
            mallory.kill()
        # The index restored, the attacker gone: the victim's bytes, from node 1.
        for (name, field), value in saved.items():
            r.hset(name, field, value)
        wait_for(lambda: clients.hits(n2.endpoint, keys) == 4, what="the restore")
        out = [np.zeros(LAYOUT.block_nbytes, np.uint8) for _ in keys]
        assert clients.ns(n2.endpoint).get(keys, out) == 4
        for i, o in enumerate(out):
            assert not np.array_equal(o, evil[i]), f"block {i}: the attacker's bytes"
            assert np.array_equal(o, victim[i]), f"block {i}: wrong bytes"


class Capture:
    """A peer an index writer names: it records every byte the fetcher sends, answers a
    hello of this version with a challenge naming the node the index named, then with a
    proof it cannot make (random), and keeps recording until the fetcher closes."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.got: list[bytes] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(20)
            buf = b""
            try:
                while len(buf) < HELLO2.size:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                _magic, version, _nonce, n = HELLO2.unpack_from(buf)
                if version == 2:
                    node = self.node.encode()
                    conn.sendall(HELLO2.pack(b"CXPC", 2, bytes(32), len(node)) + node)
                    while len(buf) < HELLO2.size + n + 32:
                        chunk = conn.recv(65536)
                        if not chunk:
                            return
                        buf += chunk
                    conn.sendall(b"\x01" + bytes(32))  # a proof it cannot make
                else:  # today's code: the bearer-token hello; say yes, see what comes
                    conn.sendall(b"\x01")
                while chunk := conn.recv(65536):
                    buf += chunk
            except (OSError, struct.error):
                pass
            finally:
                self.got.append(buf)
                self.done.set()

    def close(self) -> None:
        self.sock.close()


def test_a_fetcher_sends_no_secret_to_a_peer_that_proved_nothing(
        pod: LocalPod, clients: Clients) -> None:
    n1, n2, _ = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 2), 16)
    data = blocks(2, 7)
    assert clients.put(n1.endpoint, keys, data) == 2
    wait_for(lambda: clients.hits(n2.endpoint, keys) == 2, what="publish")
    r = redis.Redis.from_url(pod.redis.url)
    wait_for(lambda: len(_entries_of(r, "node1")) == 2, what="node1's entries")
    cap = Capture("evil")
    try:
        _join_as(r, "evil", f"127.0.0.1:{cap.port}")
        for (name, field), _v in _entries_of(r, "node1").items():
            r.hset(name, field, _pack_entry("evil", LAYOUT.block_nbytes,
                                            crc32c(bytes(LAYOUT.block_nbytes))))
        wait_for(lambda: clients.hits(n2.endpoint, keys) == 2, what="the rewrite")
        assert clients.get(n2.endpoint, keys, data) == 0
        assert cap.done.wait(30), "the fetcher never called the attacker's peer"
    finally:
        cap.close()
    got = cap.got[0]
    digest = namespace_digest("default", "m", LAYOUT)
    assert pod.token.encode() not in got, "the pod token went to an unproven peer"
    for secret in (digest, digest.hex().encode(), *keys, pod.master_key):
        assert secret not in got
    # Exactly a hello (magic, version, a 32-byte nonce, the node id) and a 32-byte HMAC:
    # no request (namespace, keys) followed the failed proof.
    magic, version, _nonce, n = HELLO2.unpack_from(got)
    assert (magic, version) == (b"CXPH", 2)
    assert got[HELLO2.size:HELLO2.size + n] == b"node2"
    assert len(got) == HELLO2.size + n + 32, got[HELLO2.size + n + 32:][:64]
    st = clients.stats(n2.endpoint)
    assert st["pod_peer_errors"] >= 1 and st.get("pod_fetch_blocks_peer", 0) == 0


def _read(sock: socket.socket, n: int) -> bytes:
    """Up to ``n`` bytes: fewer when the other end closes or goes quiet (the socket's
    timeout)."""
    out = b""
    while len(out) < n:
        try:
            chunk = sock.recv(n - len(out))
        except TimeoutError:
            break
        if not chunk:
            break
        out += chunk
    return out


def test_the_pod_token_or_the_peer_key_alone_reads_no_victim_block(
        pod: LocalPod, clients: Clients) -> None:
    """The attacker has the pod token and reads the victim's namespace digest and keys
    (the test hands them over: the index no longer shows them): the holder serves
    nothing, whether it says today's bearer-token hello, or the handshake under another
    master key, or passes the handshake (the peer key) and cannot prove it holds the
    namespace's key."""
    n1 = pod.nodes[0]
    keys = ctxmem.chain_hashes(range(16 * 4), 16)
    data = blocks(4, 9)
    assert clients.put(n1.endpoint, keys, data) == 4
    digest = namespace_digest("default", "m", LAYOUT)
    host, port = n1.config["pod"]["listen"].rsplit(":", 1)
    tok = pod.token.encode()
    request = struct.pack("!4s16sI", b"CXPR", digest, len(keys)) + b"".join(
        bytes((len(k),)) + k for k in keys)
    # Today's hello: the bearer token, then a request for the victim's blocks.
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(struct.pack("!4sBH", b"CXPH", 1, len(tok)) + tok + request)
        s.settimeout(5)
        got = _read(s, 1 << 20)
    assert data[0].tobytes()[:4096] not in got and len(got) < LAYOUT.block_nbytes
    assert clients.stats(n1.endpoint).get("pod_served_blocks", 0) == 0

    from ctxmem_common import peer_wire as w
    from ctxmem_common.podkeys import PodKeys
    from tests.pod.peerkit import handshake, pod_keys

    # The new handshake with the token but another master key: refused at the proof.
    with socket.create_connection((host, int(port)), timeout=10) as s, \
            pytest.raises(ConnectionError):
        handshake(s, PodKeys(bytes(32), tok).peer_key, "mallory", "node1")
    # The peer key (the handshake passes) but not the namespace's key: closed, nothing.
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.settimeout(10)
        t = handshake(s, pod_keys(pod).peer_key, "mallory", "node1")
        wrong = PodKeys(bytes(32)).namespace(digest).request_key
        s.sendall(w.pack_keys(digest, keys, w.REQUEST_MAGIC, t.ns_proof(wrong, digest)))
        assert _read(s, 1 << 20) == b""
    st = clients.stats(n1.endpoint)
    assert st.get("pod_served_blocks", 0) == 0 and st["pod_peer_refused"] >= 3
    # The same request with the namespace's key (a pod member acting for the tenant): the
    # blocks, each with an authenticator that verifies under the namespace's key.
    pk = pod_keys(pod)
    nk = pk.namespace(digest)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.settimeout(10)
        t = handshake(s, pk.peer_key, "node2", "node1")
        s.sendall(w.pack_keys(digest, keys, w.REQUEST_MAGIC,
                              t.ns_proof(nk.request_key, digest)))
        for k, d in zip(keys, data, strict=True):
            status, _crc, n, seq, tag = w.ANSWER.unpack(_read(s, w.ANSWER.size))
            body = _read(s, n)
            assert status == 1 and body == d.tobytes()
            assert nk.auth.verify(k, body, tag, t.answer_context(seq))
            assert not nk.auth.verify(k, body, tag, t.answer_context(seq + 1))


def test_the_index_holds_no_block_key_and_no_namespace_digest(
        pod: LocalPod, clients: Clients) -> None:
    n1, n2, _ = pod.nodes
    keys = ctxmem.chain_hashes(range(16 * 4), 16)
    assert clients.put(n1.endpoint, keys, blocks(4, 3)) == 4
    wait_for(lambda: clients.hits(n2.endpoint, keys) == 4, what="publish")
    r = redis.Redis.from_url(pod.redis.url)
    everything = []
    for name in r.scan_iter():
        everything.append(name)
        kind = r.type(name)
        if kind == b"hash":
            for f, v in r.hgetall(name).items():
                everything += [f, v]
        elif kind == b"string":
            everything.append(r.get(name) or b"")
    blob = b"\n".join(everything)
    assert len(_entries_of(r, "node1")) == 4  # the entries are there ...
    digest = namespace_digest("default", "m", LAYOUT)
    for secret in (digest, digest.hex().encode()):
        assert secret not in blob, "the namespace digest is in the index"
    for k in keys:  # ... under no plaintext block key
        assert k not in blob and k.hex().encode() not in blob, "a block key is in the index"


def _config_check(tmp_path: Path, url: str) -> str:
    """``ctxmem config check`` of a pod node's config with ``url`` as its index: exit
    status and stderr."""
    cfg = local_config(tmp_path)
    cfg["pod"] = pod_section(url, "n1", "x" * 32)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = config_command(["check", "--quiet", str(path)])
    return f"rc={rc}\n{err.getvalue()}"


def test_an_index_without_authentication(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond loopback, no password (URL or variable) and no client certificate: the
    service does not start and ``ctxmem config check`` says why (invalid when the
    variable is set empty here; a warning when it may be set on the target); on loopback
    it starts, with a warning in its log."""
    monkeypatch.delenv("CTXMEM_POD_INDEX_PASSWORD", raising=False)
    cfg = local_config(tmp_path / "far")
    cfg["pod"] = pod_section("redis://10.255.255.1:6379/0", "n1", "x" * 32)
    with pytest.raises(RuntimeError, match=r"pod\.index_url: .*without authentication"):
        ServiceProcess(tmp_path / "far", cfg)
    far = "redis://10.255.255.1:6379/0"
    out = _config_check(tmp_path / "c1", far)
    assert "rc=0" in out and "without authentication" in out, out
    monkeypatch.setenv("CTXMEM_POD_INDEX_PASSWORD", "")
    out = _config_check(tmp_path / "c2", far)
    assert "rc=2" in out and "without authentication" in out, out
    out = _config_check(tmp_path / "c3", "redis://:pw@10.255.255.1:6379/0")
    assert "rc=0" in out and "authentication" not in out, out
    out = _config_check(tmp_path / "c4", "redis://127.0.0.1:6379/0")
    assert "rc=0" in out and "without a password or client certificate" in out, out
    monkeypatch.delenv("CTXMEM_POD_INDEX_PASSWORD")
    # Loopback: starts, warns.
    cfg = local_config(tmp_path / "near")
    cfg["pod"] = pod_section("redis://127.0.0.1:1/0", "n1", "x" * 32)
    node = ServiceProcess(tmp_path / "near", cfg)
    try:
        assert "reached without a password or client certificate" in node.log()
    finally:
        node.stop()


class TlsRelay:
    """A holder of a valid pod-CA member certificate on the path to node 1 (the network
    redirects node 1's address to it): it terminates TLS on both legs and pipes the bytes
    through, recording what node 1 sends in plaintext.

    On an event loop of its own (one thread): an ``ssl.SSLSocket`` read by one thread
    while another writes to it is not safe (TLS 1.3 reads may write: session tickets), and
    a threaded relay once broke its upstream leg (node 1 logged an SSLError, never saw the
    relayed proof, and counted no refusal)."""

    def __init__(self, cert: Path, key: Path, ca: Path, target: tuple[str, int]) -> None:
        self.target = target
        self.server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.server.load_cert_chain(cert, key)
        self.server.load_verify_locations(ca)
        self.server.verify_mode = ssl.CERT_REQUIRED
        self.client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        self.client.load_cert_chain(cert, key)
        self.client.load_verify_locations(ca)
        self.client.check_hostname = False
        self.seen = bytearray()  # node 1 → fetcher, decrypted
        self.relayed = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._relay, "127.0.0.1", 0, ssl=self.server),
            self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _relay(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter
                     ) -> None:
        try:
            up_r, up_w = await asyncio.wait_for(asyncio.open_connection(
                *self.target, ssl=self.client, server_hostname=""), 20)
        except (OSError, ssl.SSLError, asyncio.TimeoutError):
            down_w.close()
            return
        self.relayed += 1
        await asyncio.gather(self._pipe(down_r, up_w, None), self._pipe(up_r, down_w,
                                                                         self.seen))

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    record: bytearray | None) -> None:
        try:
            while chunk := await asyncio.wait_for(src.read(65536), 20):
                if record is not None:
                    record += chunk
                dst.write(chunk)
                await dst.drain()
        except (OSError, ssl.SSLError, asyncio.TimeoutError):
            pass
        finally:  # one leg ended: end the other (its pipe's read then ends too)
            dst.close()

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            await self._server.wait_closed()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_a_member_certificate_relaying_between_two_nodes_reads_nothing(
        tmp_path: Path, clients: Clients) -> None:
    """Mutual TLS on, node 1's address redirected to a relay holding a valid member
    certificate: the handshake is bound to each TLS channel, so node 2's proof fails on
    the relay's channel to node 1; nothing is served, the relay sees no block byte."""
    import secrets

    from ctxmem_tools.bench.security_pki import make_pki, member_cert
    from ctxmem_tools.launcher import free_port
    from ctxmem_tools.pod_launcher import write_key
    from ctxmem_tools.redis_server import RedisServer

    pki = make_pki(tmp_path / "pki", tenants=())
    cert, key = member_cert(pki, "pod-member")
    evil_cert, evil_key = member_cert(pki, "mallory")
    tls = {"tls_cert_file": str(cert), "tls_key_file": str(key), "tls_ca_file": str(pki.ca)}
    # Nothing gives up before node 2's proof reaches node 1 through the relay (two TLS
    # handshakes and a Python pipe on a loaded machine can take seconds): with the
    # default 5 s fetch deadline, node 2 once closed before sending its proof, node 1 saw
    # the connection end, not a bad proof, and counted no refusal.
    patient = {"fetch_timeout_s": 60.0, "connect_timeout_s": 30.0, "hello_timeout_s": 60.0}
    token, master = secrets.token_hex(16), secrets.token_hex(32)
    keys = ctxmem.chain_hashes(range(16 * 3), 16)
    data = blocks(3, 77)
    nodes: list[ServiceProcess] = []
    with RedisServer(tmp_path / "redis") as index:
        p1 = free_port()
        relay = TlsRelay(evil_cert, evil_key, pki.ca, ("127.0.0.1", p1))
        try:
            for i, extra in ((1, {"port": p1, "advertise": f"127.0.0.1:{relay.port}"}),
                             (2, {})):
                d = tmp_path / f"node{i}"
                write_key(d / "master.key", master)
                cfg = local_config(d)
                cfg["pod"] = pod_section(index.url, f"node{i}", token, **extra, **tls,
                                         **patient)
                nodes.append(ServiceProcess(d, cfg))
            n1, n2 = nodes
            assert clients.put(n1.endpoint, keys, data) == 3
            wait_for(lambda: clients.hits(n2.endpoint, keys) == 3, what="publish")
            assert clients.get(n2.endpoint, keys, data) == 0  # through the relay: misses
            assert relay.relayed >= 1, "the fetch never went through the relay"
            assert data[0].tobytes()[:512] not in bytes(relay.seen), "a block in transit"
            # n1 counts the refusal when it reads the relayed proof, which may be just after
            # n2's get saw the connection end: wait for the count (bounded).
            wait_for(lambda: clients.stats(n1.endpoint)["pod_peer_refused"] >= 1,
                     timeout_s=30.0,
                     what=lambda: "node 1 to count the relayed proof as refused; node 1's "
                                  f"log:\n{n1.log()[-3000:]}\nnode 2's log:\n"
                                  f"{n2.log()[-3000:]}")
            assert clients.stats(n1.endpoint).get("pod_served_blocks", 0) == 0
        finally:
            relay.close()
            for n in nodes:
                n.stop()
