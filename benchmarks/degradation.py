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
rung look broken. ``--model smollm2-135m-instruct`` (or any checkpoint directory / .gguf)
measures the ladder on real weights instead, held-out perplexity included
(degradation_real.py). Each model writes its own generated section of
benchmarks/results/degradation.md (the prose around it stays) and its own PNG.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.degradation_rungs import RungResult, agreement, kv_bytes_per_token, run_rung  # noqa: E402
from benchmarks.results_page import replace_section  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TRAINED = "trained"
TITLE = "# Degradation ladder: quality cost and capacity of each rung"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=TRAINED,
                   help="'trained' (default: the two small Llamas trained here) or a real model: a "
                        "checkpoint directory, a .gguf file or a named model (smollm2-135m-instruct)")
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
    p.add_argument("--kv-bytes", type=int, default=None,
                   help="KV cache bytes of every engine, for the capacity column (default: 64 MiB; "
                        "512 MiB for a real model, so every window fits without preemption)")
    p.add_argument("--num-windows", type=int, default=24,
                   help="real model: held-out windows of prompt-len + output-len tokens scored for "
                        "perplexity (default: 24)")
    p.add_argument("--ppl-prompt-len", type=int, default=64,
                   help="real model: tokens of each window given as the prompt; the rest are scored "
                        "(default: 64)")
    p.add_argument("--repeats", type=int, default=2, help="timed greedy runs per rung, best kept (default: 2)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    p.add_argument("--out", type=Path, default=RESULTS / "degradation.md",
                   help="Markdown page whose generated section for this model is (re)written "
                        "(default: benchmarks/results/degradation.md); the PNG goes beside it")
    args = p.parse_args(argv)
    if args.kv_bytes is None:
        args.kv_bytes = (64 if args.model == TRAINED else 512) * 1024 * 1024
    if args.model != TRAINED and not 0 < args.ppl_prompt_len < args.prompt_len + args.output_len:
        p.error("--ppl-prompt-len must be in (0, prompt-len + output-len)")
    return args


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
        outputs, seconds, llm = run_rung(model_dir, prompts, args, repeats=args.repeats, **options)
        engine = llm.engine
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
        "## Small Llamas trained here",
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
    if args.model == TRAINED:
        results, info = measure(args)
        text = render(results, info, args)
        plot(results, args, args.out.with_suffix(".png"))
        text += f"\n![{TRAINED}]({args.out.with_suffix('.png').name})\n"
        section = TRAINED
    else:
        from benchmarks import degradation_real

        results, info = degradation_real.measure(args)
        text = degradation_real.render(results, info, args)
        section = Path(str(args.model)).stem.lower()  # the named model, or the file / directory name
        png = args.out.with_name(f"{args.out.stem}_{section}.png")
        degradation_real.plot(results, str(args.model), png)
        text += f"\n![{section}]({png.name})\n"
    replace_section(args.out, section, text, TITLE)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
