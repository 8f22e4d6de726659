"""Client certificates to the index: a TLS-only ``redis-server`` with
``--tls-auth-clients yes``; nodes present ``pod.index_cert_file``/``index_key_file``. A
node without one is refused by the index: it starts, serves its own blocks, counts the
index unreachable and says once, at start, what to set — no crash, no restart loop. An
unsafe key file stops the service at start and fails ``ctxmem config check``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import ctxmem
from ctxmem_tools.bench.security_pki import make_pki, member_cert
from ctxmem_tools.launcher import ServiceProcess, local_config
from ctxmem_tools.pod_launcher import LocalPod, pod_section
from ctxmem_tools.redis_server import RedisServer
from tests.pod.podtest import Clients, blocks, wait_for

HINT = "the index requires a client certificate: set pod.index_cert_file"
CLOSED_HINT = ("the index closed the TLS connection: if it requires client certificates "
               "(tls-auth-clients yes), set pod.index_cert_file")


def test_index_with_client_certificates(tmp_path: Path, index_exe: str) -> None:
    pki = make_pki(tmp_path / "pki", tenants=())
    member = member_cert(pki, "pod-member")  # client use: what the nodes present
    clients = Clients()
    with RedisServer(tmp_path / "redis", tls=(pki.server_cert, pki.server_key, pki.ca),
                     tls_client=member, exe=index_exe) as index, \
            LocalPod(tmp_path / "pod", 2, index=index,
                     pod={"index_ca_file": str(pki.ca), "index_cert_file": str(member[0]),
                          "index_key_file": str(member[1])}) as pod:
        n1, n2 = pod.nodes
        keys = ctxmem.chain_hashes(range(16 * 4), 16)
        data = blocks(4, 29)
        # A node of the pod without a client certificate (same CA, token and index).
        d = tmp_path / "nocert"
        cfg = local_config(d)
        cfg["pod"] = pod_section(index.url, "nocert", pod.token,
                                 index_ca_file=str(pki.ca))
        n3 = ServiceProcess(d, cfg)
        try:
            assert clients.put(n1.endpoint, keys, data) == 4
            wait_for(lambda: clients.hits(n2.endpoint, keys) == 4, 30,
                     what="publish with a client certificate")
            assert clients.get(n2.endpoint, keys, data) == 4
            assert clients.stats(n2.endpoint)["pod_index_errors"] == 0

            # Refused by the index: its own blocks are served, node 1's are misses.
            mine = ctxmem.chain_hashes(range(5000, 5000 + 16 * 2), 16)
            assert clients.put(n3.endpoint, mine, data[:2]) == 2
            assert clients.get(n3.endpoint, mine, data[:2]) == 2
            assert clients.hits(n3.endpoint, keys) == 0
            assert clients.get(n3.endpoint, keys, data) == 0
            wait_for(lambda: clients.stats(n3.endpoint)["pod_index_errors"] >= 3, 30,
                     what="the refusals to be counted (heartbeats)")
            assert n3.proc is not None and n3.proc.poll() is None
            log = n3.log()
            # The server's alert, or (TLS 1.3: the alert raced by the connection's reset)
            # a closed connection; either way the log says what to set.
            assert HINT in log or CLOSED_HINT in log, log
            assert "TLSV13_ALERT_CERTIFICATE_REQUIRED" in log or CLOSED_HINT in log, log
            # Logged once per kind (heartbeat, lookup), not at every beat.
            assert log.count("pod heartbeat failed") == 1, log
            assert clients.hits(n1.endpoint, mine) == 0  # never published
        finally:
            clients.close()
            n3.stop()


def test_an_unsafe_index_key_file_stops_the_service_and_fails_config_check(
        tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki", tenants=())
    cert, key = member_cert(pki, "pod-member")
    cfg = local_config(tmp_path / "n")
    cfg["pod"] = pod_section("rediss://127.0.0.1:1/0", "n1", "x" * 32,
                             index_ca_file=str(pki.ca), index_cert_file=str(cert),
                             index_key_file=str(key))
    path = tmp_path / "ctxmem.yaml"
    path.write_text(yaml.safe_dump(cfg))

    def check() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ctxmem_common.cli", "config", "check",
                               "--quiet", str(path)], capture_output=True, text=True,
                              timeout=60, env=os.environ.copy())

    ok = check()
    assert ok.returncode == 0, ok.stderr
    os.chmod(key, 0o644)
    bad = check()
    assert bad.returncode == 2
    assert "pod.index_key_file" in bad.stderr and "chmod 600" in bad.stderr
    with pytest.raises(RuntimeError, match=r"pod\.index_key_file"):
        ServiceProcess(tmp_path / "n", cfg)
    os.chmod(key, 0o600)
    os.unlink(cert)  # missing on this machine: a warning for config check, fatal at start
    warn = check()
    assert warn.returncode == 0 and "pod.index_cert_file" in warn.stderr
    with pytest.raises(RuntimeError, match=r"pod\.index_cert_file: .* cannot be read"):
        ServiceProcess(tmp_path / "n", cfg)
