"""Mixed steps: a step's decodes through the native step beside its prefill chunks through
the model (now) against the whole step through the model (before), in one process.

NOTE: what is measured. An agent's next hop arrives while other sessions decode: the step
that prefills it (its new tokens over a cached context) also carries the running decodes.
For each model, context C (--contexts) and decode-row count R: R requests of C tokens are
decoding, then every round adds one hop (the first request's C tokens, cached, plus
--new-tokens fresh ones, max_tokens 1) and times the one step that prefills it. The two
sides differ only in ``ModelRunner.native_mixed_steps`` (the split's context threshold set
to 0, so every cell measures the split itself; the engine's threshold,
NATIVE_MIXED_MIN_CONTEXT, comes from the small cells); they alternate --rounds times (order reversed
every other round) after a warm-up. A figure is the median (min-max) over rounds, a ratio
the median of the rounds' own ratios (the box's speed drifts; a pair shares a moment). A
decode-only step of the same R rows (native either way) is timed beside them for scale.
Writes benchmarks/results/mixed_steps.md and mixed_steps.png.
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
from benchmarks.packed_gemm import alternate, ratio, summary  # noqa: E402
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
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per cell, sides alternating (default: 7)")
    p.add_argument("--threads", type=int, default=2, help="torch and native threads (default: 2)")
    p.add_argument("--cache-dir", type=Path, default=ROOT / ".weft" / "models",
                   help="where generated preset checkpoints are kept between runs")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results",
                   help="where mixed_steps.md and mixed_steps.png go")
    return p.parse_args(argv)


def cell(engine: LLMEngine, rows: int, context: int, args, tag: str) -> tuple[list[float], list[float], list[float]]:
    """(on ms, off ms, decode-only ms) per round for ``rows`` requests of ``context`` tokens."""
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
    engine.runner.native_mixed_min_context = 0  # split every mixed step: the threshold is what this measures

    def mixed(on: bool):
        def run() -> None:
            engine.runner.native_mixed_steps = on
            fresh = torch.randint(0, vocab, (args.new_tokens,), generator=gen).tolist()
            engine.add_request(f"{tag}-h{next(counter)}", prompts[0] + fresh, hop)
            engine.step()  # prefills the hop (its prefix cached) beside the decodes; it ends there
            assert len(engine.scheduler.running) == rows, "the hop did not finish in its step"
        return run

    t_on, t_off = alternate(mixed(True), mixed(False), args.rounds)
    engine.runner.native_mixed_steps = True
    engine.runner.native_mixed_min_context = NATIVE_MIXED_MIN_CONTEXT
    decode_only = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        engine.step()
        decode_only.append(time.perf_counter() - start)
    for i in range(rows):
        engine.abort_request(f"{tag}-d{i}")
    return [t * 1e3 for t in t_on], [t * 1e3 for t in t_off], [t * 1e3 for t in decode_only]


def write(args, cells: list[tuple]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu = cpu_name()
    argv = " ".join(shlex.quote(a) for a in sys.argv[1:])
    lines = [
        "# Mixed steps: decodes natively beside a hop's prefill",
        "",
        f"`python benchmarks/mixed_steps.py {argv}` on {cpu}, {args.threads} threads, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. One step prefilling a hop ({args.new_tokens} "
        f"fresh tokens over a cached prefix of C tokens) while R requests of C tokens decode: the decodes "
        "through the native step and the prefill through the model (*native*, now), "
        "or the whole step through the model (*model*, before). The two alternate in one process after a "
        "warm-up; median (min–max) over the rounds, ratios the median of the rounds' own ratios (higher: "
        "native faster). *decode only*: a step of the same R rows without the hop, for scale.",
        "",
        "| model | C | R | native ms | model ms | model / native | decode only ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for spec, context, rows, on, off, dec in cells:
        lines.append(f"| {spec} | {context} | {rows} | {summary(on)} | {summary(off)} | "
                     f"{ratio([b / a for a, b in zip(on, off)])} | {summary(dec)} |")
    lines += ["", "![mixed_steps](mixed_steps.png)", ""]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "mixed_steps.md").write_text("\n".join(lines))

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{s.split('-')[0]}\nC={c}\nR={r}" for s, c, r, *_ in cells]
    x = range(len(cells))
    ax.bar([i - 0.2 for i in x], [statistics.median(c[3]) for c in cells], 0.4, label="native (split)")
    ax.bar([i + 0.2 for i in x], [statistics.median(c[4]) for c in cells], 0.4, label="model (one pass)")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("ms per mixed step (median)")
    ax.set_title(f"a hop's prefill ({args.new_tokens} new tokens over C cached) beside R decodes of C")
    ax.legend()
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
                    cells.append((spec, context, rows, *cell(engine, rows, context, args, f"{spec}-{context}-{rows}")))
                    bar.update()
            del engine
    write(args, cells)


if __name__ == "__main__":
    main()
