"""Constrained decoding cost on SmolLM2-135M-Instruct (CPU, in-process LLMEngine).

Per decode step, the grammar mask (one batched xgrammar bitmask fill + an in-place
apply over the constrained rows) is timed by its own histogram
(weft_executor_grammar_mask_seconds); decode throughput is measured with and without a
json_schema constraint at batch 1 and batch 8. After one warm-up of each mode, rounds
alternate constrained / unconstrained so drift in the machine hits both alike; the
report gives the median and range over the rounds. Also measured: the schema's compile
time on a cache miss.

Decode throughput counts the tokens of the steps after the first (the first step
prefills every prompt) over their wall time. Free requests ignore EOS; constrained ones
stop when the JSON closes, at most --max-tokens either way.
Writes benchmarks/results/constrained_decoding.md and constrained_decoding.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tqdm.auto import tqdm  # noqa: E402

from benchmarks.report import write_bar_chart, write_markdown  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
    "city": {"type": "string", "maxLength": 24}, "hobbies": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "city", "hobbies"]}
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 3}},
          "required": ["people"]}
PROMPT = "List three people (name, age, city, hobbies) as JSON."


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="checkpoint directory or named model (default: smollm2-135m-instruct)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default: 1; on a shared machine more threads spin and stall)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8],
                   help="concurrent requests per measurement (default: 1 8)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request at most (default: 64)")
    p.add_argument("--rounds", type=int, default=5,
                   help="timed rounds per mode and batch size, alternating modes (default: 5, at least 3)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results", help="where results are written")
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error("--rounds must be at least 3 (median and range)")
    return args


def mask_totals() -> tuple[float, float]:
    """(seconds, steps) the grammar mask has recorded so far in this process."""
    from services.executor.grammar.mask import MASK_SECONDS

    samples = {s.name: s.value for metric in MASK_SECONDS.collect() for s in metric.samples}
    return samples["weft_executor_grammar_mask_seconds_sum"], samples["weft_executor_grammar_mask_seconds_count"]


def one_round(engine, prompt: list[int], batch: int, params, tag: str) -> dict:
    """Run ``batch`` copies to completion; decode tok/s after the first step and the mean
    mask ms per constrained step."""
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", prompt, params)
    engine.step()  # prefill of every prompt (and each one's first token)
    sum0, n0 = mask_totals()
    tokens, start = 0, time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests:
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    wall = time.perf_counter() - start
    sum1, n1 = mask_totals()
    return {"tok_s": tokens / wall, "step_ms": wall / steps * 1e3,
            "mask_ms": (sum1 - sum0) / (n1 - n0) * 1e3 if n1 > n0 else 0.0}


def measure(args) -> tuple[dict, float, str]:
    from tokenizers import Tokenizer

    from services.executor.engine.config import EngineConfig
    from services.executor.engine.engine import LLMEngine
    from services.executor.engine.sampling_params import GrammarSpec, SamplingParams
    from services.executor.grammar import GrammarCache, load_tokenizer_info
    from weft.models.sources import resolve_model

    model_dir = resolve_model(args.model, progress=False)
    engine = LLMEngine(model_dir, EngineConfig(num_threads=args.threads, num_kv_blocks=512))
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompt = tokenizer.encode(f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n").ids
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    cfg = engine.model_config
    fresh = GrammarCache(load_tokenizer_info(model_dir, cfg.vocab_size, cfg.eos_token_ids))
    t0 = time.perf_counter()
    fresh.get(spec)
    compile_ms = (time.perf_counter() - t0) * 1e3
    fresh.close()
    modes = {"unconstrained": SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
             "json_schema": SamplingParams(max_tokens=args.max_tokens, temperature=0.0, grammar=spec)}
    results: dict = {}
    total = len(args.batch_sizes) * (1 + args.rounds) * len(modes)
    with tqdm(total=total, desc="constrained decoding") as bar:
        for batch in args.batch_sizes:
            for mode, params in modes.items():  # warm-up, not recorded
                one_round(engine, prompt, batch, params, f"warm-{mode}-{batch}")
                bar.update(1)
            for r in range(args.rounds):
                for mode, params in modes.items():
                    results.setdefault((mode, batch), []).append(one_round(engine, prompt, batch, params,
                                                                           f"{mode}-{batch}-{r}"))
                    bar.update(1)
    engine.add_request("sample", prompt, modes["json_schema"])  # one constrained output for the report
    out: list[int] = []
    while engine.has_unfinished_requests:
        for o in engine.step():
            out.extend(o.new_token_ids)
    return results, compile_ms, tokenizer.decode(out)


def summary(runs: list[dict], key: str) -> tuple[float, float, float]:
    values = [r[key] for r in runs]
    return statistics.median(values), min(values), max(values)


def report(args, results: dict, compile_ms: float, sample: str) -> None:
    import platform
    from importlib.metadata import version

    import torch

    fmt = lambda m: f"{m[0]:.2f} ({m[1]:.2f}–{m[2]:.2f})"  # noqa: E731
    rows = []
    for batch in args.batch_sizes:
        free, cons = results[("unconstrained", batch)], results[("json_schema", batch)]
        free_tps, cons_tps = summary(free, "tok_s"), summary(cons, "tok_s")
        mask, step = summary(cons, "mask_ms"), summary(cons, "step_ms")
        rows.append([batch, fmt(free_tps), fmt(cons_tps), f"{(cons_tps[0] / free_tps[0] - 1) * 100:+.1f}%",
                     fmt(mask), fmt(step), f"{mask[0] / step[0] * 100:.1f}%"])
    table = write_markdown(["batch", "free tok/s", "json_schema tok/s", "change", "mask ms/step",
                            "constrained step ms", "mask share"], rows)
    md = f"""# Constrained decoding cost

`python benchmarks/constrained_decoding.py` — {args.model}, CPU ({platform.processor() or platform.machine()},
{args.threads} torch threads), torch {torch.__version__}, xgrammar {version('xgrammar')}; greedy, at most
{args.max_tokens} new tokens; {args.rounds} timed rounds per cell after a warm-up, constrained and free rounds
alternating. Median (min–max) over the rounds.

Decode only (the steps after the one that prefills every prompt). "mask ms/step" is the
grammar's own cost per step (one batched bitmask fill for all constrained rows + the
in-place apply), read from `weft_executor_grammar_mask_seconds`; a step without a
constrained row pays nothing (the mask is not called).

{table}

Compiling the schema (cache miss, once per distinct schema): {compile_ms:.1f} ms.

Schema: an object with `people`, an array of at least 3 person objects (name, age,
city, hobbies). A constrained sample output:

```
{sample}
```
"""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "constrained_decoding.md").write_text(md)
    groups = [f"batch {b}" for b in args.batch_sizes]
    series = {mode: [summary(results[(mode, b)], "tok_s")[0] for b in args.batch_sizes]
              for mode in ("unconstrained", "json_schema")}
    write_bar_chart(args.out_dir / "constrained_decoding.png",
                    f"Decode throughput with and without a json_schema ({args.model}, CPU)", groups, series)
    print(md)


def main(argv=None) -> None:
    args = parse_args(argv)
    results, compile_ms, sample = measure(args)
    report(args, results, compile_ms, sample)


if __name__ == "__main__":
    main()
