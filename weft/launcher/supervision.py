"""The launcher's supervision mechanism: watch every process ``weft up`` spawns and answer
an unplanned death with the restart policy's decision (``weft/launcher/restart_policy.py``).

    process exits ──▶ planned? (scale down, weft chaos kill, shutdown, replaced)  ──▶ nothing
                  ──▶ exit 78 (EXIT_CONFIG: bad model files, NATS login refused)  ──▶ left down
                  ──▶ policy.on_death: restart after a backoff ──▶ same name, same ports
                                                                    ──▶ healthy: running
                                       crash loop ──▶ one error line; left down; the rest runs

Deaths before the mesh is up are start-up failures (``Launcher.start`` raises); watching
starts to act once ``mark_up`` is called. Every change of an instance's supervision
(restarts, last exit status, status) is written to the state file for ``weft ps``.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import structlog

from services.mesh.service_main import EXIT_CONFIG
from weft.health import probe
from weft.launcher.mesh_spec import BY_NAME, ServiceSpec
from weft.launcher.mesh_state import Instance, MeshState, write_state
from weft.launcher.options import UpOptions
from weft.launcher.restart_policy import RestartConfig, RestartPolicy, Status
from weft.launcher.running import Running
from weft.launcher.startup_checks import last_log_line, ports_free

log = structlog.get_logger(__name__)


class SupervisedMesh(Protocol):
    """What the supervision reads of the launcher, and the one thing it asks of it: to
    ``spawn`` an instance again. The launcher owns the process table; this never edits it."""

    options: UpOptions
    state_dir: Path
    stopped: bool  # the mesh is stopping: no restart may start
    running: dict[str, Running]  # instance name -> the process behind it now
    chaos_down: set[str]  # killed on purpose by `weft chaos`: not deaths

    def state(self) -> MeshState: ...

    async def spawn(self, spec: ServiceSpec, name: str, ports: dict[str, int] | None = None) -> Running: ...


@dataclass
class _Record:
    """An instance name's supervision; it outlives the processes behind the name."""

    policy: RestartPolicy
    restarts: int = 0
    last_exit: int | None = None
    status: Status = Status.RUNNING


class Supervision:
    """Owns the death history of every instance name and the tasks that watch and restart;
    reads the launcher's process table and starts processes through ``SupervisedMesh.spawn``."""

    def __init__(self, launcher: SupervisedMesh, config: RestartConfig) -> None:
        self.launcher = launcher
        self.config = config
        self._records: dict[str, _Record] = {}
        self._planned: set[str] = set()  # being stopped on purpose (scale down, shutdown)
        self._up = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    # -- what the launcher tells it ------------------------------------------------------
    def watch(self, name: str, running: Running) -> None:
        """``running`` was just spawned under ``name``: answer its exit."""
        self._records.setdefault(name, _Record(RestartPolicy(self.config)))
        task = asyncio.create_task(self._watch_exit(name, running))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def mark_up(self) -> None:
        self._up.set()

    def planned_stop(self, names: list[str]) -> None:
        """``names`` are being stopped on purpose: their exits are not deaths."""
        self._planned.update(names)

    def forget(self, name: str) -> None:
        """``name`` was stopped for good (scale down): a later replica starts a new history."""
        self._records.pop(name, None)
        self._planned.discard(name)

    def reset(self, name: str) -> None:
        """An operator restarted ``name`` on purpose (weft chaos restart): its history starts over."""
        record = self._records.get(name)
        if record is not None:
            record.policy.reset()
            record.status = Status.RUNNING

    def stop(self) -> None:
        """The mesh stops: no restart may start any more."""
        for task in self._tasks:
            task.cancel()

    def view(self, inst: Instance) -> Instance:
        """``inst`` with its supervision fields, as the state file records it."""
        record = self._records.get(inst.name)
        if record is None:
            return inst
        status = Status.STOPPED if inst.name in self.launcher.chaos_down else record.status
        return replace(inst, restarts=record.restarts, last_exit=record.last_exit, status=status.value)

    # -- the mechanism ------------------------------------------------------------------
    def _unplanned(self, name: str, running: Running) -> bool:
        """Whether ``running``'s exit is a death to answer: still the process behind the
        name, and not being stopped, scaled down or killed by `weft chaos`."""
        launcher = self.launcher
        return (self._up.is_set() and not launcher.stopped and launcher.running.get(name) is running
                and name not in self._planned and name not in launcher.chaos_down)

    def _write_state(self) -> None:
        if self._up.is_set() and not self.launcher.stopped:
            write_state(self.launcher.state_dir, self.launcher.state())

    async def _watch_exit(self, name: str, running: Running) -> None:
        status = await running.process.wait()
        await self._up.wait()  # a death during start-up fails the start instead
        if not self._unplanned(name, running):
            return
        record = self._records[name]
        record.last_exit = status
        last_line = last_log_line(running.instance.log_path)
        if status == EXIT_CONFIG:  # its model or NATS login cannot work: every restart would fail alike
            record.status = Status.CONFIG_ERROR
            log.error("service_config_error", instance=name, status=status, last_log_line=last_line,
                      action="not restarted; fix the configuration, then weft chaos restart " + name,
                      log_path=running.instance.log_path)
            self._write_state()
            return
        decision = record.policy.on_death(time.monotonic())
        if not decision.restart:
            record.status = Status.CRASH_LOOP
            log.error("service_crash_loop", instance=name, status=status, num_deaths=decision.num_recent_deaths,
                      window_s=self.config.window_s, action="not restarted; the rest of the mesh keeps running",
                      log_path=running.instance.log_path, last_log_line=last_line)
            self._write_state()
            return
        record.status = Status.RESTARTING
        log.warning("service_died", instance=name, pid=running.process.pid, status=status,
                    restart_in_s=round(decision.delay_s, 3), num_recent_deaths=decision.num_recent_deaths,
                    last_log_line=last_line)
        self._write_state()
        await asyncio.sleep(decision.delay_s)
        if self._unplanned(name, running):
            await self._restart(name, running, record)

    async def _restart(self, name: str, dead: Running, record: _Record) -> None:
        """Start ``name`` again on its ports (an executor on fresh ones only if its own were
        taken meanwhile) and mark it running once healthy; its next exit is watched anew."""
        launcher = self.launcher
        t0 = time.monotonic()
        spec = BY_NAME[dead.instance.service]
        ports = dead.instance.ports
        if spec.scalable and not ports_free(launcher.options.host, ports.values()):
            ports = None
        new = await launcher.spawn(spec, name, ports)
        record.restarts += 1
        self._write_state()
        inst = new.instance
        deadline = t0 + launcher.options.startup_timeout_s
        while launcher.running.get(name) is new and new.process.returncode is None and time.monotonic() < deadline:
            if await probe(inst.health_kind, launcher.options.host, inst.health_port, inst.health_path, 1.0):
                record.status = Status.RUNNING
                log.info("service_restarted", instance=name, pid=new.process.pid, restarts=record.restarts,
                         recovery_s=round(time.monotonic() - t0, 3))
                self._write_state()
                return
            await asyncio.sleep(0.05)  # polling interval of the health probe
