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
"""
from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from weft.mesh_state import MeshState

if TYPE_CHECKING:
    from weft.launcher import Launcher

ACTIONS = ("kill", "pause", "resume", "restart")


async def apply_chaos(launcher: Launcher, action: str, name: str) -> dict:
    """Do ``action`` to instance ``name``; mutates the launcher's process table."""
    from weft.launcher import BY_NAME
    from weft.mesh_state import write_state

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
    new = await launcher._spawn(spec, name)
    deadline = t0 + launcher.options.startup_timeout_s
    await launcher._wait_healthy([name], deadline)
    if spec.name == "executor":
        await launcher._wait_scheduler_sees({name}, deadline)
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
    from weft import health
    from weft.mesh_state import read_state

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        state = read_state(state_dir)
        inst = next((i for i in state.instances if i.name == name), None) if state else None
        if inst is not None and inst.pid != old_pid and asyncio.run(
                health.probe(inst.health_kind, "127.0.0.1", inst.health_port, inst.health_path, 1.0)):
            return time.monotonic() - t0
        time.sleep(interval_s)  # polling interval of the state file and the probe
    raise TimeoutError(f"{name} (pid {old_pid} killed) was not back and healthy within {timeout_s:.0f}s")


async def request_chaos(state: MeshState, action: str, name: str, timeout_s: float = 300.0) -> dict:
    """Ask the running launcher to do ``action`` to ``name``; RuntimeError with its reason."""
    import aiohttp

    from weft.launcher_control import TOKEN_HEADER

    url = f"http://127.0.0.1:{state.control_port}/chaos"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.post(url, json={"action": action, "name": name},
                                headers={TOKEN_HEADER: state.control_token}) as resp:
            body = await resp.json()
            if resp.status != 200:
                raise RuntimeError(body.get("error", f"HTTP {resp.status}"))
            return body


def register_chaos(subparsers) -> None:
    from weft.mesh_cli import _state_dir_arg

    chaos = subparsers.add_parser(
        "chaos", help="kill, pause, resume or restart one service of the running mesh",
        description="Disturb one service of the running mesh, by its name in `weft ps` "
                    "(router, scheduler, executor-N, cachestore, nats). kill = SIGKILL (stays down: "
                    "the supervisor restarts only unplanned deaths such as a plain kill -9); "
                    "pause = SIGSTOP; resume = SIGCONT; restart = SIGKILL if alive, then start it "
                    "again and wait until it is healthy (prints the seconds it took).")
    chaos.add_argument("action", choices=ACTIONS, help="what to do")
    chaos.add_argument("name", metavar="NAME", help="instance name as `weft ps` lists it, e.g. executor-1")
    _state_dir_arg(chaos)
    chaos.set_defaults(handler=_chaos)


def _chaos(args: argparse.Namespace) -> int:
    from weft.mesh_state import pid_alive, read_state

    state = read_state(args.state_dir)
    if state is None or not pid_alive(state.launcher_pid):
        print(f"no mesh running (no live launcher recorded in {args.state_dir})", file=sys.stderr)
        return 1
    try:
        result = asyncio.run(request_chaos(state, args.action, args.name))
    except RuntimeError as exc:
        print(f"weft chaos failed: {exc}", file=sys.stderr)
        return 1
    extra = f" in {result['recovery_s']:.2f}s" if "recovery_s" in result else ""
    print(f"{args.action} {args.name}: pid {result['pid']}{' alive' if result['alive'] else ' down'}{extra}")
    return 0
