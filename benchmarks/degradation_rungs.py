"""What every degradation measurement shares: running one rung, scoring it against the
reference, and writing a generated section into a results page that also holds prose."""
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


def replace_section(path: Path, name: str, text: str, title: str) -> None:
    """Write ``text`` between the ``generated:name`` markers of ``path`` (appended when the
    page has none; the page is created with ``title`` when missing), leaving the prose
    around it alone: a rerun refreshes its numbers without clobbering the reading."""
    begin, end = f"<!-- generated:{name} begin -->", f"<!-- generated:{name} end -->"
    block = f"{begin}\n{text.rstrip()}\n{end}"
    page = path.read_text(encoding="utf-8") if path.exists() else f"{title}\n"
    if begin in page and end in page:
        head, rest = page.split(begin, 1)
        page = head + block + rest.split(end, 1)[1]
    else:
        page = page.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
