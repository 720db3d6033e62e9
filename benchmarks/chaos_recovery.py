"""Recovery time per service after a plain ``kill -9``, as a Markdown table (median of N).

    python benchmarks/chaos_recovery.py [--model DIR] [--executors 2] [--repeats 3]

Starts a loopback mesh with the launcher (`weft up`'s code, its supervisor included), then
for each of cachestore, scheduler, executor-1, router and NATS, ``--repeats`` times:
SIGKILL the pid the state file records and time until the state file lists a new pid
whose health probe passes (``weft.launcher.chaos.wait_recovered``, the helper tests/chaos/test_kill9.py
uses under load). Between kills the mesh is let settle: the router reports ready again.

Each kill is measured as a FIRST death: the crash-loop window is shortened to one second
so the backoff never grows between repeats (the default policy's first restart waits
``RestartConfig.base_delay_s``, jittered; see weft/launcher/restart_policy.py). The mesh is idle: the
number is what the supervisor and a cold service start cost, not what a stream sees
(tests/chaos/test_kill9.py covers streams).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from weft import health  # noqa: E402
from weft.launcher.chaos import wait_recovered  # noqa: E402
from weft.launcher.launcher import Launcher, UpOptions  # noqa: E402
from weft.launcher.restart_policy import RestartConfig  # noqa: E402

VICTIMS = ("cachestore", "scheduler", "executor-1", "router", "nats")


async def _router_ready(launcher: Launcher, timeout_s: float) -> None:
    state = launcher.state()
    deadline = time.monotonic() + timeout_s
    while not (await health.probe_http(f"{state.http_url}/health/ready", 1.0)
               or await health.probe_http(f"{state.http_url}/health", 1.0)):
        if time.monotonic() > deadline:
            raise TimeoutError("the router did not report ready again")
        await asyncio.sleep(0.05)


async def measure(model_dir: str | None, num_executors: int, repeats: int, timeout_s: float) -> dict[str, list[float]]:
    state_dir = Path(tempfile.mkdtemp(prefix="weft-chaos-recovery-"))
    env = {"WEFT_EXECUTOR_NUM_THREADS": "1", "WEFT_EXECUTOR_HEARTBEAT_INTERVAL_S": "0.25"}
    launcher = Launcher(UpOptions(model_dir=model_dir, num_executors=num_executors, http_port=0, grpc_port=0,
                                  state_dir=state_dir, log_level="warning", extra_env=env,
                                  restart=RestartConfig(window_s=1.0)))
    times: dict[str, list[float]] = {name: [] for name in VICTIMS}
    await launcher.start()
    try:
        for name in VICTIMS:
            for _ in range(repeats):
                await _router_ready(launcher, timeout_s)
                old_pid = launcher.running[name].process.pid
                await asyncio.sleep(1.1)  # outside the shortened crash-loop window: a first death
                os.kill(old_pid, signal.SIGKILL)
                times[name].append(await asyncio.to_thread(wait_recovered, state_dir, name, old_pid, timeout_s))
                print(f"{name}: {times[name][-1]:.2f}s", file=sys.stderr, flush=True)
    finally:
        await launcher.stop()
    return times


def markdown(times: dict[str, list[float]]) -> str:
    rows = ["| service | kill -9 until healthy, median (s) | runs (s) |", "|---|---|---|"]
    for name, values in times.items():
        runs = ", ".join(f"{v:.2f}" for v in values)
        rows.append(f"| {name} | {statistics.median(values):.2f} | {runs} |")
    return "\n".join(rows)


def plot(times: dict[str, list[float]], path: Path) -> None:
    """Median recovery per service with the range of the runs as an error bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(times)
    medians = [statistics.median(times[n]) for n in names]
    low = [m - min(times[n]) for m, n in zip(medians, names)]
    high = [max(times[n]) - m for m, n in zip(medians, names)]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(names, medians, yerr=[low, high], capsize=4)
    ax.bar_label(bars, labels=[f"{m:.2f}" for m in medians], fontsize=8)
    ax.set_ylabel("kill -9 until healthy again (s)")
    ax.set_title(f"Supervised restart after kill -9 (median of {len(times[names[0]])}, range)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint dir; default: the tiny random model")
    parser.add_argument("--executors", type=int, default=2, help="at least 2 (executor-1 is killed)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="kills per service; the table shows their median and range (default: 3)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one recovery may take")
    parser.add_argument("--output", type=Path, default=Path(__file__).resolve().parent / "results" / "chaos_recovery.md",
                        help="where the Markdown table is written; a PNG chart goes beside it (.png)")
    args = parser.parse_args(argv)
    from services.mesh.logging import configure_logging

    configure_logging("launcher", "warning")  # the launcher's start/stop lines stay out of the table
    if args.executors < 2 or args.repeats < 1:
        parser.error("--executors must be >= 2 and --repeats >= 1")
    times = asyncio.run(measure(args.model, args.executors, args.repeats, args.timeout))
    table = markdown(times)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(table + "\n")
    plot(times, args.output.with_suffix(".png"))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
