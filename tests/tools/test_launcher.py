"""The launcher survives a pre-picked port being taken before the service binds it."""

from __future__ import annotations

import socket
from pathlib import Path

from ctxmem_tools.launcher import ServiceProcess, local_config


def test_first_start_repicks_ports_when_one_is_taken(tmp_path: Path) -> None:
    cfg = local_config(tmp_path)
    taken = int(cfg["metrics"]["listen"].rsplit(":", 1)[1])
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        svc = ServiceProcess(tmp_path, cfg)
        try:
            assert svc.proc is not None and svc.proc.poll() is None
            assert not svc.metrics_listen.endswith(f":{taken}")
            assert "address already in use" in svc.log()  # the first attempt did fail
        finally:
            svc.stop()
