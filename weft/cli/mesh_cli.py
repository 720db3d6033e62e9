"""``weft up`` / ``weft ps`` / ``weft scale``: registration functions for ``weft/cli/commands.py``.

``weft up`` runs the launcher in this process; which model it serves is decided here, not
in the launcher (policy apart from mechanism): ``--model`` may be a checkpoint directory,
a ``.gguf`` file or a named model, resolved by ``weft/models/sources.py`` (pulled or
imported into the cache on first use) AFTER the cheap checks, so a taken port fails in one
line without a download; without ``--model`` it serves ``DEFAULT_MODEL`` (SmolLM2). The
launcher itself only ever sees a directory (or None: its tiny random model, for tests and
benchmarks). ``ps`` reads the state file and probes;
``scale`` asks the running launcher over its control endpoint. The launcher, grpc and
aiohttp are imported inside the handlers, so registering these commands costs nothing.
"""
from __future__ import annotations

import argparse
import os
import asyncio
import dataclasses
import sys
from pathlib import Path

from weft.cli.model_cli import add_cache_dir_arg
from weft.cli.state_dir import add_state_dir_arg, running_mesh
from weft.cli.up_flags import add_setting_flags, settings_from_args, settings_lines
from weft.launcher.mesh_state import pid_alive, read_state
from weft.models.sources import DEFAULT_MODEL, SOURCES


def register_up(subparsers) -> None:
    up = subparsers.add_parser(
        "up", help="start NATS and every service locally and wait until they are healthy",
        description="Start nats-server, cachestore, scheduler, N executors and the router as local "
                    "processes on loopback; wait until all are healthy; print the endpoints; stop "
                    "everything on Ctrl-C / SIGTERM. The `settings:` sections set the services' policies, KV pool, "
                    "quotas and limits (each flag goes to the services that read it as the WEFT_* variable shown; "
                    "a flag not given keeps the service's default or that variable from the environment; "
                    "docs/configuration.md); a bad value fails before anything starts.")
    up.add_argument("--model", default=DEFAULT_MODEL, metavar="DIR|FILE.gguf|NAME",
                    help="a checkpoint directory, a .gguf file (imported into the cache once) or a named "
                         f"model ({', '.join(SOURCES)}; pulled into the cache once, see `weft model list`); "
                         "default: %(default)s")
    add_cache_dir_arg(up)
    up.add_argument("--executors", type=int, default=1, metavar="N", help="executor processes; default: %(default)s")
    up.add_argument("--extra-executor", action="append", default=[], metavar="FLAGS", dest="extra_executors",
                    help="one more executor started with these executor flags, e.g. "
                         "--extra-executor='--serves-rung kv_int8 --kv-cache-dtype int8' (a degraded-rung pool); "
                         "repeatable")
    up.add_argument("--http-port", type=int, default=8000, help="OpenAI HTTP API port (0: free); default: %(default)s")
    up.add_argument("--grpc-port", type=int, default=50051, help="public gRPC port (0: free); default: %(default)s")
    up.add_argument("--keys-file", default="",
                    help="API keys file for the router: JSON {key: tenant} / {key: {tenant, role}} or 'key tenant "
                         "[role]' lines; role admin may use the admin API (docs/live_config.md); re-read on SIGHUP; "
                         "default: no auth")
    up.add_argument("--settings", default=os.environ.get("WEFT_SETTINGS_FILE", ""), metavar="FILE",
                    dest="settings_file",
                    help="live-settings document (JSON: policies, quotas, partitions, thresholds that may change "
                         "while the mesh runs; docs/live_config.md); re-read on SIGHUP to `weft up` or the router, "
                         "changed by PATCH /v1/weft/admin/settings; default: $WEFT_SETTINGS_FILE, else none")
    up.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                    help="services' log level; default: %(default)s")
    up.add_argument("--startup-timeout", type=float, default=180.0, metavar="S",
                    help="seconds every service gets to become healthy; default: %(default)s")
    up.add_argument("--crash-loop-deaths", type=int, default=5, metavar="N",
                    help="a service that dies N times within --crash-loop-window is no longer restarted "
                         "(the rest keeps running); default: %(default)s")
    up.add_argument("--crash-loop-window", type=float, default=60.0, metavar="S",
                    help="seconds of the crash-loop window; default: %(default)s")
    add_state_dir_arg(up)
    add_setting_flags(up)
    up.set_defaults(handler=_up)


