"""A whole mesh started the way a user starts it (`weft up` as a subprocess), for tests.

``launched_mesh`` waits until the launcher reports the mesh ready, yields the launcher
process and its state, and on exit resumes any paused service, stops the launcher with
SIGTERM (SIGKILL after a grace period) and, when asked, asserts no service outlived it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.integration.conftest import wait_for
from weft.launcher.mesh_state import MeshState, pid_alive, read_state

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def launched_mesh(
    state_dir: Path,
    model_dir: Path,
    num_executors: int,
    env: dict[str, str] | None = None,
    extra_args: Sequence[str] = (),
    timeout_s: float = 150.0,
    check_orphans: bool = True,
) -> Iterator[tuple[subprocess.Popen, MeshState]]:
    log_path = state_dir / "launcher.log"
    log = open(log_path, "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "weft", "up", "--model", str(model_dir), "--executors", str(num_executors),
         "--http-port", "0", "--grpc-port", "0", "--state-dir", str(state_dir), *extra_args],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=ROOT)
    state = None
    try:
        def ready():
            if process.poll() is not None:  # pytest.fail is not an Exception: wait_for stops at once
                pytest.fail(f"weft up exited with status {process.returncode}: {log_path.read_text()[-3000:]}")
            return read_state(state_dir)

        state = wait_for(ready, timeout_s, "weft up to report the mesh ready", interval_s=0.2)
        yield process, state
    finally:
        latest = read_state(state_dir)
        for inst in latest.instances if latest else ():
            if pid_alive(inst.pid):
                os.kill(inst.pid, signal.SIGCONT)  # a paused service must be able to drain
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        if check_orphans and state is not None:
            leftover = [i.name for i in state.instances if pid_alive(i.pid)]
            assert not leftover, f"orphaned services after weft up stopped: {leftover}"
