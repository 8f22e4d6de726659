"""The arm64 image, run under QEMU user-mode emulation, serves an x86-64 shim over TCP
(CTXMEM_IMAGE_ARCH=amd64 runs the same checks natively on the amd64 image).

Slow and opt-in: runs only with CTXMEM_IMAGE_TEST=1 and an image built by
`deploy/image/build.sh --arch arm64` (`deploy/image/smoke.sh` does both). The image is
taken from CTXMEM_IMAGE (default out/image/ctxmem-VERSION-arm64.oci.tar).

What it does, as a container runtime would but without one: unpack the OCI archive
with umoci, run the image's own entrypoint + cmd (from the bundle's config.json:
tini -> /opt/ctxmem/venv/bin/ctxmem serve --config /etc/ctxmem/ctxmem.yaml) chrooted
into the root filesystem as the image's user (10001), with every arm64 binary executed
by qemu-aarch64 through binfmt_misc; then wait for /healthz and /readyz, and drive a
put/get round trip through the host's own (x86-64) shim over the TCP transport.
Needs root (chroot, umoci unpack) and a binfmt_misc handler for aarch64.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.kit import read_until, until

ROOT = Path(__file__).resolve().parents[2]
UID = GID = 10001
SERVE_CMD = ["serve", "--config", "/etc/ctxmem/ctxmem.yaml"]
START_TIMEOUT_S = 240.0  # first start under emulation: imports of grpc, numpy, cryptography
# The same test checks the amd64 image (native here) with CTXMEM_IMAGE_ARCH=amd64.
ARCH = os.environ.get("CTXMEM_IMAGE_ARCH", "arm64")
ELF_MACHINE = {"arm64": 0xB7, "amd64": 0x3E}  # EM_AARCH64, EM_X86_64
MACHINE = {"arm64": "aarch64", "amd64": "x86_64"}
EMULATED = os.uname().machine != MACHINE.get(ARCH, ARCH)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("CTXMEM_IMAGE_TEST") != "1",
        reason="image smoke test: set CTXMEM_IMAGE_TEST=1 (deploy/image/smoke.sh does)",
    ),
]


def _version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    for line in text.split("[project]", 1)[1].splitlines():
        if line.startswith("version"):
            return line.split("=", 1)[1].strip().strip('"')
    raise AssertionError("no version in pyproject.toml")


def _image_path() -> Path:
    default = ROOT / "out" / "image" / f"ctxmem-{_version()}-{ARCH}.oci.tar"
    return Path(os.environ.get("CTXMEM_IMAGE", str(default)))


def _require_environment() -> None:
    if not _image_path().is_file():
        pytest.skip(f"no image at {_image_path()}: run deploy/image/build.sh --arch {ARCH}")
    if os.geteuid() != 0:
        pytest.skip("needs root (chroot, umoci unpack)")
    if shutil.which("umoci") is None:
        pytest.skip("umoci not installed: run deploy/image/deps.sh")
    if EMULATED:
        handler = Path(f"/proc/sys/fs/binfmt_misc/qemu-{MACHINE[ARCH]}")
        if not handler.is_file() or not handler.read_text().startswith("enabled"):
            pytest.skip(f"no binfmt_misc handler {handler.name}: run deploy/image/deps.sh")


@dataclass
class Bundle:
    path: Path
    rootfs: Path
    tag: str
    image_config: dict[str, Any]
    runtime_config: dict[str, Any]


def _blob(layout: Path, digest: str) -> dict[str, Any]:
    algo, hexdigest = digest.split(":", 1)
    data = json.loads((layout / "blobs" / algo / hexdigest).read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Bundle:
    _require_environment()
    work = tmp_path_factory.mktemp("image")
    layout = work / "layout"
    layout.mkdir()
    subprocess.run(["tar", "-C", str(layout), "-xf", str(_image_path())], check=True,
                   timeout=600)
    index = json.loads((layout / "index.json").read_text())
    desc = index["manifests"][0]
    tag = desc["annotations"]["org.opencontainers.image.ref.name"]
    manifest = _blob(layout, desc["digest"])
    image_config = _blob(layout, manifest["config"]["digest"])
    path = work / "bundle"
    subprocess.run(["umoci", "unpack", "--image", f"{layout}:{tag}", str(path)],
                   check=True, capture_output=True, timeout=600)
    runtime_config = json.loads((path / "config.json").read_text())
    return Bundle(path, path / "rootfs", tag, image_config, runtime_config)


def test_image_metadata(bundle: Bundle) -> None:
    cfg = bundle.image_config
    assert cfg["architecture"] == ARCH
    assert cfg["os"] == "linux"
    assert bundle.tag == f"{_version()}-{ARCH}"
    c = cfg["config"]
    assert c["User"] == f"{UID}:{GID}"
    assert c["Entrypoint"][0] == "/usr/bin/tini"
    assert c["Entrypoint"][-1] == "/opt/ctxmem/venv/bin/ctxmem"
    assert c["Cmd"] == SERVE_CMD
    assert {"50051/tcp", "50052/tcp", "9464/tcp"} <= set(c["ExposedPorts"])
    assert c["Labels"]["org.opencontainers.image.version"] == _version()
    assert len(cfg["rootfs"]["diff_ids"]) == 2, "base layer + application layer"


def test_rootfs_arch_and_user(bundle: Bundle) -> None:
    python = bundle.rootfs / "usr" / "bin"
    real = sorted(python.glob("python3.[0-9]*"))
    real = [p for p in real if not p.is_symlink() and p.name.replace(".", "").isalnum()]
    assert real, "no CPython binary in the image"
    header = real[0].read_bytes()[:20]
    assert header[:4] == b"\x7fELF"
    assert int.from_bytes(header[18:20], "little") == ELF_MACHINE[ARCH]
    passwd = (bundle.rootfs / "etc" / "passwd").read_text()
    assert f"ctxmem:x:{UID}:{GID}:" in passwd
    assert (bundle.rootfs / "opt" / "ctxmem" / "venv" / "bin" / "ctxmem").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert isinstance(port, int)
        return port


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            status = resp.status
            assert isinstance(status, int)
            return status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


@dataclass
class Service:
    grpc: str
    metrics: str
    proc: subprocess.Popen[bytes]
    log: Path


@pytest.fixture(scope="module")
def service(bundle: Bundle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    rootfs = bundle.rootfs
    grpc_port, data_port, metrics_port = _free_port(), _free_port(), _free_port()
    key_dir = rootfs / "etc" / "ctxmem" / "keys"
    key_file = key_dir / "master.key"
    key_file.write_text(os.urandom(32).hex() + "\n")
    os.chown(key_file, UID, GID)
    key_file.chmod(0o400)
    (rootfs / "etc" / "ctxmem" / "ctxmem.yaml").write_text(
        "\n".join([
            "mode: fallback",
            "service:",
            f'  listen: "127.0.0.1:{grpc_port}"',
            f'  data_listen: "127.0.0.1:{data_port}"',
            '  shm_socket: ""',
            "  transports: [tcp]",
            "  insecure: true",
            "metrics:",
            f'  listen: "127.0.0.1:{metrics_port}"',
            "dram:",
            "  size: 256MiB",
            "  slab_size: 64MiB",
            "flash:",
            "  devices: []",
            "encryption:",
            "  enabled: true",
            "  key_file: /etc/ctxmem/keys/master.key",
            "logging:",
            "  level: info",
            "",
        ])
    )
    proc_dir = rootfs / "proc"
    subprocess.run(["mount", "-t", "proc", "proc", str(proc_dir)], check=True, timeout=30)
    process = bundle.runtime_config["process"]
    env = ["env", "-i", *process["env"]]
    log = tmp_path_factory.mktemp("service") / "serve.log"
    # The runtime's view: the image's args, env, cwd and user, chrooted into its rootfs.
    argv = ["chroot", f"--userspec={UID}:{GID}", str(rootfs), *env,
            "/bin/sh", "-c", 'cd "$0" && exec "$@"', process.get("cwd", "/"), *process["args"]]
    assert process["args"][-3:] == SERVE_CMD
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    svc = Service(f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{metrics_port}", proc, log)
    try:
        yield svc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        read_until(lambda: subprocess.run(["umount", str(proc_dir)], check=False,
                                          capture_output=True).returncode == 0, bool, 10, 1)


def _wait_ready(svc: Service) -> float:
    """Seconds until the service's /readyz answers 200; fails at once if it exits."""
    t0 = time.monotonic()

    def ready() -> bool:
        if svc.proc.poll() is not None:
            pytest.fail(f"service exited with {svc.proc.returncode}:\n{svc.log.read_text()}")
        return _http_status(svc.metrics + "/readyz") == 200
    until(ready, START_TIMEOUT_S,
          lambda: f"the service to be ready (/readyz 200); its log:\n{svc.log.read_text()}", 1)
    return time.monotonic() - t0


