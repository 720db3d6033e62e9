"""``weft up``: run the whole mesh as local processes on loopback.

NOTE: one table (``weft/launcher/mesh_spec.py``) says what runs; this module only renders it
with free loopback ports and manages processes:

    check: the model dir exists, the fixed ports are free (else one line, exit 1, nothing started)
    nats ──▶ cachestore, scheduler, executor-0..N-1 (+ --extra-executor ones), router   (started together)
         ──▶ wait: every instance healthy AND the scheduler lists every executor
             AND the router's /health/ready says an executor serves
         ──▶ state file + control endpoint ──▶ supervise until Ctrl-C / SIGTERM
    stop: router first (no new work), then executors / scheduler / cachestore, NATS last;
          SIGTERM (each service drains), SIGKILL after ``stop_timeout_s``.

Children get their own session (a terminal's Ctrl-C reaches only the launcher, which
stops them in order) and PR_SET_PDEATHSIG, so even a SIGKILLed launcher leaves no
orphans. Once up, every instance is supervised: an unplanned death is answered by a
restart under the same name and ports after a backoff, and a crash loop stops restarting
that instance only (policy: ``weft/launcher/restart_policy.py``; the rest of the mesh never stops).
NATS runs with one login per role (<state dir>/nats.conf, passwords per run, each service
given only its own: services/mesh/nats_auth.py). ``weft scale`` and ``weft chaos`` reach
``scale()`` / ``chaos()`` through a token-protected loopback HTTP control endpoint recorded
in the state file (``weft/launcher/control.py``, handed this object; see
docs/architecture.md, "Launcher").

Public to its helpers (``weft/launcher/supervision.py``, ``weft/launcher/chaos.py``), which
import none of this module: the process table ``running``, ``chaos_down``, ``state()``, and
``spawn`` / ``wait_healthy`` / ``wait_scheduler_sees``.
"""
from __future__ import annotations

import asyncio
import ctypes
import os
import secrets
import shlex
import signal
import sys
import time
from pathlib import Path

import grpc
import structlog

from services.mesh import mesh_auth, nats_auth
from services.mesh.mesh_auth import mesh_channel
from services.mesh.nats_server import free_port, nats_server_binary
from weft.health import probe
from weft.launcher.chaos import apply_chaos
from weft.launcher.control import start_control_server
from weft.launcher.mesh_spec import BY_NAME, SERVICES, Context, ServiceSpec
from weft.launcher.mesh_state import Instance, MeshState, remove_state, write_state
from weft.launcher.options import UpOptions
from weft.launcher.running import Running
from weft.launcher.setting_flags import non_default, service_env
from weft.launcher.startup_checks import check_model_dir, check_ports_free, last_log_line
from weft.launcher.supervision import Supervision

__all__ = ["Launcher", "MeshStartError", "UpOptions", "ensure_tiny_model"]  # UpOptions: weft/launcher/options.py

log = structlog.get_logger(__name__)

_LIBC = ctypes.CDLL(None, use_errno=True)
NATS_SECRET_ENV = "WEFT_NATS_SECRET"  # derives the per-role NATS passwords (services/mesh/nats_auth.py)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec: nothing else
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class MeshStartError(RuntimeError):
    """The mesh could not start. ``str()`` is one line naming the cause; ``log_path`` (when a
    service's log explains more) is where to look."""

    def __init__(self, cause: str, log_path: str | Path | None = None) -> None:
        super().__init__(cause)
        self.log_path = str(log_path) if log_path else None


def ensure_tiny_model(state_dir: Path) -> Path:
    """The tiny checkpoint under ``state_dir/models/tiny``, created on first use."""
    path = state_dir / "models" / "tiny"
    if not (path / "config.json").is_file() or not (path / "tokenizer.json").is_file():
        from weft.testing.tiny_model import make_tiny_checkpoint  # torch: only when writing it

        make_tiny_checkpoint(path, preset="tiny")
    return path


def _table_order(inst: Instance) -> tuple[int, int]:
    index = [s.name for s in SERVICES].index(inst.service)
    return index, int(inst.name.rsplit("-", 1)[1]) if inst.name != inst.service else 0


