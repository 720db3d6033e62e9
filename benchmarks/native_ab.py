"""Two A/Bs of the native library's recent changes, each in one process, sides alternating.

NOTE: what is measured.
  step     the native R-row decode step of a real model (``NativeDecoder.step_rows``, each
           row at --context tokens) through two builds of the native library that differ
           only in compile-time defines (--a-defines, --b-defines; by default the packed
           GEMM's column block for few-row blocks, 256 as before against 64 as now), on the
           same model, weights, packed copies and KV cache: two ``NativeDecoder``s over one
           engine's model, each holding its own build.
  prefill  the first step of 16 fresh 128-token prompts (one 2,048-row prefill, as
           peers/run.py's 16-concurrent run starts) in one engine, with the native row
           ops (native/rows.c RMSNorm and RoPE, the residual adds in the packed GEMM's
           epilogue) on, and off (torch's ops, as before): ``LlamaModel._row_ops`` and
           ``PackedLinear.add_into`` switched between rounds.
Every cell alternates its two sides --rounds times (order reversed every other round) after
a warm-up; a figure is the median (min-max) over rounds and a ratio the median of the
rounds' own ratios (the box's speed drifts between rounds; a pair shares a moment). The
step's two builds must give bit-identical logits first (the defines may not change a sum);
the prefill reports how many of its 16 first tokens agree on and off. Writes
benchmarks/results/native_ab.md and native_ab.png.
"""
from __future__ import annotations

import argparse
import ctypes
import shlex
import statistics
import subprocess
import sys
import tempfile
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
from benchmarks.packed_gemm import alternate, ratio, summary  # noqa: E402
from benchmarks.step_overhead import model_dir_for  # noqa: E402
from services.executor.engine.config import EngineConfig  # noqa: E402
from services.executor.engine.engine import LLMEngine  # noqa: E402
from services.executor.model import linear  # noqa: E402
from services.executor.model.llama import LlamaModel  # noqa: E402
from services.executor.model.native import library  # noqa: E402
from services.executor.model.native.decoder import NativeDecoder  # noqa: E402

PREFILL_PROMPTS, PREFILL_LEN = 16, 128


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "bench"],
                   help="presets (bench, ...) or real models (default: smollm2-135m-instruct bench)")
    p.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32],
                   help="decode rows per step in the step A/B (default: 8 16 32)")
    p.add_argument("--context", type=int, default=160, help="context tokens per row in the step A/B (default: 160)")
    p.add_argument("--a-defines", default="-DKC_FEW=256",
                   help="compiler defines of build A, written with '=' (--a-defines=-DKC_FEW=256); "
                        "default: -DKC_FEW=256, the column block before")
    p.add_argument("--b-defines", default="",
                   help="compiler defines of build B, written the same way; default: none, the sources as they are")
    p.add_argument("--skip-prefill", action="store_true", help="run the step A/B only")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per cell, sides alternating (default: 7)")
    p.add_argument("--threads", type=int, default=2, help="threads for both sides (default: 2)")
    p.add_argument("--cache-dir", type=Path, default=ROOT / ".weft" / "models",
                   help="where generated preset checkpoints are kept between runs")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results",
                   help="where native_ab.md and native_ab.png go")
    return p.parse_args(argv)


def build(defines: str, directory: Path, name: str) -> ctypes.CDLL:
    """The native library compiled from this checkout's sources with extra ``defines``."""
    out = directory / f"{name}.so"
    cmd = ["gcc", *library.FLAGS, *shlex.split(defines), *map(str, library.SOURCES), "-o", str(out), "-lm"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"building with {defines!r} failed:\n{done.stderr[-2000:]}")
    return library._declare(ctypes.CDLL(str(out)))


def step_ab(args, libs: tuple[ctypes.CDLL, ctypes.CDLL], bar) -> list[tuple]:
    out = []
    for spec in args.models:
        max_rows = max(args.rows)
        num_blocks = max_rows * -(-args.context // BLOCK_SIZE) + 1
        engine = LLMEngine(model_dir_for(spec, args.cache_dir),
                           EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=num_blocks, num_threads=args.threads))
        runner = engine.runner
        if runner.native is None:
            sys.exit("the native library could not be built (see the warning above)")
        base = runner.native
        decoders = []
        for lib in libs:  # the same model and caches, each decoder calling its own build
            d = NativeDecoder(lib, runner.model, runner.kv_caches)
            for field in ("qkv_p", "o_p", "gate_up_p", "down_p", "lm_head_p"):
                setattr(d._struct, field, getattr(base._struct, field))
            decoders.append(d)
        for rows in args.rows:
            fns = []
            for d in decoders:
                runner.native = d
                fns.append(engines_for(runner, rows, args.context)["native"])
            runner.native = base
            if not torch.equal(fns[0](), fns[1]()):
                sys.exit(f"{spec}, {rows} rows: the two builds' logits differ; the defines changed a sum")
            ta, tb = alternate(fns[0], fns[1], args.rounds)
            out.append((spec, rows, [t * 1e3 for t in ta], [t * 1e3 for t in tb], [a / b for a, b in zip(ta, tb)]))
            bar.update()
        del engine, runner, base, decoders
    return out


