"""Perplexity *through the engine*: every rung of the degradation ladder scores the same
tokens with its own KV cache (int8, compressed, ...).

NOTE: why not a transformers forward. A degradation rung changes what the engine's KV
cache holds (int8 rounding, dropped blocks), so its quality cost only shows in logits the
engine computes from that cache. The engine has no prompt-logprobs API, and a prompt
longer than the compression budget is prefilled whole and compressed only afterwards, so
scoring a window as one prompt would hide compression entirely. Instead each window is
*decoded* token by token, teacher-forced: a short prompt, then at each step the engine's
sampler is made to emit the window's next token, and that token's log-probability under
the step's logits is recorded. Compression then happens exactly as in generation.

The sampler is swapped for the duration of a ``forcing()`` block (benchmark-only; the
engine is unchanged); requests without ``extra["forced"]`` sample as usual.
"""
from __future__ import annotations

import math
import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class ForcedTargets:
    """The tokens one request must emit, and the log-probability each had (appended in order)."""

    targets: list[int]
    logprobs: list[float] = field(default_factory=list)


@contextmanager
def forcing():
    """While inside, ``model_runner.sample`` emits each forced request's next target."""
    import services.executor.engine.model_runner as model_runner

    original = model_runner.sample

    def forced_sample(logits, params, generators, entropy_rows=(), **processors):
        out = original(logits, params, generators, entropy_rows, **processors)
        forced = [p.extra.get("forced") for p in params]
        if not any(forced):
            return out
        logprobs = logits.log_softmax(-1)  # [rows, vocab]
        token_ids = list(out.token_ids)
        for row, f in enumerate(forced):
            if f is not None:
                # one sample per generated token, in order (no preemption: checked by the caller)
                target = f.targets[len(f.logprobs)]
                f.logprobs.append(float(logprobs[row, target]))
                token_ids[row] = target
        return dataclasses.replace(out, token_ids=token_ids)

    model_runner.sample = forced_sample
    try:
        yield
    finally:
        model_runner.sample = original


def engine_perplexity(llm, windows: list[list[int]], prompt_len: int) -> float:
    """Perplexity of ``windows[:, prompt_len:]`` as ``llm``'s engine computes it while it
    decodes them teacher-forced (module docstring). Raises ``RuntimeError`` when the engine
    preempted a request, which would re-run the sampler and misalign the targets."""
    from weft import SamplingParams

    forced = [ForcedTargets(list(w[prompt_len:])) for w in windows]
    params = [SamplingParams(max_tokens=len(f.targets), temperature=0.0, ignore_eos=True,
                             extra={"forced": f}) for f in forced]
    preempted = llm.engine.num_preemptions
    with forcing():
        outs = llm.generate([w[:prompt_len] for w in windows], params, use_tqdm=False)
    if llm.engine.num_preemptions != preempted:
        raise RuntimeError("the engine preempted a request during teacher forcing: give it more KV memory")
    for out, f in zip(outs, forced):
        if out.token_ids != f.targets or len(f.logprobs) != len(f.targets):
            raise RuntimeError(f"request {out.request_id} did not follow its forced targets")
    total = [lp for f in forced for lp in f.logprobs]
    return math.exp(-sum(total) / len(total))