def _up(args: argparse.Namespace) -> int:
    from services.mesh.logging import configure_logging
    from weft.launcher.launcher import Launcher, MeshStartError, UpOptions
    from weft.launcher.restart_policy import RestartConfig
    from weft.launcher.startup_checks import check_ports_free

    configure_logging("launcher", "warning")
    previous = read_state(args.state_dir)
    if previous is not None and pid_alive(previous.launcher_pid):
        print(f"a mesh is already running from {args.state_dir} (launcher pid {previous.launcher_pid})",
              file=sys.stderr)
        return 1
    try:
        options = UpOptions(model_dir=args.model, num_executors=args.executors, http_port=args.http_port,
                            grpc_port=args.grpc_port, state_dir=Path(args.state_dir), keys_file=args.keys_file,
                            settings_file=str(Path(args.settings_file).resolve()) if args.settings_file else "",
                            log_level=args.log_level, startup_timeout_s=args.startup_timeout,
                            extra_executors=tuple(args.extra_executors),
                            restart=RestartConfig(max_deaths=args.crash_loop_deaths, window_s=args.crash_loop_window),
                            settings=settings_from_args(args))  # checked by the services' own parsers
    except ValueError as exc:
        print(f"weft up failed: {exc}", file=sys.stderr)
        return 2
    # Ports before the model: a pull is a download, a taken port is one line (the launcher
    # checks both again before it starts anything).
    problem = check_ports_free(options.host, {"--http-port": options.http_port, "--grpc-port": options.grpc_port})
    if problem:
        print(f"weft up failed: {problem}", file=sys.stderr)
        return 1
    model_dir = _resolve_model(args.model, args.cache_dir)
    if model_dir is None:
        return 1
    options = dataclasses.replace(options, model_dir=str(model_dir))

    def ready(state) -> None:
        print("Weft mesh is up")
        print(f"  model          {state.model_dir}")
        print(f"  OpenAI HTTP    {state.http_url}/v1")
        print(f"  gRPC (Router)  {state.grpc_address}")
        print(f"  NATS           {state.nats_url}")
        print(f"  executors      {', '.join(i.name for i in state.by_service('executor')) or '(none)'}")
        print(f"  logs           {Path(args.state_dir).resolve() / 'logs'}")
        print("weft ps lists services; weft scale executor=N adds or drains executors; Ctrl-C stops.", flush=True)

    print("starting the mesh ...", flush=True)
    try:
        asyncio.run(Launcher(options).run_until_signal(on_ready=ready))
    except MeshStartError as exc:  # the cause in one line; where to read more on the next
        print(f"weft up failed: {exc}", file=sys.stderr)
        if exc.log_path:
            print(f"  (log: {exc.log_path})", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. the state dir cannot be written, nats-server missing
        print(f"weft up failed: {exc}", file=sys.stderr)
        return 1
    print("mesh stopped")
    return 0


def _resolve_model(spec: str, cache_dir: Path | None) -> Path | None:
    """``--model`` as a checkpoint directory (pulled / imported on first use, with progress
    on stderr), or None after printing why not in one line."""
    from weft.models.sources import ModelFetchError, ModelSpecError, resolve_model

    try:
        return resolve_model(spec, cache_dir)
    except ModelSpecError as exc:
        print(f"weft up failed: {exc} (--model)", file=sys.stderr)
    except (ModelFetchError, OSError, ValueError) as exc:  # ValueError: GgufImportError
        print(f"weft up failed: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print("weft up: interrupted while getting the model (nothing was installed)", file=sys.stderr)
    return None


def register_ps(subparsers) -> None:
    ps = subparsers.add_parser("ps", help="list the running mesh's services with their health",
                               description="List the services of the mesh started by `weft up`: name, role, "
                                           "pid, ports, a live health probe, how often the launcher restarted "
                                           "it and its last exit status (-9: killed by SIGKILL). HEALTH "
                                           "crash-loop: it died too often and is no longer restarted; config-error: it "
                                           "exited 78 (model files or NATS login unusable) and is not restarted. "
                                           "Then the settings (weft up flags or WEFT_* variables) that differ "
                                           "from the defaults, per service.")
    add_state_dir_arg(ps)
    ps.set_defaults(handler=_ps)


def _ps(args: argparse.Namespace) -> int:
    from weft.health import probe

    state = running_mesh(args.state_dir)
    if state is None:
        return 1

    async def probe_all():
        return await asyncio.gather(*(probe(i.health_kind, "127.0.0.1", i.health_port, i.health_path, 1.0)
                                      for i in state.instances))

    healthy = asyncio.run(probe_all())
    rows = [("NAME", "PID", "PORTS", "HEALTH", "RESTARTS", "LAST-EXIT", "ROLE")]
    for inst, ok in zip(state.instances, healthy):
        rows.append((inst.name, str(inst.pid), ",".join(f"{_port_label(inst.service, k)}={p}" for k, p in inst.ports.items()),
                     _health_label(inst, ok), str(inst.restarts), "-" if inst.last_exit is None else str(inst.last_exit),
                     inst.role))
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:6], widths)) + "  " + r[6])
    print()  # the instance table ends at the first blank line
    for line in settings_lines(state.settings):
        print(line)
    from weft.cli.top import scrape_settings_versions, settings_versions_text

    versions = scrape_settings_versions(state)
    if any(v is not None for v in versions.values()):  # which live-settings version each runs (docs/live_config.md)
        print(settings_versions_text(versions))
    return 0 if all(healthy) else 2


