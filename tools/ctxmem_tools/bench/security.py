"""``ctxmem bench security``: what TLS and per-call authentication cost, in one run.

Side by side, on the same machine and buffers:

* the limits: single-thread AES-128-GCM and AES-256-GCM (``cryptography``'s AESGCM on
  1 MiB buffers), the ciphers TLS 1.3 uses for the bulk of the bytes;
* put and get GB/s over the TCP data plane: plaintext, and mutual TLS 1.3;
* a 10,000-key Lookup, p50/p99 of one call: plaintext with the per-call session check,
  without it (a service started with ``CTXMEM_BENCH_NO_SESSION_AUTH=1``, honoured only in
  insecure loopback mode), and over mutual TLS;
* the shared-memory get path with the per-call check on and off (issue 12: auth must not
  slow the shm and RDMA data paths by more than 5%).

``--json PATH`` writes ``{"results": [{"name", "value", "unit"}]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ctxmem.client import Client
from ctxmem.tls import TlsConfig
from ctxmem_common.keys import chain_hashes
from ctxmem_common.layout import KVLayout
from ctxmem_tools.launcher import ServiceProcess, local_config

MiB = 1 << 20
GB = 1e9
NO_AUTH_ENV = "CTXMEM_BENCH_NO_SESSION_AUTH"


@dataclass
class Result:
    name: str
    value: float
    unit: str


def aesgcm_rate(bits: int, repeat: int = 20) -> float:
    """Bytes/s of one thread's AES-GCM encryption of a 1 MiB buffer (best of ``repeat``)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead = AESGCM(AESGCM.generate_key(bit_length=bits))
    buf = os.urandom(MiB)
    nonce = os.urandom(12)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        aead.encrypt(nonce, buf, None)
        best = min(best, time.perf_counter() - t)
    return MiB / best


def _pki(root: Path) -> Any:
    from ctxmem_tools.bench.security_pki import make_pki

    return make_pki(root)


@contextmanager
def _service(workdir: Path, tls: dict[str, Any] | None, no_auth: bool) -> Iterator[
        ServiceProcess]:
    extra: dict[str, Any] = {"tls": tls} if tls else {}
    cfg = local_config(workdir, dram_size="512MiB", dram_slab="32MiB", flash_size=None,
                       transports=["shm", "tcp"], encryption=False, **extra)
    old = os.environ.get(NO_AUTH_ENV)
    if no_auth:
        os.environ[NO_AUTH_ENV] = "1"
    try:
        svc = ServiceProcess(workdir, cfg)
    finally:
        if old is None:
            os.environ.pop(NO_AUTH_ENV, None)
        else:
            os.environ[NO_AUTH_ENV] = old
    try:
        yield svc
    finally:
        svc.stop()


def _best(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _measure(svc: ServiceProcess, transport: str, tls: TlsConfig | None, label: str,
             total_mib: int, repeat: int, lookups: int, out: list[Result]) -> None:
    layout = KVLayout(dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=MiB,
                      tokens_per_block=1)  # 2 MiB blocks
    n = max(1, total_mib // 2)
    with Client(svc.endpoint, transport=transport, tls=tls,  # type: ignore[arg-type]
                verify_gets=False) as c:
        ns = c.open_namespace(layout, model_id="bench", tenant="alice")
        blocks = [bytearray(os.urandom(layout.block_nbytes)) for _ in range(n)]
        nbytes = n * layout.block_nbytes
        rounds = iter(range(1, 1 << 30))

        def put() -> None:  # new keys each round: every byte is sent and stored
            first = next(rounds) * n
            ns.put(chain_hashes(list(range(first, first + n)), 1), blocks)

        keys = chain_hashes(list(range(n)), 1)
        ns.put(keys, blocks)
        outs = [bytearray(layout.block_nbytes) for _ in range(n)]

        def get() -> None:  # every block a DRAM hit, or the figure means nothing
            got = ns.get(keys, outs)
            if got != n:
                raise RuntimeError(f"bench: {got} of {n} blocks came back; raise dram_size")

        # Gets first: the put rounds below fill DRAM with new keys and evict these.
        out.append(Result(f"{label} {transport} get", nbytes / _best(get, repeat) / GB,
                          "GB/s"))
        if transport == "tcp":
            out.append(Result(f"{label} put", nbytes / _best(put, repeat) / GB, "GB/s"))
        if lookups:
            lk = chain_hashes(list(range(10_000)), 1)
            times = []
            for _ in range(lookups):
                t = time.perf_counter()
                ns.lookup(lk)
                times.append(time.perf_counter() - t)
            times.sort()
            out.append(Result(f"{label} Lookup 10k p50", statistics.median(times) * 1e3, "ms"))
            out.append(Result(f"{label} Lookup 10k p99",
                              times[min(len(times) - 1, int(len(times) * 0.99))] * 1e3, "ms"))


def _parser() -> argparse.ArgumentParser:
    """The command's argument parser (also what tests/deploy/test_doc_shell_blocks.py
    checks the documented command lines with)."""
    ap = argparse.ArgumentParser(prog="ctxmem bench security", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total-mib", type=int, default=64, help="MiB per put/get batch")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--lookups", type=int, default=50, help="Lookup calls timed per mode")
    ap.add_argument("--json", default="")
    return ap


def run(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    out: list[Result] = [Result("AES-128-GCM 1 thread", aesgcm_rate(128) / GB, "GB/s"),
                         Result("AES-256-GCM 1 thread", aesgcm_rate(256) / GB, "GB/s")]
    with tempfile.TemporaryDirectory(prefix="ctxmem-bench-sec-") as tmp:
        root = Path(tmp)
        pki = _pki(root / "pki")
        tls_cfg = {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key),
                   "client_ca_file": str(pki.ca)}
        cert, key = pki.client["alice"]
        client_tls = TlsConfig(ca_file=str(pki.ca), cert_file=str(cert), key_file=str(key))
        m = (args.total_mib, args.repeat)
        with _service(root / "plain", None, no_auth=False) as svc:
            _measure(svc, "tcp", None, "plaintext, auth", *m, args.lookups, out)
            _measure(svc, "shm", None, "plaintext, auth", *m, 0, out)
        with _service(root / "noauth", None, no_auth=True) as svc:
            _measure(svc, "tcp", None, "plaintext, no auth", *m, args.lookups, out)
            _measure(svc, "shm", None, "plaintext, no auth", *m, 0, out)
        with _service(root / "mtls", tls_cfg, no_auth=False) as svc:
            _measure(svc, "tcp", client_tls, "mTLS 1.3, auth", *m, args.lookups, out)
    width = max(len(r.name) for r in out)
    for r in out:
        print(f"{r.name:<{width}}  {r.value:9.3f} {r.unit}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": [asdict(r) for r in out]}, indent=1))
    return 0