def _row_ops(on: bool) -> None:
    linear.PackedLinear.add_into = _PACKED_ADD_INTO if on else linear.Linear.add_into
    LlamaModel._row_ops = _ROW_OPS if on else (lambda self, positions: None)


_PACKED_ADD_INTO, _ROW_OPS = linear.PackedLinear.add_into, LlamaModel._row_ops


def prefill_ab(args, bar) -> list[tuple]:
    from weft import SamplingParams

    out = []
    for spec in args.models:
        engine = LLMEngine(model_dir_for(spec, args.cache_dir),
                           EngineConfig(max_num_batched_tokens=PREFILL_PROMPTS * PREFILL_LEN,
                                        max_prefill_chunk=PREFILL_LEN, num_threads=args.threads))
        gen = torch.Generator().manual_seed(0)
        vocab = engine.runner.model.lm_head.out_features
        prompts = [torch.randint(0, vocab, (PREFILL_LEN,), generator=gen).tolist() for _ in range(PREFILL_PROMPTS)]
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        counter = iter(range(1 << 30))

        def first_step(on: bool) -> list[int]:
            _row_ops(on)
            engine.pool.reset_prefix_cache()  # every round computes its prompts
            for ids in prompts:
                engine.add_request(f"ab-{next(counter)}", ids, sp)
            outputs = engine.step()
            while engine.has_unfinished_requests:
                engine.step()
            return [o.new_token_ids[0] for o in sorted(outputs, key=lambda o: int(o.request_id.split("-")[1]))]

        try:
            same = sum(a == b for a, b in zip(first_step(True), first_step(False)))  # RMSNorm rounds differently
            t_on, t_off = alternate(lambda: first_step(True), lambda: first_step(False), args.rounds)
        finally:
            _row_ops(True)
        out.append((spec, [t * 1e3 for t in t_on], [t * 1e3 for t in t_off], [b / a for a, b in zip(t_on, t_off)],
                    same))
        bar.update()
    return out


def write(args, steps: list[tuple], prefills: list[tuple]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu = cpu_name()
    argv = " ".join(shlex.quote(a) for a in sys.argv[1:])
    lines = [
        "# Native library A/Bs: two builds on the decode step, the row ops on the prefill",
        "",
        f"`python benchmarks/native_ab.py {argv}` on {cpu}, {args.threads} threads, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Each cell: the two sides alternating in one "
        "process after a warm-up, median (min–max) over the rounds; ratios are the median of the rounds' own "
        "ratios (higher: B, or the row ops, faster).",
        "",
        f"## Native R-row decode step ({args.context} tokens of context per row): "
        f"A `{args.a_defines or '(none)'}` vs B `{args.b_defines or '(none)'}`",
        "",
        "The two builds' logits are bit-identical (checked before timing).",
        "",
        "| model | rows | A ms/step | B ms/step | A / B |",
        "|---|---|---|---|---|",
    ]
    for spec, rows, ta, tb, r in steps:
        lines.append(f"| {spec} | {rows} | {summary(ta)} | {summary(tb)} | {ratio(r)} |")
    if prefills:
        lines += [
            "",
            f"## Prefill step ({PREFILL_PROMPTS} × {PREFILL_LEN} fresh tokens): native row ops on vs off",
            "",
            "| model | on ms | off ms | off / on | first tokens equal |",
            "|---|---|---|---|---|",
        ]
        for spec, t_on, t_off, r, same in prefills:
            lines.append(f"| {spec} | {summary(t_on)} | {summary(t_off)} | {ratio(r)} | {same}/{PREFILL_PROMPTS} |")
    lines += ["", "![native_ab](native_ab.png)", ""]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "native_ab.md").write_text("\n".join(lines))

    fig, axes = plt.subplots(1, 2 if prefills else 1, figsize=(11 if prefills else 6, 4), squeeze=False)
    labels = [f"{s.split('-')[0]}\n{r} rows" for s, r, *_ in steps]
    axes[0][0].bar(labels, [statistics.median(x[4]) for x in steps], color="tab:green")
    axes[0][0].axhline(1.0, color="grey", lw=1)
    axes[0][0].set_title("decode step: A / B time")
    axes[0][0].tick_params(axis="x", labelsize=7)
    if prefills:
        axes[0][1].bar([s.split("-")[0] for s, *_ in prefills], [statistics.median(x[3]) for x in prefills],
                       color="tab:blue")
        axes[0][1].axhline(1.0, color="grey", lw=1)
        axes[0][1].set_title("prefill step: row ops off / on time")
    fig.tight_layout()
    fig.savefig(args.out_dir / "native_ab.png", dpi=110)
    print("\n".join(lines))


def main(argv=None) -> None:
    args = parse_args(argv)
    if library.load() is None:
        sys.exit("the native library could not be built (see the warning above)")
    torch.set_num_threads(args.threads)
    total = len(args.models) * (len(args.rows) + (0 if args.skip_prefill else 1))
    with tempfile.TemporaryDirectory(prefix="weft-native-ab-") as tmp, tqdm(total=total, desc="native_ab") as bar:
        libs = (build(args.a_defines, Path(tmp), "a"), build(args.b_defines, Path(tmp), "b"))
        steps = step_ab(args, libs, bar)
        prefills = [] if args.skip_prefill else prefill_ab(args, bar)
    write(args, steps, prefills)


if __name__ == "__main__":
    main()
