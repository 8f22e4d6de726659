"""A real ``redis-server`` (Debian's package) on loopback, for tests, ``ctxmem bench pod``
and a pod of three on one machine.

It is started with no persistence (the cluster index is a cache of what the nodes hold;
every node republishes after a restart, see docs/pod.md), a password, and its files in a
private work directory. ``stop``/``start`` keep the port, so a test can take the index
away and give it back at the same URL. ``tls=(cert, key, ca)`` serves TLS only
(``rediss://``), ``tls_client`` makes it mutual (client certificates required);
:class:`RedisClusterServers` starts a Redis Cluster of such processes, with replicas if
asked. ``exe="valkey-server"`` runs Valkey instead (the same options and protocol).
"""

from __future__ import annotations

import secrets
import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path

from ctxmem_tools.launcher import free_ports


class PortTaken(RuntimeError):
    """redis-server could not bind its port or its cluster bus port (another process
    took it after this helper chose it)."""


class RedisServer:
    """One ``redis-server`` process; restartable on the same port and password."""

    def __init__(self, workdir: Path, port: int | None = None, bind: str = "127.0.0.1",
                 password: str | None = None, start: bool = True,
                 tls: tuple[Path, Path, Path] | None = None, cluster: bool = False,
                 tls_client: tuple[Path, Path] | None = None,
                 exe: str = "redis-server", node_timeout_ms: int = 2000) -> None:
        found = shutil.which(exe)
        if found is None:
            raise RuntimeError(
                f"{exe} not found: install Debian's {exe} package (deploy/setup.sh does "
                f"this; on Debian 12 valkey-server is in bookworm-backports: "
                f"deploy/ci/valkey.sh fetches it)")
        self.exe = found
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        workdir.chmod(0o700)
        self.bind = bind
        # Ports this helper chose (none given) may be taken by another process between
        # the choice and redis-server's bind: start() then chooses again.
        self._own_ports = port is None
        self._started = False
        self.port, bus = free_ports(2, bind) if port is None else (port, 0)
        self.password = password if password is not None else secrets.token_hex(16)
        self.log_path = workdir / "redis.log"
        self.tls = tls  # (certificate, key, CA): TLS only, no plain-TCP port
        # (certificate, key) this helper presents; with it the server requires a client
        # certificate signed by the CA from every client (--tls-auth-clients yes).
        self.tls_client = tls_client
        self.cluster = cluster
        self.node_timeout_ms = node_timeout_ms  # a failed master's replica waits this long
        # The cluster bus: its own free port (the default, port + 10000, may not exist).
        self.bus_port = (bus or free_ports(1, bind)[0]) if cluster else 0
        self.proc: subprocess.Popen[bytes] | None = None
        if start:
            self.start()

    @property
    def url(self) -> str:
        """``redis[s]://:PASSWORD@HOST:PORT/0`` (the form ``pod.index_url`` takes)."""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://:{self.password}@{self.bind}:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> None:
        """Start (a no-op while running) and wait for PING. The first start of ports this
        helper chose tries up to three pairs; a restart keeps its port (the index's URL)."""
        tries = 3 if self._own_ports and not self._started else 1
        for attempt in range(tries):
            try:
                self._start(timeout_s)
                self._started = True
                return
            except PortTaken:
                if attempt + 1 == tries:
                    raise
                self.port, bus = free_ports(2, self.bind)
                self.bus_port = bus if self.cluster else 0
                # The node never served: its generated cluster config names the old ports.
                (self.workdir / "nodes.conf").unlink(missing_ok=True)

    def _start(self, timeout_s: float) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        args = [self.exe, "--bind", self.bind, "--port", str(self.port),
                "--requirepass", self.password, "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--logfile", str(self.log_path),
                "--protected-mode", "yes"]
        if self.tls:
            cert, key, ca = self.tls
            args[3:5] = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file",
                         str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
                         "--tls-auth-clients", "yes" if self.tls_client else "no"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file",
                     str(self.workdir / "nodes.conf"),
                     "--cluster-node-timeout", str(self.node_timeout_ms),
                     "--cluster-port", str(self.bus_port),
                     "--masterauth", self.password,
                     # A replica's first sync at once (the default waits 5 s for others).
                     "--repl-diskless-sync-delay", "0"]
            if self.tls:  # the cluster bus over TLS too
                args += ["--tls-cluster", "yes", "--tls-replication", "yes"]
        log_from = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                log, rc = self.log(), self.proc.returncode
                self.proc = None
                try:
                    with open(self.log_path, "rb") as f:  # this start's lines only
                        f.seek(log_from)
                        taken = b"Address already in use" in f.read()
                except FileNotFoundError:
                    taken = False
                kind = PortTaken if taken else RuntimeError
                raise kind(
                    f"redis-server exited with status {rc} on {self.bind}:{self.port} (cluster "
                    f"bus {self.bus_port}); its log ({self.log_path}):\n{log}")
            if self._ping():
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"redis-server not answering on {self.bind}:{self.port} after "
                    f"{timeout_s} s:\n{self.log()}")
            time.sleep(0.02)

    def _ping(self) -> bool:
        return b"+PONG" in self.command("PING")

    def command(self, cmd: str, timeout_s: float = 0.5) -> bytes:
        """Send ``cmd`` (after AUTH) and return the raw reply bytes read within
        ``timeout_s`` (b"" when the server does not answer)."""
        try:
            with socket.create_connection((self.bind, self.port), timeout=timeout_s) as raw:
                s: socket.socket = raw
                if self.tls:
                    ctx = ssl.create_default_context(cafile=str(self.tls[2]))
                    if self.tls_client:
                        ctx.load_cert_chain(*self.tls_client)
                    s = ctx.wrap_socket(raw, server_hostname=self.bind)
                s.sendall(f"AUTH {self.password}\r\n{cmd}\r\n".encode())
                out = b""
                deadline = time.monotonic() + timeout_s
                while time.monotonic() < deadline:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    out += chunk
                    if out.startswith(b"+OK\r\n") and len(out) > 5 and out.endswith(b"\r\n"):
                        break
                return out
        except OSError:
            return b""

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisClusterServers:
    """A Redis Cluster of ``masters`` ``redis-server`` processes on loopback, each with
    ``replicas`` replicas, all with one password (``--requirepass`` and
    ``--masterauth``), slots spread evenly over the masters (CLUSTER ADDSLOTSRANGE,
    CLUSTER MEET, CLUSTER REPLICATE); ready once every node reports ``cluster_state:ok``
    and every master its replicas online. ``url`` names the first master
    (``pod.index_cluster: true``). ``node_timeout_ms`` (``cluster-node-timeout``): how
    long a master may be silent before its replica takes over. ``tls=(cert, key, CA)``:
    TLS only, clients and the cluster bus (``rediss://``); the bus is mutual TLS between
    the nodes, so the certificate needs client and server use
    (``security_pki.member_cert``). ``exe="valkey-server"`` runs a Valkey cluster."""

    def __init__(self, workdir: Path, masters: int = 3, timeout_s: float = 30.0,
                 tls: tuple[Path, Path, Path] | None = None, replicas: int = 0,
                 node_timeout_ms: int = 2000, exe: str = "redis-server") -> None:
        self.password = secrets.token_hex(16)
        self.nodes: list[RedisServer] = []  # masters first, then their replicas in order
        self.masters = masters
        try:
            for i in range(masters * (1 + replicas)):
                name = f"m{i}" if i < masters else f"r{i - masters}"
                self.nodes.append(RedisServer(workdir / name, password=self.password,
                                              cluster=True, tls=tls, exe=exe,
                                              node_timeout_ms=node_timeout_ms))
            # What ``redis-cli --cluster create`` does, without its one-second waits: an
            # even share of the 16384 slots per master, distinct config epochs, and every
            # node met by the first (gossip joins the rest).
            for i, n in enumerate(self.nodes[:masters]):
                lo, hi = 16384 * i // masters, 16384 * (i + 1) // masters - 1
                for cmd in (f"CLUSTER ADDSLOTSRANGE {lo} {hi}",
                            f"CLUSTER SET-CONFIG-EPOCH {i + 1}"):
                    self._ok(n, cmd)
            for n in self.nodes[1:]:
                self._ok(self.nodes[0], f"CLUSTER MEET {n.bind} {n.port} {n.bus_port}")
            ids = [self.node_id(n) for n in self.nodes[:masters]]
            deadline = time.monotonic() + timeout_s
            for j, r in enumerate(self.nodes[masters:]):
                # A replica can follow its master once it has learnt of it by gossip.
                cmd = f"CLUSTER REPLICATE {ids[j % masters]}"
                while not r.command(cmd, timeout_s=2.0).startswith(b"+OK\r\n+OK"):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{cmd} on {r.bind}:{r.port} not accepted after "
                                           f"{timeout_s} s:\n{r.log()}")
                    time.sleep(0.05)
            while not self._ready(replicas):
                if time.monotonic() > deadline:
                    states = [n.command("CLUSTER INFO")[:200] for n in self.nodes]
                    raise RuntimeError(f"Redis Cluster not ok after {timeout_s} s: {states}")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _ok(n: RedisServer, cmd: str) -> None:
        reply = n.command(cmd, timeout_s=2.0)
        if not reply.startswith(b"+OK\r\n+OK"):
            raise RuntimeError(f"{cmd} on {n.bind}:{n.port} answered {reply!r}:\n{n.log()}")

    def _ready(self, replicas: int) -> bool:
        if not all(b"cluster_state:ok" in n.command("CLUSTER INFO")
                   for n in self.nodes if n.proc is not None):
            return False
        # Each replica synced (a replica that never finished its first sync will not take
        # over: its data counts as too old).
        return all(b"master_link_status:up" in r.command("INFO replication")
                   for r in self.nodes[self.masters:] if r.proc is not None)

    @staticmethod
    def node_id(n: RedisServer) -> str:
        """``n``'s cluster node id (CLUSTER MYID)."""
        reply = n.command("CLUSTER MYID")
        parts = reply.split(b"\r\n")
        if len(parts) < 3 or not parts[1].startswith(b"$"):
            raise RuntimeError(f"CLUSTER MYID on {n.bind}:{n.port} answered {reply!r}")
        return parts[2].decode()

    def role(self, n: RedisServer) -> str:
        """``master`` or ``slave``, as ``n`` itself reports (INFO replication)."""
        for line in n.command("INFO replication").split(b"\r\n"):
            if line.startswith(b"role:"):
                return line[5:].decode()
        return ""

    @property
    def url(self) -> str:
        """The first node's ``redis://:PASSWORD@HOST:PORT/0``."""
        return self.nodes[0].url

    def owner_of(self, key: str) -> int:
        """The index (in :attr:`nodes`) of the master serving ``key``'s slot: the one node
        that answers ``EXISTS key`` rather than redirecting (``-MOVED``; a replica
        redirects too)."""
        for i, n in enumerate(self.nodes):
            if n.proc is None:
                continue
            reply = n.command(f"EXISTS {key}")
            if reply.startswith(b"+OK\r\n:"):
                return i
        raise RuntimeError(f"no master of the cluster serves key {key!r}")

    def replica_of(self, master: int) -> int:
        """The index (in :attr:`nodes`) of ``nodes[master]``'s first replica."""
        mid = self.node_id(self.nodes[master])
        for i, n in enumerate(self.nodes):
            if i != master and n.proc is not None and \
                    f"master_host:{n.bind}\r\nmaster_port:{self.nodes[master].port}".encode() \
                    in n.command("INFO replication"):
                return i
        raise RuntimeError(f"master {mid} ({self.nodes[master].port}) has no replica")

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> RedisClusterServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