def test_service_health_and_round_trip(service: Service) -> None:
    startup_s = _wait_ready(service)
    print(f"{ARCH} service ({'emulated' if EMULATED else 'native'}) ready in {startup_s:.1f} s")
    # Which CRC32C path the image's service runs (its start line says): the native helper,
    # cross-compiled for arm64 (deploy/image/build.sh), so on a BlueField the ARMv8 CRC32C
    # instructions (qemu-aarch64 emulates them too).
    crc = re.search(r"CRC32C (\S+)", service.log.read_text())
    assert crc, f"the service's start line names no CRC32C path:\n{service.log.read_text()}"
    print(f"{ARCH} service CRC32C path: {crc.group(1)}")
    assert crc.group(1) == ("native/armv8-crc" if ARCH == "arm64" else crc.group(1)), crc.group(1)
    assert crc.group(1).startswith("native/"), crc.group(1)
    assert _http_status(service.metrics + "/healthz") == 200
    if EMULATED:
        # The image's PID 1 (tini) is a foreign binary run by QEMU through binfmt_misc.
        exe = os.readlink(f"/proc/{service.proc.pid}/exe")
        assert "qemu" in exe, exe

    import numpy as np

    import ctxmem

    layout = ctxmem.KVLayout(dtype="float16", num_layers=2, num_kv_heads=2, head_dim=64,
                             tokens_per_block=16)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 32000, size=16 * 8)
    keys = ctxmem.chain_hashes(tokens, layout.tokens_per_block)
    blocks = [rng.integers(0, 256, size=layout.block_nbytes, dtype=np.uint8) for _ in keys]
    out = [np.zeros(layout.block_nbytes, dtype=np.uint8) for _ in keys]
    with ctxmem.Client(service.grpc, transport="tcp", timeout_s=60.0) as client:
        ns = client.open_namespace(layout, model_id="image-smoke", tenant="smoke")
        ns.put(keys, blocks)
        assert ns.lookup(keys).num_hits == len(keys)
        loaded = ns.get(keys, out)
        assert client.transport_in_use == "tcp"
    assert loaded == len(keys)
    for want, got in zip(blocks, out, strict=True):
        assert np.array_equal(want, got)
    with urllib.request.urlopen(service.metrics + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert "ctxmem" in metrics