def _health_label(inst, ok: bool) -> str:
    """The live probe, qualified by the supervisor's view of a process that is not healthy."""
    if ok:
        return "healthy"
    if inst.status in ("crash-loop", "config-error", "restarting", "stopped"):
        return inst.status
    return "unhealthy" if pid_alive(inst.pid) else "exited"


def _port_label(service: str, key: str) -> str:
    """``router_http_port`` -> ``http``; a service's main port (``executor_port``) -> ``grpc``."""
    label = key.removeprefix(f"{service}_").removesuffix("_port")
    if label == "port":
        return "client" if service == "nats" else "grpc"
    return label


def register_scale(subparsers) -> None:
    scale = subparsers.add_parser("scale", help="add or drain executors of the running mesh: executor=N",
                                  description="Scale the running mesh: `weft scale executor=3` starts executors "
                                              "until three run (waiting until each is healthy and placed on) or "
                                              "drains the highest-numbered ones (in-flight requests finish).")
    scale.add_argument("target", metavar="SERVICE=N", help="e.g. executor=2")
    add_state_dir_arg(scale)
    scale.set_defaults(handler=_scale)


def _scale(args: argparse.Namespace) -> int:
    from weft.launcher.control import request_scale

    service, _, count = args.target.partition("=")
    if not count.isdigit():
        print(f"expected SERVICE=N (e.g. executor=2), got {args.target!r}", file=sys.stderr)
        return 2
    state = running_mesh(args.state_dir)
    if state is None:
        return 1
    try:
        names = asyncio.run(request_scale(state, service, int(count)))
    except RuntimeError as exc:
        print(f"weft scale failed: {exc}", file=sys.stderr)
        return 1
    print(f"executors: {', '.join(names) or '(none)'}")
    return 0
