"""``VllmServer`` chooses its port free, then starts the server: when another process
binds that port in between (it happened beside other servers), the start moves to another
port instead of failing. Tested with a stand-in for vLLM's Python (a real HTTP server on
the port it is given, which fails as uvicorn does when the port is taken)."""

from __future__ import annotations

import socket
import stat
import sys
from pathlib import Path

import httpx
import pytest

from ctxmem_tools.bench.engine import VllmServer

STANDIN = '''#!{python}
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
try:
    srv = http.server.HTTPServer(("127.0.0.1", port), H)
except OSError as e:
    print(f"ERROR: [Errno {{e.errno}}] error while attempting to bind on address "
          f"('127.0.0.1', {{port}}): Address already in use", flush=True)
    sys.exit(1)
srv.serve_forever()
'''


def _standin(tmp_path: Path) -> str:
    exe = tmp_path / "python"
    exe.write_text(STANDIN.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


def test_a_port_taken_before_the_start_moves_the_server(tmp_path: Path) -> None:
    srv = VllmServer(_standin(tmp_path), [], tmp_path)
    chosen = srv.port
    with socket.socket() as other:  # another process took the chosen port
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", chosen))
        other.listen(1)
        try:
            srv.start(timeout_s=60)
            assert srv.port != chosen and srv.url.endswith(f":{srv.port}")
            assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
            assert "Address already in use" in srv.log()
        finally:
            srv.stop()


def test_another_failure_is_not_retried(tmp_path: Path) -> None:
    exe = tmp_path / "python"
    exe.write_text(f"#!{sys.executable}\nprint('boom'); raise SystemExit(3)\n")
    exe.chmod(0o755)
    srv = VllmServer(str(exe), [], tmp_path)
    port = srv.port
    with pytest.raises(RuntimeError, match="exited with status 3"):
        srv.start(timeout_s=60)
    assert srv.port == port and srv.log().count("boom") == 1
