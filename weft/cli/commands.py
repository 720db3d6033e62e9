"""The ``weft`` command line.

Each top-level command or command group is one registration function that adds its
own sub-parser and sets ``handler`` (a callable taking the parsed args, returning an
exit code). To add a command (``weft up``, ``weft ps``, ``weft bench``), write a
``register_<name>(subparsers)`` function in its own module and list it in
``COMMANDS``; nothing else here changes. Registration must stay cheap (no torch, no
service imports): every ``weft`` call, ``--help`` included, registers every command.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from weft.cli.bench_cli import register_bench
from weft.cli.chaos_cli import register_chaos
from weft.cli.mesh_cli import register_ps, register_scale, register_up
from weft.cli.model_cli import register_model
from weft.cli.top import register_top

Registrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

# Command name -> registration function. Add new commands here.
COMMANDS: dict[str, Registrar] = {
    "model": register_model,
    "up": register_up,
    "ps": register_ps,
    "scale": register_scale,
    "bench": register_bench,
    "chaos": register_chaos,
    "top": register_top,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weft", description="Weft: an LLM inference engine for AI-agent workloads.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in COMMANDS.values():
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: sys.argv[1:]), run the chosen command, return its exit code."""
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
