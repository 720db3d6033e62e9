"""``weft chaos kill|pause|resume|restart NAME``: disturb one service of a running mesh.

NAME is an instance as ``weft ps`` lists it (``router``, ``scheduler``, ``executor-1``,
``cachestore``, ``nats``). Every action goes through the launcher's loopback control
endpoint (``POST /chaos``), because the launcher owns the processes: it must know that a
kill is deliberate (else its supervisor restarts the service at once, as it does after any
unplanned death), and only it can respawn a service on the same ports with the same settings.

    kill     SIGKILL, a planned outage: the supervisor does NOT restart it; it stays down
             (``weft ps``: stopped) until ``weft chaos restart``. To test the supervisor,
             ``kill -9`` the pid from ``weft ps`` instead: that death is restarted.
    pause    SIGSTOP: the process hangs with its sockets open (a stalled peer)
    resume   SIGCONT
    restart  SIGKILL if alive, then start it again (singletons on the same ports, an
             executor on fresh ones, announced over NATS); returns when it is healthy
             (and, for an executor, known to the scheduler) with the seconds it took

``apply_chaos`` is handed a ``ChaosTarget`` (the launcher) and imports none of it; the
command line is ``weft/cli/chaos_cli.py``, its client ``request_chaos`` in
``weft/launcher/control.py``.
"""
from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from weft.launcher.mesh_spec import BY_NAME, ServiceSpec
from weft.launcher.mesh_state import MeshState, read_state, write_state
from weft.launcher.options import UpOptions
from weft.launcher.running import Running

if TYPE_CHECKING:  # `weft chaos --help` lists ACTIONS: this module stays light to import
    from weft.launcher.supervision import Supervision

ACTIONS = ("kill", "pause", "resume", "restart")


class ChaosTarget(Protocol):
    """What ``weft chaos`` needs of the launcher: its process table and how to start an
    instance again. ``apply_chaos`` mutates ``running`` (through ``spawn``) and ``chaos_down``."""

    options: UpOptions
    state_dir: Path
    running: dict[str, Running]  # instance name -> process
    chaos_down: set[str]  # killed on purpose: the supervision must not restart them
    supervision: Supervision

    def state(self) -> MeshState: ...

    async def spawn(self, spec: ServiceSpec, name: str, ports: dict[str, int] | None = None) -> Running: ...

    async def wait_healthy(self, names: list[str], deadline: float) -> None: ...

    async def wait_scheduler_sees(self, executor_names: set[str], deadline: float) -> None: ...


async def apply_chaos(launcher: ChaosTarget, action: str, name: str) -> dict:
    """Do ``action`` to instance ``name``; mutates the launcher's process table."""
    if action not in ACTIONS:
        raise ValueError(f"unknown chaos action {action!r}; one of {', '.join(ACTIONS)}")
    running = launcher.running.get(name)
    if running is None:
        raise ValueError(f"no instance named {name!r}; known: {', '.join(sorted(launcher.running))}")
    proc = running.process
    alive = proc.returncode is None
    if action == "pause" and alive:
        proc.send_signal(signal.SIGSTOP)
    elif action == "resume" and alive:
        proc.send_signal(signal.SIGCONT)
    elif action in ("kill", "restart"):
        launcher.chaos_down.add(name)  # deliberate: the supervisor must not restart it
        if alive:
            proc.kill()
            await proc.wait()
        write_state(launcher.state_dir, launcher.state())  # weft ps: stopped
    if action != "restart":
        return {"name": name, "action": action, "pid": proc.pid, "alive": proc.returncode is None}
    t0 = time.monotonic()
    spec = BY_NAME[running.instance.service]
    new = await launcher.spawn(spec, name)
    deadline = t0 + launcher.options.startup_timeout_s
    await launcher.wait_healthy([name], deadline)
    if spec.name == "executor":
        await launcher.wait_scheduler_sees({name}, deadline)
    launcher.chaos_down.discard(name)
    launcher.supervision.reset(name)  # restarted on purpose: a past crash loop is forgiven
    write_state(launcher.state_dir, launcher.state())
    return {"name": name, "action": action, "pid": new.process.pid, "alive": True,
            "recovery_s": round(time.monotonic() - t0, 3)}


def wait_recovered(state_dir: str | Path, name: str, old_pid: int, timeout_s: float = 60.0,
                   interval_s: float = 0.05) -> float:
    """Block until the state file lists ``name`` under a pid other than ``old_pid`` and its
    health probe passes; returns the seconds that took. For measuring the supervisor's
    recovery after a plain ``kill -9`` (tests/chaos, benchmarks/chaos_recovery.py); raises
    TimeoutError after ``timeout_s``. Run it in a thread when an event loop is busy."""
    from weft.health import probe  # grpc, aiohttp: not needed to list ACTIONS

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        state = read_state(state_dir)
        inst = next((i for i in state.instances if i.name == name), None) if state else None
        if inst is not None and inst.pid != old_pid and asyncio.run(
                probe(inst.health_kind, "127.0.0.1", inst.health_port, inst.health_path, 1.0)):
            return time.monotonic() - t0
        time.sleep(interval_s)  # polling interval of the state file and the probe
    raise TimeoutError(f"{name} (pid {old_pid} killed) was not back and healthy within {timeout_s:.0f}s")
