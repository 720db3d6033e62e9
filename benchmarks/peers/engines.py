"""The in-process engines of the peer comparison, each timed two ways in one run.

Every run gives a ``Timing``: output tokens over prefill + decode, and the decode steps
alone (tokens made after every request's first token, over those steps' time), the split
``llama-batched-bench`` reports as ``t`` and ``t_tg``.

  weft          ``LLMEngine.add_request`` + ``step()`` until done, as ``LLM.generate`` does
                minus detokenizing; a step counts as decode once every request of the run
                has its first token (a request's first token ends its prefill).
  transformers  ``AutoModelForCausalLM.generate``, greedy, batch 1; a streamer stamps the
                time of each new token: decode = first new token to the end.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class Timing:
    """One generation run."""

    total_s: float  # prefill + decode, model load excluded
    output_tokens: int
    decode_s: float  # the decode steps only
    decode_tokens: int  # tokens those steps made

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.total_s

    @property
    def decode_tok_per_s(self) -> float:
        return self.decode_tokens / self.decode_s


Runner = Callable[[list[list[int]]], Timing]


def weft_runner(model_dir: Path, *, threads: int, output_len: int):
    """(the ``weft.LLM``, fn(prompts) -> Timing) with the engine settings of the other benchmarks."""
    from weft import LLM, SamplingParams

    llm = LLM(model_dir, num_threads=threads, max_num_batched_tokens=2048, max_prefill_chunk=512)
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    counter = iter(range(1 << 62))

    def run(prompts: list[list[int]]) -> Timing:
        engine.pool.reset_prefix_cache()  # every run computes its prompts, as llama.cpp does
        for ids in prompts:
            engine.add_request(f"peer-{next(counter)}", ids, sp)
        started: set[str] = set()
        output_tokens = decode_tokens = 0
        decode_s = 0.0
        t0 = time.perf_counter()
        while engine.has_unfinished_requests:
            all_started = len(started) == len(prompts)
            ts = time.perf_counter()
            outputs = engine.step()
            dt = time.perf_counter() - ts
            made = sum(len(o.new_token_ids) for o in outputs)
            output_tokens += made
            if all_started:
                decode_s += dt
                decode_tokens += made
            started.update(o.request_id for o in outputs if o.new_token_ids)
        return Timing(time.perf_counter() - t0, output_tokens, decode_s, decode_tokens)

    return llm, run


def hf_runner(model_dir: Path, *, output_len: int) -> Runner:
    """fn([prompt]) -> Timing for transformers ``generate`` at batch 1 (threads: the caller's
    ``torch.set_num_threads``)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    class Stamps(BaseStreamer):
        """perf_counter at each ``put``: the first is the prompt, then one per new token."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            self.times.append(time.perf_counter())

    def run(prompts: list[list[int]]) -> Timing:
        if len(prompts) != 1:
            raise ValueError("the transformers peer runs batch 1 only")
        ids = torch.tensor(prompts)
        stamps = Stamps()
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                           min_new_tokens=output_len, do_sample=False, pad_token_id=0, streamer=stamps)
            total = time.perf_counter() - t0
        first_token_at, end_at = stamps.times[1], stamps.times[-1]
        return Timing(total, output_len, end_at - first_token_at, output_len - 1)

    return run
