"""Process-management fixtures for integration tests: real services as real processes.

Stable names (other test modules rely on them):

helpers
    ``free_port()``                       a free loopback TCP port
    ``wait_for(cond, timeout_s, what)``   poll ``cond()`` until truthy, else fail with ``what``
    ``ServiceProcess``                    one ``python -m services.<name> ...`` child:
                                          ``.address``, ``.port``, ``.log_path``, ``.log_tail()``,
                                          ``.wait_healthy(timeout_s)``, ``.stop()``, ``.kill()``
    ``ProcessGroup``                      starts/stops several; ``.start(service, *flags, port=None,
                                          wait=True, env=None, name=None)``, ``.stop_all()``
    ``wait_healthy(address, timeout_s, service="")``  gRPC health SERVING with a deadline

fixtures
    ``tiny_model_dir``   (session)  a tiny random Llama checkpoint directory ("tiny" preset)
    ``nats_server``      (function) a fresh nats-server on a free port; ``.url``, ``.stop()``, ``.start()``
    ``processes``        (function) a ``ProcessGroup`` torn down after the test
    ``module_nats``      (module)   like ``nats_server`` but shared by a module's tests
    ``module_processes`` (module)   like ``processes`` but shared by a module's tests

Every service gets ``--host 127.0.0.1 --port <free>`` unless ``port`` is given, logs JSON
to ``<tmp>/<name>.log``, and is terminated (SIGTERM, then SIGKILL after 10 s) in
``finally``. When a test fails, the tail of every live service's log is attached to the
report ("weft service logs" section).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.mesh.nats_server import NatsServer, free_port

ROOT = Path(__file__).resolve().parents[2]
_LIVE: list["ServiceProcess"] = []  # for log dumps on failure

__all__ = ["ProcessGroup", "ServiceProcess", "free_port", "wait_for", "wait_healthy"]


def wait_for(cond: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.05) -> object:
    """Poll ``cond`` until it returns something truthy (returned); fail the test naming
    ``what`` after ``timeout_s``. Exceptions from ``cond`` count as "not yet"."""
    deadline = time.monotonic() + timeout_s
    last_exc: BaseException | None = None
    while True:
        try:
            value = cond()
            if value:
                return value
        except Exception as exc:  # not ready yet
            last_exc = exc
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}" + (f" (last error: {last_exc!r})" if last_exc else ""))
        time.sleep(interval_s)


def wait_healthy(address: str, timeout_s: float, service: str = "", alive: Callable[[], bool] | None = None) -> None:
    """Block until gRPC health of ``service`` at ``address`` is SERVING."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if alive is not None and not alive():
                raise RuntimeError(f"process behind {address} exited before becoming healthy")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=0.5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{address} not SERVING within {timeout_s}s")
            time.sleep(0.05)


class ServiceProcess:
    """``python -m services.<service> <flags>`` as a child process with its own log file."""

    def __init__(self, service: str, flags: list[str], port: int, log_path: Path, env: dict | None = None,
                 name: str | None = None) -> None:
        self.service = service
        self.name = name or service
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.log_path = log_path
        full_env = dict(os.environ, PYTHONPATH=str(ROOT), WEFT_LOG_FORMAT="json", PYTHONUNBUFFERED="1")
        full_env.update(env or {})
        self.argv = [sys.executable, "-m", f"services.{service}", *flags]
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(self.argv, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT)
        _LIVE.append(self)

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def wait_healthy(self, timeout_s: float = 30.0) -> ServiceProcess:
        try:
            wait_healthy(self.address, timeout_s, alive=lambda: self.running)
        except (RuntimeError, TimeoutError) as exc:
            pytest.fail(f"{self.name}: {exc}\n--- log tail ---\n{self.log_tail()}")
        return self

    def log_tail(self, num_lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM (graceful drain), SIGKILL after ``timeout_s``; returns the exit status."""
        if self.running:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self in _LIVE:
            _LIVE.remove(self)
        return self.process.returncode

    def kill(self) -> None:
        if self.running:
            self.process.kill()
            self.process.wait(5)
        if self in _LIVE:
            _LIVE.remove(self)


class ProcessGroup:
    """Services started by one test (or module); all stopped by ``stop_all``."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.processes: list[ServiceProcess] = []

    def start(self, service: str, *flags: str, port: int | None = None, wait: bool = True,
              env: dict | None = None, name: str | None = None, timeout_s: float = 30.0) -> ServiceProcess:
        port = port or free_port()
        name = name or f"{service}-{port}"
        argv = ["--host", "127.0.0.1", "--port", str(port), *flags]
        proc = ServiceProcess(service, argv, port, self.log_dir / f"{name}.log", env=env, name=name)
        self.processes.append(proc)
        if wait:
            proc.wait_healthy(timeout_s)
        return proc

    def stop_all(self) -> None:
        errors = []
        for proc in reversed(self.processes):
            try:
                proc.stop()
            except Exception as exc:  # keep stopping the others
                errors.append(exc)
        self.processes.clear()
        if errors:
            raise errors[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _LIVE:
        text = "\n\n".join(f"=== {p.name} ({p.log_path}) ===\n{p.log_tail()}" for p in list(_LIVE))
        report.sections.append(("weft service logs", text))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from weft.testing.tiny_model import make_tiny_checkpoint

    return Path(make_tiny_checkpoint(tmp_path_factory.mktemp("models") / "tiny", preset="tiny"))


@pytest.fixture
def nats_server(tmp_path) -> Iterator[NatsServer]:
    server = NatsServer(log_path=tmp_path / "nats.log").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def processes(tmp_path) -> Iterator[ProcessGroup]:
    group = ProcessGroup(tmp_path)
    try:
        yield group
    finally:
        group.stop_all()


@pytest.fixture(scope="module")
def module_nats(tmp_path_factory) -> Iterator[NatsServer]:
    server = NatsServer(log_path=tmp_path_factory.mktemp("nats") / "nats.log").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def module_processes(tmp_path_factory) -> Iterator[ProcessGroup]:
    group = ProcessGroup(tmp_path_factory.mktemp("services"))
    try:
        yield group
    finally:
        group.stop_all()
