"""What each rung of the degradation ladder costs in quality, and what it buys in capacity.

For a fixed set of held-out prompts, the undegraded engine's greedy continuation is the
reference; each rung generates the same prompts greedily and is scored against it:

  token agreement     share of generated positions where the rung's token equals the
                      reference's (position by position; a divergence costs every
                      position after it whose token then differs)
  first divergence    mean index of the first token that differs (N when none does)
  identical           share of prompts whose whole continuation is identical
  KV capacity         tokens of context one byte of KV memory holds, relative to the
                      undegraded engine (int8: the pool's block count for the same bytes;
                      compress: a sequence's blocks without / with the budget; smaller
                      model: KV bytes per token of the two models)
  tok/s               whole-batch generation throughput, best of two runs, prefix caching
                      off (so both runs do the same work), same threads

Rungs (one executor profile each, see docs/architecture.md):

  none           the main model, float32 KV
  kv_int8        same model, int8 KV (one scale per token and KV head)
  kv_compress    same model, at most --compress-budget blocks per sequence (sinks +
                 heavy hitters + recent window)
  kv_compress_oldest  the same budget, policy "oldest" (StreamingLLM: sinks + a sliding
                 window, no attention scores): the ablation that shows what the
                 heavy-hitter scores are worth
  smaller_model  a smaller model trained on the same text with the same tokenizer

The models are small Llamas trained here for a few hundred steps (benchmarks/
degradation_models.py says why): a random-weight model's flat logits would make every
rung look broken. Writes benchmarks/results/degradation.md and degradation.png.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", type=Path, default=ROOT / ".weft" / "models" / "degradation",
                   help="where the trained checkpoints are cached (default: .weft/models/degradation)")
    p.add_argument("--train-steps", type=int, default=None,
                   help="training steps of each model (default: 400 each; fewer for a quick look)")
    p.add_argument("--num-prompts", type=int, default=16, help="held-out prompts (default: 16)")
    p.add_argument("--prompt-len", type=int, default=192, help="tokens per prompt (default: 192)")
    p.add_argument("--output-len", type=int, default=64, help="greedy tokens per prompt (default: 64)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size of every engine (default: 16)")
    p.add_argument("--compress-budget", type=int, default=8,
                   help="kv_compress: most blocks a sequence keeps (default: 8, about half of a "
                        "192 + 64 token sequence)")
    p.add_argument("--compress-recent", type=int, default=4,
                   help="kv_compress: newest blocks always kept (default: 4)")
    p.add_argument("--kv-bytes", type=int, default=64 * 1024 * 1024,
                   help="KV cache bytes of every engine, for the capacity column (default: 64 MiB)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    p.add_argument("--out", type=Path, default=RESULTS / "degradation.md",
                   help="Markdown table to write (default: benchmarks/results/degradation.md); the PNG "
                        "goes beside it")
    return p.parse_args(argv)


@dataclass
class RungResult:
    rung: str
    outputs: list[list[int]]
    seconds: float
    kv_capacity: float
    note: str = ""


def agreement(reference: list[list[int]], outputs: list[list[int]]) -> tuple[float, float, float]:
    """(positional token agreement, mean first divergence, share identical)."""
    same = total = 0
    firsts, identical = [], 0
    for ref, out in zip(reference, outputs):
        n = len(ref)
        same += sum(a == b for a, b in zip(ref, out))
        total += n
        first = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(n, len(out)))
        firsts.append(first)
        identical += out == ref
    return same / max(total, 1), sum(firsts) / max(len(firsts), 1), identical / max(len(reference), 1)


def run_rung(name: str, model_dir: Path, prompts, args, **options) -> tuple[list[list[int]], float, object]:
    import torch

    from weft import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(str(model_dir), block_size=args.block_size, kv_cache_memory_bytes=args.kv_bytes,
              max_num_seqs=len(prompts), enable_prefix_caching=False, **options)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
    seconds = float("inf")
    for _ in range(2):  # best of two: the first run also pays one-off warm-up costs
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = min(seconds, time.perf_counter() - start)
    return [list(o.token_ids) for o in outs], seconds, llm.engine


def kv_bytes_per_token(engine) -> float:
    return engine.config.kv_cache_memory_bytes / (engine.num_blocks * engine.config.block_size)


def measure(args) -> tuple[list[RungResult], dict]:
    from tqdm.auto import tqdm

    from benchmarks.degradation_models import MAIN, SMALLER, held_out_loss, held_out_prompts, train_checkpoint

    specs = [MAIN, SMALLER]
    if args.train_steps is not None:
        specs = [replace(s, steps=args.train_steps) for s in specs]
    main_dir, small_dir = (train_checkpoint(s, args.cache_dir, progress=tqdm) for s in specs)
    prompts = held_out_prompts(main_dir, args.num_prompts, args.prompt_len)
    if len(prompts) < args.num_prompts:
        raise SystemExit(f"only {len(prompts)} held-out prompts of {args.prompt_len} tokens exist")

    seq_blocks = -(-(args.prompt_len + args.output_len) // args.block_size)
    plan = [
        ("none", main_dir, {}),
        ("kv_int8", main_dir, {"kv_cache_dtype": "int8"}),
        ("kv_compress", main_dir, {"kv_compress_budget_blocks": args.compress_budget,
                                   "kv_compress_recent_blocks": args.compress_recent}),
        ("kv_compress_oldest", main_dir, {"kv_compress_budget_blocks": args.compress_budget,
                                          "kv_compress_recent_blocks": args.compress_recent,
                                          "kv_compress_policy": "oldest"}),
        ("smaller_model", small_dir, {}),
    ]
    results: list[RungResult] = []
    base_bpt = None
    for name, model_dir, options in tqdm(plan, desc="rungs", unit="rung"):
        outputs, seconds, engine = run_rung(name, model_dir, prompts, args, **options)
        bpt = kv_bytes_per_token(engine)
        base_bpt = base_bpt or bpt
        capacity, note = base_bpt / bpt, ""
        if name.startswith("kv_compress"):
            capacity = seq_blocks / args.compress_budget
            note = f"{engine.num_compressed_blocks} blocks dropped"
        elif name == "kv_int8":
            note = f"{engine.num_blocks} vs {int(args.kv_bytes // base_bpt // args.block_size)} blocks"
        results.append(RungResult(name, outputs, seconds, capacity, note))
    windows = held_out_prompts(main_dir, args.num_prompts, args.prompt_len + args.output_len)
    info = {"main": main_dir, "smaller": small_dir, "seq_blocks": seq_blocks,
            "loss": {"main": held_out_loss(main_dir, windows), "smaller": held_out_loss(small_dir, windows)}}
    return results, info


def render(results: list[RungResult], info: dict, args) -> str:
    import json

    from benchmarks.report import write_markdown

    reference = results[0].outputs
    tokens = args.num_prompts * args.output_len
    rows = []
    for r in results:
        agree, first, identical = agreement(reference, r.outputs)
        rows.append([r.rung, f"{100 * agree:.1f} %", f"{first:.1f} / {args.output_len}",
                     f"{100 * identical:.0f} %", f"{r.kv_capacity:.2f}x", f"{tokens / r.seconds:,.0f}",
                     r.note or "-"])
    losses = {k: json.loads((info[k] / "trained.json").read_text()) for k in ("main", "smaller")}
    desc = ", ".join(f"{k}: {v['hidden_size']} hidden x {v['num_hidden_layers']} layers, {v['steps']} steps, "
                     f"held-out loss {info['loss'][k]:.2f}" for k, v in losses.items())
    return "\n".join([
        "# Degradation ladder: quality cost and capacity of each rung",
        "",
        f"`python benchmarks/degradation.py` — {args.num_prompts} held-out prompts of {args.prompt_len} "
        f"tokens (standard-library source the models never trained on), {args.output_len} greedy tokens "
        f"each, block size {args.block_size}, {args.threads} threads. Models trained here ({desc}). "
        f"kv_compress keeps {args.compress_budget} of a sequence's {info['seq_blocks']} blocks "
        f"(1 sink + {args.compress_recent} recent + heavy hitters).",
        "",
        write_markdown(["rung", "token agreement", "first divergence", "identical", "KV capacity",
                        "tok/s", "note"], rows),
        "",
        "Agreement is against the undegraded engine's greedy output (the first row, 100 % by "
        "definition). Greedy continuations compound: one flipped token changes everything after it, "
        "so 'first divergence' is the gentler reading and 'token agreement' the harsher.",
        "",
    ])


def plot(results: list[RungResult], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reference = results[0].outputs
    names = [r.rung for r in results]
    agree = [100 * agreement(reference, r.outputs)[0] for r in results]
    capacity = [r.kv_capacity for r in results]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.bar(names, agree, color="tab:blue")
    a1.bar_label(a1.containers[0], fmt="%.0f%%", fontsize=8)
    a1.set_ylabel("greedy token agreement with 'none' (%)")
    a1.set_ylim(0, 105)
    a2.bar(names, capacity, color="tab:green")
    a2.bar_label(a2.containers[0], fmt="%.2fx", fontsize=8)
    a2.set_ylabel("KV capacity vs 'none'")
    for ax in (a1, a2):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle("Degradation rungs: quality cost vs capacity gained")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results, info = measure(args)
    text = render(results, info, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    plot(results, args, args.out.with_suffix(".png"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
