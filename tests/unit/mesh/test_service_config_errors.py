"""A configuration that cannot work (unloadable model files, a refused NATS login) ends a
service with EXIT_CONFIG (78) and one line; `weft up` leaves such an instance down as
`config-error` instead of restarting it into the same failure. A NATS *outage* is not a
configuration error: the bus rides it out."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from services.mesh.nats_bus import EventBus
from services.mesh.nats_server import free_port
from services.mesh.service_main import EXIT_CONFIG
from weft.launcher.supervision import Supervision
from weft.launcher.mesh_state import Instance, MeshState
from weft.launcher.restart_policy import RestartConfig, Status


def test_an_unreachable_nats_is_an_outage_not_a_refused_login():
    async def main() -> bool:
        bus = EventBus(f"nats://127.0.0.1:{free_port()}", "svc")
        await bus.start()
        try:
            await bus.require_login(timeout_s=10.0)  # returns: nothing refused anything
            return bus.login_refused
        finally:
            await bus.close()

    assert asyncio.run(main()) is False


@dataclass
class _Process:
    status: int
    pid: int = 4242

    async def wait(self) -> int:
        return self.status


@dataclass
class _Running:
    instance: Instance
    process: _Process


class _Launcher:
    """What Supervision reads of the launcher; records any respawn."""

    def __init__(self, state_dir) -> None:
        self.state_dir = state_dir
        self.stopped = False
        self.running: dict[str, _Running] = {}
        self.chaos_down: set[str] = set()
        self.spawned: list[str] = []

    def state(self) -> MeshState:
        return MeshState(launcher_pid=1, control_port=0, control_token="", model_dir="", http_url="",
                         grpc_address="", nats_url="", instances=[r.instance for r in self.running.values()])

    async def spawn(self, spec, name, ports=None):
        self.spawned.append(name)
        raise AssertionError("a config error must not be restarted")


def _instance(name: str) -> Instance:
    return Instance(name=name, service="executor", role="", pid=4242, ports={"executor_port": 1},
                    health_kind="grpc", health_port=1, health_path="", log_path="/nonexistent.log")


def _supervise(tmp_path, status: int) -> tuple[Supervision, _Launcher]:
    async def main():
        launcher = _Launcher(tmp_path)
        supervision = Supervision(launcher, RestartConfig(base_delay_s=0.0, max_delay_s=0.0, jitter=0.0))
        running = _Running(_instance("executor-0"), _Process(status))
        launcher.running["executor-0"] = running
        supervision.mark_up()
        supervision.watch("executor-0", running)
        await asyncio.gather(*list(supervision._tasks), return_exceptions=True)
        return supervision, launcher

    return asyncio.run(main())


def test_an_instance_that_exits_78_is_left_down_as_config_error(tmp_path):
    supervision, launcher = _supervise(tmp_path, EXIT_CONFIG)
    view = supervision.view(_instance("executor-0"))
    assert view.status == Status.CONFIG_ERROR.value and view.last_exit == EXIT_CONFIG and view.restarts == 0
    assert launcher.spawned == []
