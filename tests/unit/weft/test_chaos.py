"""`weft chaos` acts on the launcher through ``ChaosTarget`` (no launcher here: a fake one
holding a real, short-lived process). A kill marks the instance as down on purpose, so the
supervision does not restart it, and records that in the state file."""
from __future__ import annotations

import asyncio
import sys

import pytest

from weft.launcher.chaos import ACTIONS, apply_chaos
from weft.launcher.mesh_state import Instance, MeshState, read_state
from weft.launcher.options import UpOptions
from weft.launcher.running import Running


class _Target:
    def __init__(self, state_dir, running: Running) -> None:
        self.options = UpOptions(state_dir=state_dir)
        self.state_dir = state_dir
        self.running = {running.instance.name: running}
        self.chaos_down: set[str] = set()

    def state(self) -> MeshState:
        return MeshState(launcher_pid=1, control_port=0, control_token="", model_dir="", http_url="",
                         grpc_address="", nats_url="", instances=[r.instance for r in self.running.values()])


async def _sleeper(tmp_path) -> Running:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")
    inst = Instance(name="executor-0", service="executor", role="", pid=proc.pid, ports={}, health_kind="grpc",
                    health_port=1, health_path="", log_path=str(tmp_path / "executor-0.log"))
    return Running(inst, proc)


def test_kill_is_planned_and_recorded(tmp_path):
    async def main():
        running = await _sleeper(tmp_path)
        try:
            target = _Target(tmp_path, running)
            result = await apply_chaos(target, "kill", "executor-0")
            return result, target, running.process.returncode
        finally:
            if running.process.returncode is None:
                running.process.kill()
                await running.process.wait()

    result, target, returncode = asyncio.run(main())
    assert result == {"name": "executor-0", "action": "kill", "pid": result["pid"], "alive": False}
    assert returncode is not None and target.chaos_down == {"executor-0"}
    assert [i.name for i in read_state(tmp_path).instances] == ["executor-0"]


@pytest.mark.parametrize(("action", "name", "reason"), [
    ("explode", "executor-0", "unknown chaos action"), ("kill", "executor-9", "no instance named 'executor-9'"),
])
def test_a_bad_action_or_name_is_refused_and_nothing_is_touched(tmp_path, action, name, reason):
    async def main():
        running = await _sleeper(tmp_path)
        try:
            target = _Target(tmp_path, running)
            with pytest.raises(ValueError, match=reason):
                await apply_chaos(target, action, name)
            return target, running.process.returncode
        finally:
            running.process.kill()
            await running.process.wait()

    target, returncode = asyncio.run(main())
    assert returncode is None and target.chaos_down == set()


def test_the_cli_offers_exactly_the_actions_chaos_applies():
    from weft.cli.commands import build_parser

    chaos = build_parser()._subparsers._group_actions[0].choices["chaos"]
    choices = next(a.choices for a in chaos._actions if a.dest == "action")
    assert tuple(choices) == ACTIONS == ("kill", "pause", "resume", "restart")
