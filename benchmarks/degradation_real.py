"""The degradation ladder on a real model (``degradation.py --model smollm2-135m-instruct``).

Each rung is one engine over the same weights; two measurements per rung:

  perplexity     held-out, teacher-forced *through the rung's engine* (teacher_forcing.py):
                 Python's documentation windows (real_model.py), the first
                 --ppl-prompt-len tokens as the prompt, every later token scored while the
                 engine decodes it, so int8 rounding and dropped blocks both count
  agreement      greedy continuations of --prompt-len-token prompts (the same windows'
                 openings) against the undegraded engine's, as for the trained models

Rungs: none, kv_int8, and kv_compress keeping 1/2 and 1/4 of a window's blocks, each with
the attention-mass policy and the oldest-first ablation. No smaller_model rung: SmolLM2-135M
is the smallest real model in the project's reach (the trained pair in
degradation_models.py measures that rung).
"""
from __future__ import annotations

import gc
from pathlib import Path

from benchmarks.degradation_rungs import RungResult, agreement, kv_bytes_per_token, run_rung

COMPRESS_FRACTIONS = (2, 4)  # keep 1/2, then 1/4 of a window's blocks


def rung_plan(seq_blocks: int) -> list[tuple[str, dict]]:
    """(rung name, engine options): compress budgets are fractions of ``seq_blocks``, with
    one sink block and half the budget as the recent window."""
    plan = [("none", {}), ("kv_int8", {"kv_cache_dtype": "int8"})]
    for frac in COMPRESS_FRACTIONS:
        budget = seq_blocks // frac
        common = {"kv_compress_budget_blocks": budget, "kv_compress_recent_blocks": max(1, budget // 2)}
        plan.append((f"kv_compress 1/{frac}", common))
        plan.append((f"kv_compress_oldest 1/{frac}", {**common, "kv_compress_policy": "oldest"}))
    return plan


def measure(args) -> tuple[list[RungResult], dict]:
    from tqdm.auto import tqdm

    from benchmarks.real_model import pydoc_windows, resolve_checkpoint, transformers_perplexity
    from benchmarks.teacher_forcing import engine_perplexity

    model_dir = resolve_checkpoint(args.model)
    length = args.prompt_len + args.output_len
    text = pydoc_windows(model_dir, max(args.num_prompts, args.num_windows), length)
    prompts = [w[:args.prompt_len] for w in text.windows[:args.num_prompts]]
    windows = text.windows[:args.num_windows]
    seq_blocks = -(-length // args.block_size)
    results: list[RungResult] = []
    base_bpt = None
    for name, options in tqdm(rung_plan(seq_blocks), desc="rungs", unit="rung"):
        outputs, seconds, llm = run_rung(model_dir, prompts, args, repeats=args.repeats, **options)
        engine = llm.engine
        bpt = kv_bytes_per_token(engine)
        base_bpt = base_bpt or bpt
        capacity, note = base_bpt / bpt, ""
        if name == "kv_int8":
            note = f"{engine.num_blocks} vs {int(args.kv_bytes // base_bpt // args.block_size)} blocks"
        if options.get("kv_compress_budget_blocks"):
            budget = options["kv_compress_budget_blocks"]
            capacity = seq_blocks / budget
            note = (f"keeps {budget} of {seq_blocks} blocks (1 sink + {options['kv_compress_recent_blocks']} "
                    f"recent)")
        perplexity = engine_perplexity(llm, windows, args.ppl_prompt_len)
        results.append(RungResult(name, outputs, seconds, capacity, note, perplexity))
        del llm, engine
        gc.collect()
    info = {"model_dir": model_dir, "text": text, "seq_blocks": seq_blocks,
            "hf_perplexity": transformers_perplexity(model_dir, windows, args.ppl_prompt_len)}
    return results, info


def render(results: list[RungResult], info: dict, args) -> str:
    from benchmarks.report import write_markdown

    reference, base_ppl = results[0].outputs, results[0].perplexity
    tokens = args.num_prompts * args.output_len
    rows = []
    for r in results:
        agree, first, identical = agreement(reference, r.outputs)
        rows.append([r.rung, f"{r.perplexity:.3f}", f"{100 * (r.perplexity / base_ppl - 1):+.1f} %",
                     f"{100 * agree:.1f} %", f"{first:.1f} / {args.output_len}", f"{100 * identical:.0f} %",
                     f"{r.kv_capacity:.2f}x", f"{tokens / r.seconds:,.0f}", r.note or "-"])
    scored = args.num_windows * (args.prompt_len + args.output_len - args.ppl_prompt_len)
    return "\n".join([
        f"## {Path(str(args.model)).stem}: real weights",
        "",
        f"`python benchmarks/degradation.py --model {args.model}` — model `{args.model}` "
        f"(float32 checkpoint imported from its GGUF). Held-out text: {info['text'].describe()}. "
        f"Perplexity: {args.num_windows} windows, the first {args.ppl_prompt_len} tokens as the prompt, "
        f"the other {scored} tokens scored teacher-forced through each rung's engine. Agreement: "
        f"{args.num_prompts} prompts (the windows' first {args.prompt_len} tokens), {args.output_len} "
        f"greedy tokens each. Block size {args.block_size} ({info['seq_blocks']} blocks per window), "
        f"{args.threads} threads, tok/s best of {args.repeats}.",
        "",
        write_markdown(["rung", "perplexity", "vs none", "token agreement", "first divergence", "identical",
                        "KV capacity", "tok/s", "note"], rows),
        "",
        f"Reference: transformers' teacher-forced float32 forward over the same tokens gives perplexity "
        f"{info['hf_perplexity']:.3f} (the `none` rung: {base_ppl:.3f}). smaller_model: not measured "
        "on real weights, SmolLM2-135M is the smallest real model in the project's reach.",
        "",
    ])


def plot(results: list[RungResult], model: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reference = results[0].outputs
    names = [r.rung for r in results]
    panels = [
        ("held-out perplexity (lower is better)", [r.perplexity for r in results], "tab:red", "%.2f"),
        ("greedy token agreement with 'none' (%)", [100 * agreement(reference, r.outputs)[0] for r in results],
         "tab:blue", "%.0f%%"),
        ("KV capacity vs 'none'", [r.kv_capacity for r in results], "tab:green", "%.2fx"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (label, values, color, fmt) in zip(axes, panels):
        ax.bar(names, values, color=color)
        ax.bar_label(ax.containers[0], fmt=fmt, fontsize=8)
        ax.set_ylabel(label)
        plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.suptitle(f"Degradation rungs on {model}: quality cost vs KV capacity gained")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
