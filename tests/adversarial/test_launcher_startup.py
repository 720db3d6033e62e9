"""The unlucky operator starting a mesh (issue 12, section 2): with the HTTP port already
served by another process, `weft up` printed "Weft mesh is up" (the readiness probe was
answered by that process), then stopped and exited 0; a missing --model dumped a
service's usage text. Now both fail before anything starts: exit 1, one line naming the
cause, no service left running."""
from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.integration.launched_mesh import ROOT


class _AlwaysOk(BaseHTTPRequestHandler):
    """Another program on the port: answers every GET (e.g. /health) with 200."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


def _up(tmp_path, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weft", "up", "--grpc-port", "0", "--state-dir",
                           str(tmp_path / "state"), *args], capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)


def test_up_with_the_http_port_served_by_another_process_fails_naming_the_port(tmp_path, tiny_model_dir):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _AlwaysOk)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        out = _up(tmp_path, "--model", str(tiny_model_dir), "--http-port", str(port))
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Weft mesh is up" not in out.stdout
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("weft up failed: ") and f"port {port} (--http-port)" in errors[0]
    assert not (tmp_path / "state" / "logs").exists(), "services were started before the port check"


def test_up_with_a_missing_model_dir_says_no_such_directory(tmp_path):
    missing = tmp_path / "no-such-model"
    out = _up(tmp_path, "--model", str(missing), "--http-port", "0", timeout_s=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [f"weft up failed: no such directory: {missing} (--model)"]
    assert "usage" not in out.stderr


def test_up_with_a_bad_crash_loop_limit_fails_in_one_line(tmp_path):
    out = _up(tmp_path, "--http-port", "0", "--crash-loop-deaths", "0", timeout_s=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["weft up failed: crash-loop max_deaths must be >= 1"]
