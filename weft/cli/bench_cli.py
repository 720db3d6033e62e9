"""``weft bench NAME [ARGS...]``: run a benchmark from ``benchmarks/`` (results under
``benchmarks/results/``). ``weft bench agentic --help`` lists a benchmark's options;
``weft bench agentic --peer llama-server --help`` the comparison with llama.cpp's server."""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

BENCHMARKS = {"agentic": "benchmarks.agentic"}


def register_bench(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="run a benchmark (agentic)", add_help=True,
                                  description="Run a benchmark; arguments after its name go to it. "
                                  "`weft bench agentic --peer llama-server` compares with llama.cpp's server.")
    bench.add_argument("name", choices=list(BENCHMARKS), help="which benchmark")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="its arguments (see weft bench NAME --help)")
    bench.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    root = str(Path(__file__).resolve().parents[2])  # the repository: benchmarks/ sits there
    if root not in sys.path:
        sys.path.insert(0, root)
    module = importlib.import_module(BENCHMARKS[args.name])
    return int(module.main(list(args.bench_args)) or 0)
