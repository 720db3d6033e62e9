"""n copies of one prompt arriving together: the in-batch prefix check against computing
every copy side by side (what the executor did before, and what vLLM does).

NOTE: what is measured. One engine per model (LLMEngine, the executor's own, fp32, the
executor's OpenMP settings), prefix caching on. A case puts n requests with the same
--prompt-len random prompt (fresh ids every run, so nothing is cached before it) into the
engine at once and steps until all are done, greedy, --max-tokens each. Two figures per
case: the time until the LAST copy's first token (what the slowest of the n waits) and the
time until all are done. "check" is the default scheduler; "side by side" the same engine
with ``BatchScheduler.in_batch_prefix_check`` off. The two alternate, order reversed every
other round, after one warm-up round; median (min-max) over --rounds rounds; the speed-up
is taken per round. Also counted: prompt tokens computed (prompt tokens minus cached ones).
Writes benchmarks/results/in_batch_prefix.md and .png.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.executor.process_env import apply_executor_env  # noqa: E402

apply_executor_env()  # the executor's OpenMP settings, before torch loads

from tqdm.auto import tqdm  # noqa: E402

from benchmarks.step_overhead import model_dir_for  # noqa: E402
from services.executor.engine.config import EngineConfig  # noqa: E402
from services.executor.engine.engine import LLMEngine  # noqa: E402
from services.executor.engine.sampling_params import SamplingParams  # noqa: E402

MODES = ("check", "side by side")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "bench"],
                   help="presets (bench, ...) or real models (default: smollm2-135m-instruct bench)")
    p.add_argument("--n", type=int, nargs="+", default=[2, 4, 8], help="copies of the prompt (default: 2 4 8)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (default: 512)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per copy (default: 16)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds, modes alternating (default: 3)")
    p.add_argument("--cache-dir", type=Path, default=ROOT / ".weft" / "models",
                   help="where generated preset checkpoints are kept between runs")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results", help="where the .md/.png go")
    return p.parse_args(argv)


def run_case(engine: LLMEngine, mode: str, n: int, args, rng: random.Random) -> tuple[float, float, int]:
    """(s to the last copy's first token, s to all done, prompt tokens computed)."""
    engine.scheduler.in_batch_prefix_check = mode == "check"
    vocab = engine.model.config.vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i in range(n):
        engine.add_request(f"{mode}-{time.monotonic_ns()}-{i}", list(prompt), params)
    first: dict[str, float] = {}
    computed = 0
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.request_id not in first and out.new_token_ids:
                first[out.request_id] = time.perf_counter() - start
                computed += out.num_prompt_tokens - out.num_cached_tokens
    return max(first.values()), time.perf_counter() - start, computed


def fmt(values: list[float], scale: float = 1000.0, digits: int = 0) -> str:
    return (f"{statistics.median(values) * scale:.{digits}f} "
            f"({min(values) * scale:.{digits}f}–{max(values) * scale:.{digits}f})")


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows, chart = [], {}
    rng = random.Random(0)
    total = len(args.models) * len(args.n) * (args.rounds + 1) * len(MODES)
    with tqdm(total=total, desc="in-batch prefix", unit="run") as bar:
        for model in args.models:
            engine = LLMEngine(str(model_dir_for(model, args.cache_dir)), EngineConfig())
            for n in args.n:
                res = {m: [] for m in MODES}
                for r in range(args.rounds + 1):  # round 0: warm-up
                    for mode in (MODES if r % 2 else MODES[::-1]):
                        out = run_case(engine, mode, n, args, rng)
                        if r:
                            res[mode].append(out)
                        bar.update(1)
                check, side = res["check"], res["side by side"]
                speed_ttft = [s[0] / c[0] for c, s in zip(check, side)]
                speed_all = [s[1] / c[1] for c, s in zip(check, side)]
                rows.append(f"| {model} | {n} | {fmt([c[0] for c in check])} | {fmt([s[0] for s in side])} | "
                            f"{fmt(speed_ttft, 1, 2)}× | {fmt([c[1] for c in check])} | {fmt([s[1] for s in side])} | "
                            f"{fmt(speed_all, 1, 2)}× | {check[0][2]} / {side[0][2]} |")
                chart[f"{model.split('-')[0]} n={n}"] = statistics.median(speed_ttft)
    md = [
        "# n copies of one prompt: the in-batch prefix check",
        "",
        f"Command: `python benchmarks/in_batch_prefix.py {' '.join(sys.argv[1:] if argv is None else argv)}`. "
        f"{args.prompt_len}-token prompt, {args.max_tokens} tokens per copy, greedy, fp32, one engine per model "
        f"(the executor's LLMEngine); median (min–max) of {args.rounds} rounds, modes alternating after a warm-up. "
        "\"check\": the default scheduler; \"side by side\": the check off (every copy computes the prompt). "
        "Speed-up: side by side ÷ check, per round.",
        "",
        "| model | n | last first token ms, check | side by side | speed-up | all done ms, check | side by side "
        "| speed-up | prompt tokens computed, check / side by side |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows, "", "![in_batch_prefix](in_batch_prefix.png)", "",
    ]
    (args.out_dir / "in_batch_prefix.md").write_text("\n".join(md))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(list(chart), list(chart.values()), color="#3b7dd8")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("last copy's TTFT: side by side ÷ check")
    ax.set_title(f"n copies of a {args.prompt_len}-token prompt")
    fig.tight_layout()
    fig.savefig(args.out_dir / "in_batch_prefix.png", dpi=110)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
