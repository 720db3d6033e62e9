"""How long a launched mesh takes to start (until `weft up` would report it ready) and to
stop, with `weft up`'s own code (weft/launcher): real NATS, one process per service.

Each round starts a fresh mesh in a fresh state dir and stops it; the first round is a
warm-up (page cache, the native library cache) and is not counted. Prints each round and
the median (range) of the counted ones. To compare two commits, run it from a worktree of
each, alternating (benchmarks/results/startup_ab.md).
"""
from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint dir; default: the tiny random model, made in --cache-dir on first use")
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "weft-bench-models",
                   help="where the tiny model is made (default: %(default)s)")
    p.add_argument("--executors", type=int, default=1, help="executors per mesh (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="counted rounds, after one warm-up (default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=180.0,
                   help="seconds one start may take before it fails (default: %(default)s)")
    args = p.parse_args(argv)
    if args.executors < 1 or args.rounds < 1:
        p.error("need --executors >= 1 and --rounds >= 1")
    return args


async def one_round(model_dir: Path, executors: int, timeout_s: float) -> tuple[float, float]:
    from weft.launcher.launcher import Launcher, UpOptions

    state_dir = Path(tempfile.mkdtemp(prefix="weft-startup-"))
    try:
        launcher = Launcher(UpOptions(model_dir=str(model_dir), num_executors=executors, http_port=0, grpc_port=0,
                                      state_dir=str(state_dir), log_level="warning", startup_timeout_s=timeout_s))
        t0 = time.monotonic()
        await launcher.start()
        t1 = time.monotonic()
        await launcher.stop()
        return t1 - t0, time.monotonic() - t1
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    model_dir = args.model
    if model_dir is None:
        from weft.testing.tiny_model import make_tiny_checkpoint

        model_dir = args.cache_dir / "tiny"
        if not (model_dir / "config.json").is_file():
            make_tiny_checkpoint(model_dir, preset="tiny")
    from services.mesh.logging import configure_logging

    configure_logging("bench", "warning")
    starts, stops = [], []
    for i in tqdm(range(args.rounds + 1), desc="meshes", unit="mesh"):
        start, stop = asyncio.run(one_round(model_dir.resolve(), args.executors, args.startup_timeout))
        tqdm.write(f"round {i}{' (warm-up)' if i == 0 else ''}: start {start:.2f} s, stop {stop:.2f} s")
        if i:
            starts.append(start)
            stops.append(stop)
    for name, xs in (("start", starts), ("stop", stops)):
        print(f"{name}: median {statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f}) over {len(xs)} rounds, "
              f"{args.executors} executor(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
