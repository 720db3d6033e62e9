"""native/gemm.c's packed GEMM against what it replaced, in one process, alternating.

NOTE: what is measured. Two A/Bs on AVX2 CPUs without AVX-512 (elsewhere the packed GEMM
is not built and this exits):
  GEMM     one projection shape (SmolLM2's: qkv, gate_up, down, lm_head) at R rows, the
           packed linear (``PackedLinear``) against oneDNN's linear on its 16-row layout
           (``OneDnnLinear``, what the model used before), GFLOPS.
  step     the native R-row decode step of a real model (``NativeDecoder.step_rows``, each
           row at --context tokens), once reading the packed copies (the default) and once
           with their pointers cleared, so the same weights go through decode_batch.c's
           dot-product tiles as before; same model, same memory, same process.
Every cell alternates its two sides --rounds times (order reversed every other round) after
a warm-up; a figure is the median (min-max) over rounds and a ratio the median of the
rounds' own ratios (the box's speed drifts between rounds; a pair shares a moment).
Writes benchmarks/results/packed_gemm.md and packed_gemm.png.
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

from benchmarks.native_batch import BLOCK_SIZE, engines_for  # noqa: E402
from benchmarks.report import cpu_name  # noqa: E402
from benchmarks.step_overhead import model_dir_for  # noqa: E402
from services.executor.engine.config import EngineConfig  # noqa: E402
from services.executor.engine.engine import LLMEngine  # noqa: E402
from services.executor.model.linear import OneDnnLinear, PackedLinear, packed_usable  # noqa: E402
from services.executor.model.native import library  # noqa: E402
from services.executor.model.native.decoder import NativeDecoder  # noqa: E402

# (name, rows, in_features, out_features): SmolLM2-135M's projections at a 16-row decode
# step and a 16 x 128 prefill
GEMM_SHAPES = [("qkv", 16, 576, 960), ("gate_up", 16, 576, 3072), ("down", 16, 1536, 576),
               ("lm_head", 16, 576, 49152), ("qkv", 2048, 576, 960), ("gate_up", 2048, 576, 3072),
               ("down", 2048, 1536, 576)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "bench"],
                   help="presets (bench, ...) or real models for the step A/B (default: smollm2-135m-instruct bench)")
    p.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32],
                   help="decode rows per step in the step A/B (default: 8 16 32; the packed copies serve > 6)")
    p.add_argument("--context", type=int, default=160, help="context tokens per row in the step A/B (default: 160)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per cell, sides alternating (default: 7)")
    p.add_argument("--threads", type=int, default=2, help="threads for both sides (default: 2)")
    p.add_argument("--cache-dir", type=Path, default=ROOT / ".weft" / "models",
                   help="where generated preset checkpoints are kept between runs")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results",
                   help="where packed_gemm.md and packed_gemm.png go")
    return p.parse_args(argv)


def timed(fn, seconds: float = 0.25) -> float:
    """Seconds per call: enough calls to fill ``seconds`` (at least 2)."""
    fn()
    t0, calls = time.perf_counter(), 0
    while calls < 2 or time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - t0) / calls


def alternate(a, b, rounds: int) -> tuple[list[float], list[float]]:
    """Seconds per call of a and of b, one pair per round, order reversed every other round."""
    ta, tb = [], []
    timed(a), timed(b)  # warm-up
    for r in range(rounds):
        if r % 2:
            tb.append(timed(b)), ta.append(timed(a))
        else:
            ta.append(timed(a)), tb.append(timed(b))
    return ta, tb


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})"


def ratio(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}× ({min(values):.2f}×–{max(values):.2f}×)"


def gemm_rows(lib, rounds: int, bar) -> list[tuple]:
    out = []
    for name, rows, k, n in GEMM_SHAPES:
        gen = torch.Generator().manual_seed(rows + n)
        w, x = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen)
        packed, onednn = PackedLinear(w, None, lib), OneDnnLinear(w)
        torch.testing.assert_close(packed(x), onednn(x), rtol=1e-4, atol=1e-3)
        tp, to = alternate(lambda: packed(x), lambda: onednn(x), rounds)
        flops = 2 * rows * k * n
        out.append((name, rows, k, n, [flops / t / 1e9 for t in tp], [flops / t / 1e9 for t in to],
                    [o / p for p, o in zip(tp, to)]))
        bar.update()
    return out


def step_rows_ab(args, bar) -> list[tuple]:
    out = []
    for spec in args.models:
        max_rows = max(args.rows)
        engine = LLMEngine(model_dir_for(spec, args.cache_dir),
                           EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=max_rows * -(-args.context // BLOCK_SIZE) + 1,
                                        num_threads=args.threads))
        runner = engine.runner
        if runner.native is None or not getattr(runner.native._struct, "qkv_p", None):
            sys.exit(f"{spec}: the native step has no packed copies (WEFT_PACKED_GEMM=0, or no native library)")
        packed_decoder = runner.native
        plain_decoder = NativeDecoder(packed_decoder._lib, runner.model, runner.kv_caches)
        for field in ("qkv_p", "o_p", "gate_up_p", "down_p", "lm_head_p"):
            setattr(plain_decoder._struct, field, None)  # decode_batch.c's dot-product tiles, as before
        for rows in args.rows:
            packed_fn = engines_for(runner, rows, args.context)["native"]
            runner.native = plain_decoder
            plain_fn = engines_for(runner, rows, args.context)["native"]
            runner.native = packed_decoder
            ref = plain_fn()
            torch.testing.assert_close(packed_fn(), ref, rtol=0, atol=5e-3 * float(ref.abs().max()))
            tp, tq = alternate(packed_fn, plain_fn, args.rounds)
            out.append((spec, rows, [t * 1e3 for t in tp], [t * 1e3 for t in tq], [q / p for p, q in zip(tp, tq)]))
            bar.update()
        del engine, runner, packed_decoder, plain_decoder
    return out


def write(args, gemm: list[tuple], steps: list[tuple]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu = cpu_name()
    lines = [
        "# Packed GEMM (native/gemm.c) against what it replaced",
        "",
        f"`python benchmarks/packed_gemm.py --rounds {args.rounds} --context {args.context}` on {cpu}, "
        f"{args.threads} threads, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Each cell: the two sides "
        "alternating in one process after a warm-up, median (min–max) over the rounds; ratios are the median "
        "of the rounds' own ratios (higher: packed faster).",
        "",
        "## GEMM: PackedLinear vs oneDNN's linear (SmolLM2-135M's projection shapes)",
        "",
        "| projection | rows | in | out | packed GFLOPS | oneDNN GFLOPS | packed / oneDNN |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rows, k, n, gp, go, r in gemm:
        lines.append(f"| {name} | {rows} | {k} | {n} | {summary(gp)} | {summary(go)} | {ratio(r)} |")
    lines += [
        "",
        f"## Native R-row decode step ({args.context} tokens of context per row): packed copies vs the "
        "dot-product tiles on the plain weights",
        "",
        "| model | rows | packed ms/step | plain ms/step | plain / packed |",
        "|---|---|---|---|---|",
    ]
    for spec, rows, tp, tq, r in steps:
        lines.append(f"| {spec} | {rows} | {summary(tp)} | {summary(tq)} | {ratio(r)} |")
    lines += ["", "![packed_gemm](packed_gemm.png)", ""]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "packed_gemm.md").write_text("\n".join(lines))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{n}\n{r} rows" for n, r, *_ in gemm]
    axes[0].bar(labels, [statistics.median(x[6]) for x in gemm], color="tab:blue")
    axes[0].axhline(1.0, color="grey", lw=1)
    axes[0].set_title("GEMM: packed / oneDNN speed")
    axes[0].tick_params(axis="x", labelsize=7)
    labels = [f"{s.split('-')[0]}\n{r} rows" for s, r, *_ in steps]
    axes[1].bar(labels, [statistics.median(x[4]) for x in steps], color="tab:green")
    axes[1].axhline(1.0, color="grey", lw=1)
    axes[1].set_title("native decode step: plain / packed time")
    axes[1].tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(args.out_dir / "packed_gemm.png", dpi=110)
    print("\n".join(lines))


def main(argv=None) -> None:
    args = parse_args(argv)
    lib = library.load()
    if not packed_usable(lib):
        sys.exit("the packed GEMM is built for AVX2 CPUs without AVX-512 only (or WEFT_PACKED_GEMM=0): nothing to compare")
    torch.set_num_threads(args.threads)
    with tqdm(total=len(GEMM_SHAPES) + len(args.models) * len(args.rows), desc="packed_gemm") as bar:
        gemm = gemm_rows(lib, args.rounds, bar)
        steps = step_rows_ab(args, bar)
    write(args, gemm, steps)


if __name__ == "__main__":
    main()
