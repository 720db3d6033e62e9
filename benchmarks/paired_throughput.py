"""Weft vs transformers ``generate`` on the same weights, interleaved
(``offline_throughput.py --paired``).

NOTE: why interleaved rounds and not best-of per engine. On a small shared machine the
speed of the CPU drifts between minutes (other work, frequency); measuring one engine
after the other lets the drift land on one side. Here each round runs both engines back
to back on the same prompts, the order flipping every round, after one untimed warm-up
run of each; the report gives the median and the range over the rounds, and the ratio's
median and range over the rounds' own ratios (a ratio of two numbers measured seconds
apart).

Workloads, both greedy with EOS ignored so both engines produce the same tokens:
  batch-1   one request, --input-len prompt tokens, --output-len new tokens
  uniform   --num-prompts concurrent requests of the same shape
Models: the bench preset (random weights, 8 wide layers) next to a real model
(SmolLM2-135M-Instruct: 30 thin layers, where per-op overhead weighs more).
Writes benchmarks/results/offline_throughput_paired.md and .png.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.results_page import replace_section

PRESETS = ("tiny", "small", "bench")
TITLE = "# Offline throughput on a real model: Weft vs transformers, interleaved"


@dataclass
class Series:
    """Seconds of each timed round of one engine on one workload."""

    tokens: int
    seconds: list[float] = field(default_factory=list)

    def rates(self) -> list[float]:
        return [self.tokens / s for s in self.seconds]


def checkpoint(spec: str, cache_dir: Path) -> Path:
    """A preset name → the generated random-weight checkpoint; anything else → a real model."""
    if spec in PRESETS:
        from weft.testing.tiny_model import make_tiny_checkpoint

        model_dir = cache_dir / f"{spec}-llama"
        if not (model_dir / "config.json").exists():
            make_tiny_checkpoint(model_dir, preset=spec, arch="llama")
        return model_dir
    from benchmarks.real_model import resolve_checkpoint

    return resolve_checkpoint(spec)


def uniform_prompts(vocab: int, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids, the same for every engine and run
    (content does not change the work when EOS is ignored)."""
    rng = random.Random(0)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


def engines(model_dir: Path, args) -> tuple[dict, int]:
    """(name → fn(prompts) that generates ``args.output_len`` greedy tokens for each prompt,
    the model's parameter count)."""
    from transformers import AutoModelForCausalLM

    from weft import LLM, SamplingParams

    llm = LLM(model_dir, num_threads=args.threads, max_num_batched_tokens=2048, max_prefill_chunk=512)
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    def weft(prompts):
        llm.engine.pool.reset_prefix_cache()  # every run computes its prompts
        llm.generate(prompts, sp, use_tqdm=False)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def hf(prompts):  # same length prompts: no padding
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                           min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)

    return {"weft": weft, "hf-generate": hf}, sum(p.numel() for p in model.parameters())


def measure_model(spec: str, args, bar) -> tuple[dict, dict]:
    """({(engine, workload): Series}, model facts) for one model."""
    from services.executor.model.config import ModelConfig

    model_dir = checkpoint(spec, args.cache_dir)
    config = ModelConfig.from_dir(model_dir)
    uniform = uniform_prompts(config.vocab_size, args.num_prompts, args.input_len)
    workloads = {"batch-1": uniform[:1], f"{args.num_prompts} concurrent": uniform}
    runners, params = engines(model_dir, args)
    series = {(e, w): Series(len(p) * args.output_len) for e in runners for w, p in workloads.items()}
    for w, prompts in workloads.items():  # warm-up, untimed
        for fn in runners.values():
            fn(prompts)
    for r in range(args.rounds):
        order = list(runners) if r % 2 == 0 else list(reversed(runners))
        for w, prompts in workloads.items():
            for e in order:
                t0 = time.perf_counter()
                runners[e](prompts)
                series[(e, w)].seconds.append(time.perf_counter() - t0)
                bar.update(1)
    facts = {"name": spec, "layers": config.num_hidden_layers, "hidden": config.hidden_size, "params": params}
    return series, facts


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def report(per_model: list[tuple[dict, dict]], args) -> str:
    from benchmarks.report import write_markdown

    rows = []
    for series, facts in per_model:
        for w in dict.fromkeys(k[1] for k in series):
            weft, hf = series[("weft", w)].rates(), series[("hf-generate", w)].rates()
            ratios = [a / b for a, b in zip(weft, hf)]
            rows.append([f"{facts['name']} ({facts['params'] / 1e6:.1f}M, {facts['layers']} × {facts['hidden']})",
                         w, spread(weft), spread(hf), spread(ratios, "{:.2f}×")])
    return "\n".join([
        f"`python benchmarks/offline_throughput.py --paired {' '.join(args.paired_models)}` — "
        f"float32, {args.threads} threads, {args.input_len} prompt tokens / {args.output_len} new tokens per "
        f"request (greedy, EOS ignored), transformers `generate` (static batch, same prompts, same "
        f"weights). One untimed warm-up run of each, then {args.rounds} rounds, each running both engines "
        "back to back, order flipped every round. Output tokens per second (prompt time included): "
        "median (min–max over the rounds); the ratio's median and range are over the rounds' own ratios.",
        "",
        write_markdown(["model", "workload", "weft tok/s", "transformers tok/s", "weft / transformers"], rows),
        "",
        "![paired](offline_throughput_paired.png)",
    ])


def plot(per_model: list[tuple[dict, dict]], path: Path) -> None:
    from benchmarks.report import write_bar_chart

    groups, series = [], {"weft": [], "hf-generate": []}
    for s, facts in per_model:
        for w in dict.fromkeys(k[1] for k in s):
            groups.append(f"{facts['name'].removesuffix('-instruct')}\n{w}")  # short: labels share a row
            for e in series:
                series[e].append(statistics.median(s[(e, w)].rates()))
    write_bar_chart(path, title="Output tokens/s, median of interleaved rounds (higher is better)",
                    groups=groups, series=series)


def main(args) -> int:
    from tqdm.auto import tqdm

    torch.set_num_threads(args.threads)
    per_model = []
    with tqdm(total=len(args.paired_models) * args.rounds * 4, desc="paired throughput", unit="run") as bar:
        for spec in args.paired_models:
            per_model.append(measure_model(spec, args, bar))
    text = report(per_model, args)
    replace_section(args.out_dir / "offline_throughput_paired.md", "paired", text, TITLE)
    plot(per_model, args.out_dir / "offline_throughput_paired.png")
    print(text)
    return 0
