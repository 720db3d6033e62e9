"""What every degradation measurement shares: running one rung and scoring it against the
reference."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class RungResult:
    """One rung's greedy outputs (prompt order), its throughput run, and what it buys."""

    rung: str
    outputs: list[list[int]]
    seconds: float
    kv_capacity: float
    note: str = ""
    perplexity: float | None = None  # held-out, teacher-forced through this rung's engine


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


def run_rung(model_dir: Path, prompts: list[list[int]], args, repeats: int = 2, **options):
    """(greedy outputs, best wall seconds of ``repeats`` runs, the LLM) for one rung:
    ``options`` are the rung's engine options. Prefix caching is off so every run does
    the same work."""
    import torch

    from weft import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(str(model_dir), block_size=args.block_size, kv_cache_memory_bytes=args.kv_bytes,
              max_num_seqs=max(len(prompts), getattr(args, "num_windows", 0)), enable_prefix_caching=False,
              **options)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
    seconds = float("inf")
    for _ in range(repeats):  # best of: the first run also pays one-off warm-up costs
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = min(seconds, time.perf_counter() - start)
    return [list(o.token_ids) for o in outs], seconds, llm


def kv_bytes_per_token(engine) -> float:
    return engine.config.kv_cache_memory_bytes / (engine.num_blocks * engine.config.block_size)
