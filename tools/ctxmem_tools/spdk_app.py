"""A real ``spdk_tgt`` (built by ``deploy/ci/spdk-build.sh``) as a DPU's storage stack.

It runs without hugepages (``--no-huge``), on one core, with its RPC socket and log in
a private work directory, and with CPU-core lock files off (``--disable-cpumask-locks``:
the QEMU test guest's ``/var/tmp`` is read-only). ctxmem's ``spdk`` backend then drives
it over that socket exactly as it drives SNAP on a BlueField.

The build is found through ``CTXMEM_SPDK_PREFIX`` (``tests/vm/run.sh`` sets it in the
guest; the prefix holds ``bin/spdk_tgt`` and ``lib/``). Test and bench set-up calls go
through SPDK's own JSON-RPC client (the ``spdk`` extra); the tools never import the
service (tests/test_boundaries.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

__all__ = ["SpdkApp", "spdk_prefix"]

PREFIX_ENV = "CTXMEM_SPDK_PREFIX"


def spdk_prefix() -> Path | None:
    """The SPDK build named by ``CTXMEM_SPDK_PREFIX``, if it holds ``bin/spdk_tgt``."""
    value = os.environ.get(PREFIX_ENV, "")
    if not value:
        return None
    prefix = Path(value)
    return prefix if (prefix / "bin" / "spdk_tgt").is_file() else None


class SpdkApp:
    """One ``spdk_tgt`` process.

    Args:
        workdir: private directory for the RPC socket and the log (must not be on 9p:
            a Unix socket cannot live there).
        prefix: the SPDK build (default: ``spdk_prefix()``).
        mem_mb: DPDK memory without hugepages (``-s``); 1024 MiB is the least that
            initialises every subsystem (512 fails in iSCSI's pools).
    """

    def __init__(self, workdir: Path, prefix: Path | None = None, mem_mb: int = 1024) -> None:
        found = prefix or spdk_prefix()
        if found is None:
            raise RuntimeError(
                f"no SPDK build: set {PREFIX_ENV} to a prefix with bin/spdk_tgt "
                "(bash deploy/ci/spdk-build.sh prints it)")
        self.prefix = found
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        workdir.chmod(0o700)
        self.socket = str(workdir / "spdk.sock")
        self.log_path = workdir / "spdk_tgt.log"
        self.mem_mb = mem_mb
        self.proc: subprocess.Popen[bytes] | None = None
        self._client: Any = None

    def start(self, timeout_s: float = 120.0) -> None:
        """Start ``spdk_tgt`` and wait until its RPC socket answers ``spdk_get_version``.

        Raises:
            RuntimeError: it exited, or did not answer within ``timeout_s`` (log quoted).
        """
        if self.proc is not None and self.proc.poll() is None:
            return
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        env = dict(os.environ)
        lib = str(self.prefix / "lib")
        env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"]
                                        if env.get("LD_LIBRARY_PATH") else "")
        args = [str(self.prefix / "bin" / "spdk_tgt"), "--no-huge", "-s", str(self.mem_mb),
                "-m", "0x1", "--disable-cpumask-locks", "-r", self.socket]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=self.workdir)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"spdk_tgt exited with status {self.proc.returncode}; its log "
                    f"({self.log_path}):\n{self.log()}")
            if os.path.exists(self.socket):
                from spdk.rpc.client import JSONRPCException

                try:
                    self.rpc("spdk_get_version", timeout_s=10.0)
                    return
                except (JSONRPCException, OSError):
                    pass  # not listening yet: keep waiting
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"spdk_tgt not answering on {self.socket} after {timeout_s:g} s; its "
                    f"log:\n{self.log()}")
            time.sleep(0.2)

    def rpc(self, method: str, params: dict[str, Any] | None = None,
            timeout_s: float = 60.0) -> Any:
        """One JSON-RPC call (test and bench set-up; ctxmem's own come from its backend).

        Raises:
            spdk.rpc.client.JSONRPCException: SPDK's error (the reply quoted), or no reply
                within ``timeout_s``; the next call reconnects.
        """
        from spdk.rpc.client import JSONRPCClient

        if self._client is None:
            self._client = JSONRPCClient(self.socket, timeout=timeout_s, conn_retries=0)
            # The client adds a log handler per instance to a per-address logger.
            del self._client.get_logger().handlers[1:]
        self._client.timeout = timeout_s
        try:
            return self._client.call(method, dict(params or {}))
        except Exception:
            self._drop_client()
            raise

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(OSError):
                client.close()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except FileNotFoundError:
            return ""

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGINT (SPDK's clean shutdown: it stops its disks and detaches), then kill."""
        self._drop_client()
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        return proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.proc = None

    def __enter__(self) -> SpdkApp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m ctxmem_tools.spdk_app --workdir DIR -- COMMAND...``: run COMMAND while
    a ``spdk_tgt`` listens on ``DIR/spdk.sock`` (e.g. ``ctxmem bench --flash-device`` with
    an ``spdk`` device in the QEMU guest); exits with COMMAND's status."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m ctxmem_tools.spdk_app", description=main.__doc__)
    p.add_argument("--workdir", required=True, help="private directory for socket and log")
    p.add_argument("--mem-mb", type=int, default=1024)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no COMMAND given")
    with SpdkApp(Path(args.workdir), mem_mb=args.mem_mb) as app:
        app.start()
        print(f"spdk_app: spdk_tgt ({app.prefix}) listening on {app.socket}", flush=True)
        return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
