"""A decode step's own overhead: wall time minus the time spent inside torch ops.

NOTE: what "overhead" means here. One engine step is Python (schedule, build the step's
inputs, sample bookkeeping, apply the result) around torch ops (the forward pass, the
argmax). The ops' time is read from torch.profiler: the summed duration of the
*top-level* CPU ops of the profiled steps (an op nested inside another is counted once,
in its parent). Host overhead = profiled wall - op time, per step. The profiler adds a
little to both (it records every op), so a separate unprofiled pass gives the steps/s and
wall ms that a user sees; the phase timings (schedule / prepare / forward+sample / update)
come from that unprofiled pass, by wrapping the engine's methods with perf_counter.

Workload: ``--batch`` concurrent greedy requests of an 8-token prompt, EOS ignored; after
a few settling steps only decodes run, so every timed step is a steady-state decode step.
Each (model, batch) cell is measured ``--rounds`` times, cells interleaved round by round;
figures are medians with their range. Writes benchmarks/results/step_overhead.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the torch runtime settings `weft up` gives executors, before torch loads (process_env.py)
from services.executor.process_env import apply_executor_env  # noqa: E402

apply_executor_env()

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.report import write_markdown  # noqa: E402

PHASES = ("schedule", "prepare", "execute", "update")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["bench", "smollm2-135m-instruct"],
                   help="presets (tiny, small, bench: generated under --cache-dir) or real models / checkpoint "
                        "directories (default: bench smollm2-135m-instruct)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="concurrent requests (default: 1 16)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per measurement (default: 32)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per cell; median and range (default: 3)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default: 2)")
    p.add_argument("--cache-dir", type=Path, default=ROOT / ".weft" / "models",
                   help="where generated preset checkpoints are kept between runs")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "step_overhead.md",
                   help="markdown report to write ('-' prints only)")
    p.add_argument("--json", type=Path, default=None,
                   help="also write every measurement (not just medians) as JSON here, for A/B comparisons")
    p.add_argument("--label", default="", help="a note put in the report's heading (e.g. the commit measured)")
    return p.parse_args(argv)


def model_dir_for(spec: str, cache_dir: Path) -> Path:
    if spec in ("tiny", "small", "bench"):
        from weft.testing.tiny_model import make_tiny_checkpoint

        path = cache_dir / f"{spec}-llama"
        if not (path / "config.json").exists():
            make_tiny_checkpoint(path, preset=spec, arch="llama")
        return path
    from benchmarks.real_model import resolve_checkpoint

    return resolve_checkpoint(spec)


class PhaseTimer:
    """Wraps the engine's step phases (instance attributes shadow the methods) and sums
    their wall time. ``reset`` starts a new measurement."""

    def __init__(self, engine) -> None:
        self.ms = dict.fromkeys(PHASES, 0.0)
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.runner, "_prepare", "prepare")
        self._wrap(engine.runner, "execute", "execute")
        self._wrap(engine.scheduler, "update", "update")

    def _wrap(self, obj, attr: str, phase: str) -> None:
        inner = getattr(obj, attr)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.ms[phase] += (time.perf_counter() - t0) * 1e3

        setattr(obj, attr, timed)

    def reset(self) -> None:
        self.ms = dict.fromkeys(PHASES, 0.0)


def top_level_op_ms(prof) -> float:
    """Summed duration of the profiled CPU ops that no other op encloses (ms)."""
    total_us = 0.0
    for e in prof.events():
        if e.cpu_parent is None and not e.is_user_annotation and e.device_type == torch.autograd.DeviceType.CPU:
            total_us += e.time_range.elapsed_us()
    return total_us / 1e3


def measure(llm, timer: PhaseTimer, batch: int, steps: int, tag: str) -> dict[str, float]:
    """One measurement: ``steps`` unprofiled then ``steps`` profiled decode steps."""
    from torch.profiler import ProfilerActivity, profile

    from weft import SamplingParams

    engine = llm.engine
    sp = SamplingParams(max_tokens=2 * steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [11 + i, 12, 13, 14, 15, 16, 17, 18], sp)
    for _ in range(3):  # the prefill step, then settle into pure decode steps
        engine.step()
    timer.reset()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    phases = {k: v / steps for k, v in timer.ms.items()}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        prof_wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    op_ms = top_level_op_ms(prof) / steps
    while engine.has_unfinished_requests:
        engine.step()
    return {"steps_per_s": 1e3 / wall_ms, "wall_ms": wall_ms, "prof_wall_ms": prof_wall_ms, "op_ms": op_ms,
            "overhead_ms": prof_wall_ms - op_ms, **{f"{k}_ms": v for k, v in phases.items()}}


def fmt(values: list[float], digits: int = 2) -> str:
    med = statistics.median(values)
    return f"{med:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from weft import LLM, SamplingParams

    engines = {}
    for spec in args.models:
        llm = LLM(model_dir_for(spec, args.cache_dir), num_threads=args.threads)
        llm.generate([[11, 12, 13]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm up
        engines[spec] = (llm, PhaseTimer(llm.engine))
    cells = [(m, b) for m in args.models for b in args.batches]
    results: dict[tuple[str, int], list[dict[str, float]]] = {c: [] for c in cells}
    with tqdm(total=len(cells) * (args.rounds + 1), desc="step overhead", unit="cell") as bar:
        for r in range(args.rounds + 1):  # round 0 is a warm-up, not reported
            for m, b in cells:
                llm, timer = engines[m]
                out = measure(llm, timer, b, args.steps, f"r{r}-{b}")
                if r:
                    results[(m, b)].append(out)
                bar.update(1)
    if args.json is not None:
        args.json.write_text(json.dumps([{"model": m, "batch": b, "runs": runs} for (m, b), runs in results.items()]))
    report(results, args)
    return 0


def report(results, args) -> None:
    rows, phase_rows = [], []
    for (m, b), runs in results.items():
        col = lambda k: [x[k] for x in runs]  # noqa: E731
        rows.append([m, b, fmt(col("steps_per_s"), 1), fmt(col("wall_ms")), fmt(col("prof_wall_ms")),
                     fmt(col("op_ms")), fmt(col("overhead_ms"))])
        phase_rows.append([m, b] + [fmt(col(f"{p}_ms")) for p in PHASES])
    lines = [
        f"# Decode step overhead{' — ' + args.label if args.label else ''}",
        "",
        f"{args.threads} threads, fp32, greedy, {args.steps} decode steps per measurement, median (range) of "
        f"{args.rounds} interleaved rounds after a warm-up round. Command: "
        f"`python benchmarks/step_overhead.py --models {' '.join(args.models)} --batches "
        f"{' '.join(map(str, args.batches))} --steps {args.steps} --rounds {args.rounds}`.",
        "",
        "Host overhead = profiled wall − top-level torch op time (benchmarks/step_overhead.py says how).",
        "",
        write_markdown(["model", "batch", "steps/s", "wall ms", "wall ms (profiled)", "op ms", "host overhead ms"],
                       rows),
        "",
        "## Phases of a step (unprofiled, ms per step)",
        "",
        "`execute` includes `prepare`, the forward pass and the sampler.",
        "",
        write_markdown(["model", "batch", *PHASES], phase_rows),
        "",
    ]
    text = "\n".join(lines)
    if str(args.out) != "-":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    raise SystemExit(main())
