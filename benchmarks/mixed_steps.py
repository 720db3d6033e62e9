"""Mixed steps: three ways to run a step that prefills a hop beside running decodes, in
one process.

NOTE: what is measured. An agent's next hop arrives while other sessions decode: the step
that prefills it (its new tokens over a cached context) also carries the running decodes.
For each model, context C (--contexts) and decode-row count R: R requests of C tokens are
decoding, then every round adds one hop (the first request's C tokens, cached, plus
--new-tokens fresh ones, max_tokens 1) and times the one step that prefills it, three ways
(``ModelRunner`` switches; nothing else differs):

  single  the default since 2026-12-05: one pass of the model's forward over every row,
          the decode rows' attention native (``native_decode_attention``)
  split   the decodes in the native step, the prefill through the model: two passes over
          the weights (``native_mixed_steps``, its context threshold set to 0 so every cell
          measures the split itself; the engine used it above NATIVE_MIXED_MIN_CONTEXT)
  model   the whole step through the model, the decode rows' contexts gathered (before both)

They alternate --rounds times (order rotated every round) after a warm-up. A figure is the
median (min-max) over rounds, a ratio the median of the rounds' own ratios (the box's speed
drifts; a round shares a moment). A decode-only step of the same R rows (native) is timed
beside them for scale. Writes benchmarks/results/mixed_steps.md and mixed_steps.png.
"""
from __future__ import annotations

import argparse
import shlex
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

from benchmarks.report import cpu_name  # noqa: E402
from benchmarks.packed_gemm import ratio, summary  # noqa: E402
from benchmarks.step_overhead import model_dir_for  # noqa: E402
from services.executor.engine.config import EngineConfig  # noqa: E402
from services.executor.engine.engine import LLMEngine  # noqa: E402
from services.executor.engine.model_runner import NATIVE_MIXED_MIN_CONTEXT  # noqa: E402
from services.executor.engine.sampling_params import SamplingParams  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "bench"],
                   help="presets (bench, ...) or real models (default: smollm2-135m-instruct bench)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 16],
                   help="decode rows running beside the hop's prefill (default: 1 2 8 16)")
    p.add_argument("--contexts", type=int, nargs="+", default=[200, 1400],
                   help="context tokens of each decoding request and of the hop's cached prefix, one cell "
                        "per value (default: 200 1400)")
    p.add_argument("--new-tokens", type=int, default=112, help="the hop's fresh prompt tokens (default: 112)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per cell, the three modes alternating (default: 7)")
    p.add_argument("--threads", type=int, default=2, help="torch and native threads (default: 2)")
    p.add_argument("--cache-dir", type=Path, default=ROOT / ".weft" / "models",
                   help="where generated preset checkpoints are kept between runs")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results",
                   help="where mixed_steps.md and mixed_steps.png go")
    return p.parse_args(argv)


MODES = ("single", "split", "model")


def set_mode(runner, mode: str) -> None:
    runner.native_decode_attention = mode == "single"
    runner.native_mixed_steps = mode == "split"
    runner.native_mixed_min_context = 0  # split every mixed step: the threshold is not what this measures


def cell(engine: LLMEngine, rows: int, context: int, args, tag: str) -> dict[str, list[float]]:
    """Milliseconds per round for each mode and for a decode-only step ("decode"), for
    ``rows`` requests of ``context`` tokens."""
    gen = torch.Generator().manual_seed(rows)
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in range(rows)]
    decoding = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-d{i}", ids, decoding)
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    hop = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    counter = iter(range(1 << 30))

    def mixed(mode: str) -> float:
        set_mode(engine.runner, mode)
        fresh = torch.randint(0, vocab, (args.new_tokens,), generator=gen).tolist()
        engine.add_request(f"{tag}-h{next(counter)}", prompts[0] + fresh, hop)
        start = time.perf_counter()
        engine.step()  # prefills the hop (its prefix cached) beside the decodes; it ends there
        elapsed = time.perf_counter() - start
        assert len(engine.scheduler.running) == rows, "the hop did not finish in its step"
        return elapsed * 1e3

    out: dict[str, list[float]] = {m: [] for m in (*MODES, "decode")}
    for m in MODES:
        mixed(m)  # warm-up
    for r in range(args.rounds):
        for m in MODES[r % 3:] + MODES[:r % 3]:
            out[m].append(mixed(m))
    engine.runner.native_decode_attention = engine.runner.native is not None
    engine.runner.native_mixed_steps = True
    engine.runner.native_mixed_min_context = NATIVE_MIXED_MIN_CONTEXT
    for _ in range(args.rounds):
        start = time.perf_counter()
        engine.step()
        out["decode"].append((time.perf_counter() - start) * 1e3)
    for i in range(rows):
        engine.abort_request(f"{tag}-d{i}")
    return out


