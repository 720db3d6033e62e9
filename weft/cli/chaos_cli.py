"""``weft chaos kill|pause|resume|restart NAME``: disturb one service of a running mesh,
through the launcher's control endpoint (what each action does: ``weft/launcher/chaos.py``)."""
from __future__ import annotations

import argparse
import asyncio
import sys

from weft.cli.state_dir import add_state_dir_arg, running_mesh
from weft.launcher.chaos import ACTIONS


def register_chaos(subparsers) -> None:
    chaos = subparsers.add_parser(
        "chaos", help="kill, pause, resume or restart one service of the running mesh",
        description="Disturb one service of the running mesh, by its name in `weft ps` "
                    "(router, scheduler, executor-N, cachestore, nats). kill = SIGKILL (stays down: "
                    "the supervisor restarts only unplanned deaths such as a plain kill -9); "
                    "pause = SIGSTOP; resume = SIGCONT; restart = SIGKILL if alive, then start it "
                    "again and wait until it is healthy (prints the seconds it took).")
    chaos.add_argument("action", choices=ACTIONS, help="what to do")
    chaos.add_argument("name", metavar="NAME", help="instance name as `weft ps` lists it, e.g. executor-1")
    add_state_dir_arg(chaos)
    chaos.set_defaults(handler=_chaos)


def _chaos(args: argparse.Namespace) -> int:
    from weft.launcher.control import request_chaos

    state = running_mesh(args.state_dir)
    if state is None:
        return 1
    try:
        result = asyncio.run(request_chaos(state, args.action, args.name))
    except RuntimeError as exc:
        print(f"weft chaos failed: {exc}", file=sys.stderr)
        return 1
    extra = f" in {result['recovery_s']:.2f}s" if "recovery_s" in result else ""
    print(f"{args.action} {args.name}: pid {result['pid']}{' alive' if result['alive'] else ' down'}{extra}")
    return 0
