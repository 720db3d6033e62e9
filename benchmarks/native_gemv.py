"""Batch-1 GEMV read bandwidth: Weft's native C GEMV against oneDNN's packed linear.

NOTE: what is measured. A decode step streams each weight once from DRAM, so each shape
is timed over enough distinct weight copies (--pool-mib, well past the L3 cache) that
every call reads its weight from memory, as in a real step; GB/s = weight bytes / call
time. Shapes are SmolLM2-135M's (hidden 576): the fused qkv (576 -> 960 here is 1728
rows in the "qkv-like" shape the issue names), the fused gate_up (576 -> 3072), down
(1536 -> 576) and the lm_head (576 -> 49152). Engines alternate within each round;
figures are the median (min-max) over --rounds rounds after a warm-up round.
Writes benchmarks/results/native_gemv.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.executor.process_env import apply_executor_env  # noqa: E402

apply_executor_env()  # the executor's OpenMP settings, before torch loads

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from services.executor.model.linear import OneDnnLinear  # noqa: E402
from services.executor.model.native import library  # noqa: E402

SHAPES = ((1728, 576, "qkv-like"), (3072, 576, "gate_up"), (576, 1536, "down"), (49152, 576, "lm_head"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="threads for both engines (default: 2)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds, engines alternating (default: 5)")
    p.add_argument("--calls", type=int, default=200, help="calls per engine, shape and round (default: 200)")
    p.add_argument("--pool-mib", type=int, default=256,
                   help="MiB of distinct weight copies cycled through per shape, past the L3 (default: 256)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "native_gemv.md",
                   help="markdown report to write ('-' prints only)")
    return p.parse_args(argv)


def time_calls(fns: list, calls: int) -> float:
    """Seconds per call, cycling through ``fns`` (one per weight copy)."""
    t0 = time.perf_counter()
    for i in range(calls):
        fns[i % len(fns)]()
    return (time.perf_counter() - t0) / calls


def engines_for(n: int, k: int, pool_bytes: int, threads: int, lib) -> dict[str, list]:
    copies = max(2, pool_bytes // (n * k * 4))
    weights = [torch.randn(n, k) for _ in range(copies)]
    x = torch.randn(1, k)
    y = torch.empty(n)
    native = [lambda w=w: lib.weft_gemv(w.data_ptr(), None, x.data_ptr(), y.data_ptr(), n, k, threads)
              for w in weights]
    packed = [OneDnnLinear(w) for w in weights]
    onednn = [lambda m=m: m(x) for m in packed]
    return {"native C": native, "oneDNN packed": onednn}


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    lib = library.load()
    if lib is None:
        sys.exit("the native library could not be built (see the warning above)")
    results: dict[tuple[str, str], list[float]] = {}
    with tqdm(total=len(SHAPES) * (args.rounds + 1), desc="gemv") as bar:
        for n, k, name in SHAPES:
            engines = engines_for(n, k, args.pool_mib << 20, args.threads, lib)
            for rnd in range(args.rounds + 1):  # round 0 warms up
                order = list(engines) if rnd % 2 else list(reversed(engines))
                for engine in order:
                    s = time_calls(engines[engine], args.calls)
                    if rnd:
                        results.setdefault((name, engine), []).append(n * k * 4 / s / 1e9)
                bar.update()
            del engines
    lines = [f"# Batch-1 GEMV read bandwidth: native C vs oneDNN packed ({args.threads} threads)", "",
             f"Command: `python benchmarks/native_gemv.py --threads {args.threads} --rounds {args.rounds} "
             f"--calls {args.calls} --pool-mib {args.pool_mib}`. fp32, one input row; each call reads a different "
             f"copy of the weight out of {args.pool_mib} MiB (so from DRAM, not L3); GB/s = weight bytes / call "
             f"time, median (min-max) of {args.rounds} rounds, engines alternating.", "",
             "| shape (out x in) | | native C GB/s | oneDNN packed GB/s | native / oneDNN |", "|---|---|---|---|---|"]
    for n, k, name in SHAPES:
        nat, dnn = results[(name, "native C")], results[(name, "oneDNN packed")]
        ratio = [a / b for a, b in zip(nat, dnn)]
        lines.append(f"| {n} x {k} | {name} | {_fmt(nat)} | {_fmt(dnn)} | {_fmt(ratio, '×', 2)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if str(args.out) != "-":
        args.out.write_text(text)


def _fmt(values: list[float], unit: str = "", digits: int = 1) -> str:
    return (f"{statistics.median(values):.{digits}f}{unit} "
            f"({min(values):.{digits}f}{unit}–{max(values):.{digits}f}{unit})")


if __name__ == "__main__":
    main()