def write(args, cells: list[tuple]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu = cpu_name()
    argv = " ".join(shlex.quote(a) for a in sys.argv[1:])
    lines = [
        "# Mixed steps: a hop's prefill beside running decodes, three ways",
        "",
        f"`python benchmarks/mixed_steps.py {argv}` on {cpu}, {args.threads} threads, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. One step prefilling a hop ({args.new_tokens} "
        f"fresh tokens over a cached prefix of C tokens) while R requests of C tokens decode: *single* (now) one "
        "pass of the model over every row, the decode rows' attention native; *split* the decodes in the native "
        "step and the prefill through the model (two passes over the weights; the default before, for contexts "
        "of 1,024 tokens and more); *model* the whole step through the model with the decodes' contexts gathered. "
        "The three alternate in one process after a warm-up, order rotated each round; median (min–max) over "
        "the rounds, ratios the median of the rounds' own ratios (higher: single faster). *decode only*: a step "
        "of the same R rows without the hop, for scale.",
        "",
        "| model | C | R | single ms | split ms | model ms | split / single | model / single | decode only ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for spec, context, rows, t in cells:
        lines.append(f"| {spec} | {context} | {rows} | {summary(t['single'])} | {summary(t['split'])} | "
                     f"{summary(t['model'])} | {ratio([b / a for a, b in zip(t['single'], t['split'])])} | "
                     f"{ratio([b / a for a, b in zip(t['single'], t['model'])])} | {summary(t['decode'])} |")
    lines += ["", "![mixed_steps](mixed_steps.png)", ""]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "mixed_steps.md").write_text("\n".join(lines))

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{s.split('-')[0]}\nC={c}\nR={r}" for s, c, r, _ in cells]
    x = range(len(cells))
    for k, (mode, label) in enumerate((("single", "single (one pass, native attention)"),
                                        ("split", "split (native step + model)"),
                                        ("model", "model (gathered)"))):
        ax.bar([i + (k - 1) * 0.27 for i in x], [statistics.median(c[3][mode]) for c in cells], 0.27, label=label)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("ms per mixed step (median)")
    ax.set_title(f"a hop's prefill ({args.new_tokens} new tokens over C cached) beside R decodes of C")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out_dir / "mixed_steps.png", dpi=110)
    print("\n".join(lines))


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cells = []
    longest = max(args.contexts)
    with tqdm(total=len(args.models) * len(args.contexts) * len(args.rows), desc="mixed_steps") as bar:
        for spec in args.models:
            max_rows = max(args.rows)
            blocks = (max_rows + 2) * (-(-(longest + args.new_tokens + 4 * args.rounds + 8) // 16)) + 64
            engine = LLMEngine(model_dir_for(spec, args.cache_dir),
                               EngineConfig(num_kv_blocks=blocks, max_num_seqs=max_rows + 2, num_threads=args.threads,
                                            max_model_len=longest + args.new_tokens + 256))
            if engine.runner.native is None:
                sys.exit("the native library could not be built (see the warning above): nothing to compare")
            for context in args.contexts:
                for rows in args.rows:
                    cells.append((spec, context, rows, cell(engine, rows, context, args, f"{spec}-{context}-{rows}")))
                    bar.update()
            del engine
    write(args, cells)


if __name__ == "__main__":
    main()
