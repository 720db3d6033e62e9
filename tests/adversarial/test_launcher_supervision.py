"""The unlucky operator (issue 12, section 2): under `weft up`, a plain `kill -9` of any
service (pid from the state file) used to stop the whole mesh, or leave an executor dead.
Now the launcher restarts the dead one under its name and ports, leaves every other
process alone, shows restarts and the last exit status in `weft ps`, and stops
restarting an instance that crash-loops while the rest keeps serving."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import grpc
import pytest

from tests.integration.conftest import wait_for
from tests.integration.launched_mesh import ROOT, launched_mesh
from weft.launcher.mesh_state import pid_alive, read_state
from weft.v1 import common_pb2, router_pb2, router_pb2_grpc

# Two deaths of one instance within 10 minutes are a crash loop: the second kill of
# executor-1 below shows the limit without waiting out a real backoff series.
ARGS = ("--crash-loop-deaths", "2", "--crash-loop-window", "600")
ENV = {"WEFT_EXECUTOR_NUM_THREADS": "1", "WEFT_EXECUTOR_HEARTBEAT_INTERVAL_S": "0.25"}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    state_dir = tmp_path_factory.mktemp("supervised-mesh")
    with launched_mesh(state_dir, tiny_model_dir, 2, ENV, extra_args=ARGS) as (process, _):
        yield state_dir, process


def _pids(state_dir) -> dict[str, int]:
    return {i.name: i.pid for i in read_state(state_dir).instances}


def _ps(state_dir) -> dict[str, list[str]]:
    out = subprocess.run([sys.executable, "-m", "weft", "ps", "--state-dir", str(state_dir)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    rows = [line.split() for line in out.stdout.splitlines()[1:] if line.strip()]
    return {r[0]: r for r in rows}  # NAME PID PORTS HEALTH RESTARTS LAST-EXIT ROLE...


def _serves(state_dir) -> bool:
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[20, 21, 22, 23]),
                                         sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0))
    with grpc.insecure_channel(read_state(state_dir).grpc_address) as channel:
        chunks = list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=20))
    return bool(chunks) and chunks[-1].finish_reason != 0


def test_the_launched_mesh_refuses_anonymous_nats_clients_and_its_services_log_in(mesh):
    """Issue 12, section 3, through `weft up`: NATS runs with the per-role users file and
    an anonymous client (the impostor of the issue) cannot connect, while every service
    logged in with its own role (the mesh serves, which needs heartbeats and kv events)."""
    import asyncio

    import nats
    from nats.errors import NoServersError

    state_dir, _ = mesh
    conf = state_dir / "nats.conf"
    assert "authorization" in conf.read_text() and (conf.stat().st_mode & 0o077) == 0
    url = read_state(state_dir).nats_url

    async def anonymous() -> BaseException | None:
        errors: list[BaseException] = []

        async def on_error(exc):
            errors.append(exc)

        try:
            nc = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5,
                                    error_cb=on_error)
        except (NoServersError, OSError, nats.errors.Error) as exc:
            return exc
        await nc.close()
        return None

    refused = asyncio.run(anonymous())
    assert refused is not None, "an anonymous client connected to the mesh's NATS"
    assert _serves(state_dir)


def _kill9_and_wait_restarted(state_dir, name: str) -> tuple[dict[str, int], dict[str, int]]:
    before = _pids(state_dir)
    ports_before = read_state(state_dir).instance(name).ports
    os.kill(before[name], signal.SIGKILL)
    wait_for(lambda: _pids(state_dir)[name] != before[name] and _ps(state_dir)[name][3] == "healthy", 90,
             f"{name} to be restarted and healthy")
    assert read_state(state_dir).instance(name).ports == ports_before, "restarted on other ports"
    return before, _pids(state_dir)


@pytest.mark.parametrize("name", ["cachestore", "scheduler", "nats", "executor-1"])
def test_kill9_of_a_service_restarts_it_and_leaves_the_rest_untouched(mesh, name):
    state_dir, launcher = mesh
    before, after = _kill9_and_wait_restarted(state_dir, name)
    assert launcher.poll() is None, "the launcher stopped the mesh"
    assert {n: p for n, p in after.items() if n != name} == {n: p for n, p in before.items() if n != name}
    assert all(pid_alive(p) for p in after.values())
    row = _ps(state_dir)[name]
    assert row[4] == "1" and row[5] == "-9", row  # RESTARTS, LAST-EXIT (killed by signal 9)
    wait_for(lambda: _serves(state_dir), 60, "the mesh to serve after the restart")


def test_a_crash_looping_instance_is_left_down_and_the_rest_keeps_serving(mesh):
    """executor-1 died once above; its second death within the window is a crash loop."""
    state_dir, launcher = mesh
    before = _pids(state_dir)
    os.kill(before["executor-1"], signal.SIGKILL)
    wait_for(lambda: _ps(state_dir)["executor-1"][3] == "crash-loop", 30, "weft ps to show the crash loop")
    log = (state_dir / "launcher.log").read_text(errors="replace")
    assert sum("service_crash_loop" in line and "executor-1" in line for line in log.splitlines()) == 1
    assert launcher.poll() is None
    assert not pid_alive(before["executor-1"]) and _pids(state_dir)["executor-1"] == before["executor-1"]
    others = {n: p for n, p in before.items() if n != "executor-1"}
    assert {n: p for n, p in _pids(state_dir).items() if n != "executor-1"} == others
    assert all(pid_alive(p) for p in others.values())
    assert _serves(state_dir)


def test_weft_chaos_kill_is_a_planned_outage_the_supervisor_leaves_alone(mesh):
    """`weft chaos kill` simulates a lasting outage: no restart until `weft chaos restart`,
    which also starts the instance's death history over."""
    state_dir, launcher = mesh

    def weft(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "weft", *args, "--state-dir", str(state_dir)],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)

    def num_deaths_logged() -> int:
        log = (state_dir / "launcher.log").read_text(errors="replace").splitlines()
        return sum('"service_died"' in line and '"instance": "cachestore"' in line for line in log)

    deaths_before = num_deaths_logged()  # the kill -9 above
    killed = _pids(state_dir)["cachestore"]
    assert weft("chaos", "kill", "cachestore").returncode == 0
    assert not pid_alive(killed)
    assert _ps(state_dir)["cachestore"][3] == "stopped"
    assert weft("chaos", "restart", "cachestore").returncode == 0  # returns once healthy
    assert num_deaths_logged() == deaths_before, "the supervisor treated a planned kill as a death"
    row = _ps(state_dir)["cachestore"]
    assert row[3] == "healthy" and row[4] == "1", row  # restarts: only the supervisor's after kill -9
    assert launcher.poll() is None