class Launcher:
    def __init__(self, options: UpOptions) -> None:
        self.options = options
        self.state_dir = Path(options.state_dir).resolve()
        self.logs_dir = self.state_dir / "logs"
        self.model_dir = ""
        self.ports: dict[str, int] = {}
        self.running: dict[str, Running] = {}  # instance name -> process
        self.service_env = service_env(options.settings)  # service -> its WEFT_* settings from `weft up` flags
        self.extra_argv: dict[str, list[str]] = {}  # executor name -> its own flags (--extra-executor)
        self.control_port = 0
        self.control_token = secrets.token_hex(16)
        self._scale_lock = asyncio.Lock()
        self.chaos_down: set[str] = set()  # instances `weft chaos` killed on purpose (weft/launcher/chaos.py)
        self.supervision = Supervision(self, options.restart)  # restarts unplanned deaths once up
        # NATS logins, one per role, fixed for the launcher's life so a restarted service (or
        # NATS itself) keeps them: derived from WEFT_NATS_SECRET when set, else random.
        nats_secret = self._env(NATS_SECRET_ENV)
        self.nats_passwords = (nats_auth.derive_passwords(nats_secret) if nats_secret
                               else nats_auth.random_passwords())
        self.nats_config = self.state_dir / "nats.conf"
        self.stopped = False

    # -- table rendering ------------------------------------------------------------
    def _context(self, ports: dict[str, int], executor_name: str = "") -> Context:
        host = self.options.host
        return Context(bind_host=host, model_dir=self.model_dir, ports=ports,
                       hosts={s.name: host for s in SERVICES}, keys_file=self.options.keys_file,
                       settings_file=self.options.settings_file,
                       log_level=self.options.log_level, executor_name=executor_name,
                       cachestore_dir=str(self.state_dir / "cachestore"),
                       # Passed through (the table renders it for every service): from the
                       # options' extra environment, else this process's.
                       mesh_secret=self._env("WEFT_MESH_SECRET"),
                       nats_config=str(self.nats_config), nats_passwords=self.nats_passwords)

    def _env(self, key: str) -> str:
        """A mesh-wide setting: from the options' extra environment, else this process's."""
        return self.options.extra_env.get(key, os.environ.get(key, ""))

    def _write_nats_config(self) -> None:
        """nats-server's users file (no secret in it: passwords are $VAR references), with
        a TLS block when the mesh has a certificate (the same WEFT_MESH_TLS_* files)."""
        security = mesh_auth.MeshSecurity.from_environ({**os.environ, **self.options.extra_env})
        self.nats_config.write_text(nats_auth.render_config(tls=nats_auth.TlsFiles.from_mesh(security)))
        self.nats_config.chmod(0o600)

    def _instance_ports(self, spec: ServiceSpec) -> dict[str, int]:
        if spec.scalable:  # every replica listens on its own ports
            return {k: free_port(self.options.host) for k in spec.ports}
        return {k: self.ports[k] for k in spec.ports}

    # -- processes ------------------------------------------------------------------
    async def spawn(self, spec: ServiceSpec, name: str, ports: dict[str, int] | None = None) -> Running:
        """Start one instance (``ports``: its own ports, else fresh / the mesh's) and watch its exit."""
        own_ports = dict(ports) if ports else self._instance_ports(spec)
        ctx = self._context({**self.ports, **own_ports}, executor_name=name if spec.scalable else "").mapping()
        argv = [a.format_map(ctx) for a in spec.command] + self.extra_argv.get(name, [])
        argv = [sys.executable, *argv] if spec.python else [str(nats_server_binary()), *argv[1:]]
        env = self.instance_env(spec, ctx)
        log_path = self.logs_dir / f"{name}.log"
        with open(log_path, "ab") as out:
            process = await asyncio.create_subprocess_exec(
                *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent)
        health_port = own_ports[spec.health.port_key]
        inst = Instance(name=name, service=spec.name, role=spec.role, pid=process.pid, ports=own_ports,
                        health_kind=spec.health.kind, health_port=health_port, health_path=spec.health.path,
                        log_path=str(log_path))
        running = Running(inst, process)
        self.running[name] = running
        self.supervision.watch(name, running)
        log.info("service_started", instance=name, pid=process.pid, ports=own_ports)
        return running

    def instance_env(self, spec: ServiceSpec, ctx: dict[str, str]) -> dict[str, str]:
        """The environment one instance of ``spec`` starts with: its settings (``_settings_env``)
        and the table's rendered values (ports, addresses), which win."""
        return {**self._settings_env(spec), **spec.render(ctx), "WEFT_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1"}

    def _settings_env(self, spec: ServiceSpec) -> dict[str, str]:
        """This process's environment, the options' extra variables, then the ``weft up``
        settings this service reads (weft/launcher/setting_flags.py), which win over both."""
        return {**os.environ, **self.options.extra_env, **self.service_env.get(spec.name, {})}

    def effective_settings(self) -> dict[str, dict[str, str]]:
        """service -> {flag: value}: the settings its instances run with that are not the
        default (what ``weft ps`` shows), read from the environment ``spawn`` gives them."""
        changed = {spec.name: non_default(spec.name, self._settings_env(spec)) for spec in SERVICES}
        return {name: flags for name, flags in changed.items() if flags}

    async def wait_healthy(self, names: list[str], deadline: float) -> None:
        """Until every instance in ``names`` passes its health probe; MeshStartError naming the
        first that exited or was still unhealthy at ``deadline`` (a monotonic time)."""
        pending = set(names)
        while pending:
            for name in sorted(pending):
                r = self.running[name]
                if r.process.returncode is not None:
                    raise MeshStartError(f"{name} exited with status {r.process.returncode} during startup: "
                                         f"{last_log_line(r.instance.log_path)}", r.instance.log_path)
                inst = r.instance
                if await probe(inst.health_kind, self.options.host, inst.health_port, inst.health_path, 1.0):
                    pending.discard(name)
                    log.info("service_healthy", instance=name)
            if pending and time.monotonic() > deadline:
                name = sorted(pending)[0]
                inst = self.running[name].instance
                raise MeshStartError(f"{name} did not become healthy within {self.options.startup_timeout_s:.0f}s: "
                                     f"{last_log_line(inst.log_path)}", inst.log_path)
            if pending:
                await asyncio.sleep(0.05)  # polling interval of the health probes

    async def wait_scheduler_sees(self, executor_names: set[str], deadline: float) -> None:
        """Until the scheduler's executor list (built from NATS heartbeats) holds exactly
        the serving executors, so a request right after `up`/`scale` can be placed."""
        from weft.v1 import scheduler_pb2, scheduler_pb2_grpc

        address = f"{self.options.host}:{self.ports['scheduler_port']}"
        async with mesh_channel(address) as channel:  # the mesh secret, when set
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            while True:
                try:
                    reply = await stub.ListExecutors(scheduler_pb2.ListExecutorsRequest(), timeout=1.0)
                    known = {e.heartbeat.name for e in reply.executors}
                    if executor_names <= known:
                        return
                except grpc.aio.AioRpcError:
                    pass
                if time.monotonic() > deadline:
                    raise MeshStartError(f"the scheduler did not learn of executors {sorted(executor_names)} "
                                         "within the deadline", self.logs_dir / "scheduler.log")
                await asyncio.sleep(0.05)

    async def _wait_router_ready(self, deadline: float) -> None:
        """Until the router's ``GET /health/ready`` answers 200 (an executor serves the model).
        A router without that route (404) is waited on no further: the scheduler already
        lists every executor (``wait_scheduler_sees``)."""
        import aiohttp

        url = f"http://{self.options.host}:{self.ports['router_http_port']}/health/ready"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
            while True:
                try:
                    async with session.get(url) as resp:
                        if resp.status in (200, 404):
                            return
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise MeshStartError(f"the router did not report ready ({url}) within "
                                         f"{self.options.startup_timeout_s:.0f}s", self.logs_dir / "router.log")
                await asyncio.sleep(0.05)  # polling interval of the readiness probe

    async def _terminate(self, names: list[str]) -> None:
        """SIGTERM (drain), then SIGKILL after ``stop_timeout_s``; waits for every exit.
        Planned: the supervisor does not restart them."""
        self.supervision.planned_stop(names)
        procs = [(n, self.running[n].process) for n in names if n in self.running]
        for name, proc in procs:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in procs:
            try:
                await asyncio.wait_for(proc.wait(), self.options.stop_timeout_s)
            except asyncio.TimeoutError:
                log.warning("service_killed", instance=name)
                proc.kill()
                await proc.wait()
            self.running.pop(name, None)
            self.supervision.forget(name)
            log.info("service_stopped", instance=name, status=proc.returncode)

    # -- lifecycle ------------------------------------------------------------------
    def executor_names(self) -> list[str]:
        return sorted((n for n, r in self.running.items() if r.instance.service == "executor"),
                      key=lambda n: int(n.rsplit("-", 1)[1]))

    async def start(self) -> MeshState:
        opts = self.options
        # Checked before anything starts, so a failure is one clear line and nothing to undo.
        fixed = {"router_http_port": opts.http_port, "router_grpc_port": opts.grpc_port}
        for problem in (check_model_dir(opts.model_dir),
                        check_ports_free(opts.host, {"--http-port": opts.http_port, "--grpc-port": opts.grpc_port})):
            if problem:
                raise MeshStartError(problem)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self._write_nats_config()
        self.model_dir = str(Path(opts.model_dir).resolve()) if opts.model_dir else str(ensure_tiny_model(self.state_dir))
        for spec in SERVICES:
            if not spec.scalable:
                for key in spec.ports:
                    self.ports[key] = fixed.get(key) or free_port(opts.host)
        deadline = time.monotonic() + opts.startup_timeout_s
        try:
            await self.spawn(BY_NAME["nats"], "nats")
            await self.wait_healthy(["nats"], deadline)
            executors = [f"executor-{i}" for i in range(opts.num_executors + len(opts.extra_executors))]
            for name, flags in zip(executors[opts.num_executors:], opts.extra_executors):
                self.extra_argv[name] = shlex.split(flags)
            names = ["cachestore", "scheduler", *executors, "router"]
            for name in names:
                await self.spawn(BY_NAME[name.split("-")[0]], name)
            await self.wait_healthy(names, deadline)
            await self.wait_scheduler_sees(set(self.executor_names()), deadline)
            if self.executor_names():
                await self._wait_router_ready(deadline)
            await self._start_control()
        except BaseException:
            await self.stop()
            raise
        state = self.state()
        write_state(self.state_dir, state)
        self.supervision.mark_up()
        return state

    def state(self) -> MeshState:
        host = self.options.host
        return MeshState(
            launcher_pid=os.getpid(), control_port=self.control_port, control_token=self.control_token,
            model_dir=self.model_dir, http_url=f"http://{host}:{self.ports['router_http_port']}",
            grpc_address=f"{host}:{self.ports['router_grpc_port']}",
            nats_url=f"nats://{host}:{self.ports['nats_port']}",
            instances=sorted((self.supervision.view(r.instance) for r in self.running.values()), key=_table_order),
            settings=self.effective_settings(),
        )

    async def scale(self, service: str, replicas: int) -> list[str]:
        """Start or drain executors until ``replicas`` run; returns their names.
        New ones must be healthy and known to the scheduler before this returns;
        drained ones (highest index first) get SIGTERM and finish in-flight work."""
        if service != "executor":
            raise ValueError(f"only 'executor' scales, not {service!r}")
        if replicas < 0:
            raise ValueError("replicas must be >= 0")
        async with self._scale_lock:
            current = self.executor_names()
            if replicas > len(current):
                taken = {int(n.rsplit("-", 1)[1]) for n in current}
                free = (i for i in range(10**6) if i not in taken)
                new = [f"executor-{next(free)}" for _ in range(replicas - len(current))]
                for name in new:
                    await self.spawn(BY_NAME["executor"], name)
                deadline = time.monotonic() + self.options.startup_timeout_s
                try:
                    await self.wait_healthy(new, deadline)
                    await self.wait_scheduler_sees(set(new), deadline)
                except MeshStartError:
                    await self._terminate(new)
                    raise
            elif replicas < len(current):
                drained = current[replicas:][::-1]
                await self._terminate(drained)
                for name in drained:  # a later replica under this name is a plain executor
                    self.extra_argv.pop(name, None)
            write_state(self.state_dir, self.state())
            return self.executor_names()

    async def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.supervision.stop()  # no restart may start while the mesh stops
        await self._stop_control()
        await self._terminate([n for n in ("router",) if n in self.running])
        await self._terminate([n for n in self.running if n != "nats"])
        await self._terminate([n for n in self.running])
        remove_state(self.state_dir)

    async def run_until_signal(self, on_ready=None) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, self.reload_settings)
        try:
            state = await self.start()
            if on_ready is not None:
                on_ready(state)
            await stop.wait()  # deaths meanwhile are the supervisor's (weft/launcher/supervision.py)
        finally:
            await self.stop()

    def reload_settings(self) -> None:
        """SIGHUP: the router re-reads the keys and settings files and sends the new
        document to the other services (docs/live_config.md)."""
        for name, run in self.running.items():
            if run.instance.service == "router" and run.process.returncode is None:
                run.process.send_signal(signal.SIGHUP)
                log.info("settings_reload_forwarded", instance=name)

    async def chaos(self, action: str, name: str) -> dict:
        """``weft chaos ACTION NAME``: kill, pause, resume or restart one instance on purpose
        (``weft/launcher/chaos.py``)."""
        return await apply_chaos(self, action, name)

    # -- control endpoint (weft scale, weft chaos) -------------------------------------
    async def _start_control(self) -> None:
        self._control_runner, self.control_port = await start_control_server(self, self.options.host)

    async def _stop_control(self) -> None:
        runner = getattr(self, "_control_runner", None)
        if runner is not None:
            await runner.cleanup()
            self._control_runner = None
