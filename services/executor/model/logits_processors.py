"""Per-row logits processors: logit_bias, repetition / presence / frequency penalties
(before the grammar mask), and the truncations of a sampled row's distribution
(top-k, top-p, min-p, after temperature).

Each function works on one row's ``[vocab]`` logits and returns a tensor (never edits
the caller's logits in place: the raw logits still serve the logprobs). Semantics follow
OpenAI / vLLM:

- logit_bias adds the bias to the token's logit (ids outside the vocabulary are skipped:
  the door that knows the vocabulary refuses them).
- repetition_penalty (CTRL / HF): every token seen in prompt or output has a positive
  logit divided by the penalty and a negative one multiplied by it.
- presence / frequency: over OUTPUT tokens only, ``logit -= presence * (count > 0) +
  frequency * count``. A migrated attempt's replayed tokens (``resumed_output_tokens``
  trailing prompt tokens) count as output, so the stream is penalised the same.
- min_p drops tokens whose probability is below ``min_p`` times the most likely one's.
"""
from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from services.executor.engine.sampling_params import SamplingParams

NEG_INF = float("-inf")


@dataclass(frozen=True)
class TokenHistory:
    """What a row's penalties look at: every token so far (prompt then output) and where
    the output starts (the prompt's replayed tail of a migrated attempt counts as output)."""

    token_ids: Seq[int]
    output_start: int

    @classmethod
    def of(cls, all_token_ids: Seq[int], num_prompt_tokens: int, resumed_output_tokens: int) -> TokenHistory:
        return cls(all_token_ids, max(0, num_prompt_tokens - resumed_output_tokens))


def apply_penalties(logits: torch.Tensor, p: SamplingParams, history: TokenHistory | None) -> torch.Tensor:
    """logit_bias, then repetition, then presence / frequency penalties, on one row."""
    out = logits.clone()
    vocab = out.shape[-1]
    if p.logit_bias:
        ids = [t for t, _ in p.logit_bias if t < vocab]
        bias = [b for t, b in p.logit_bias if t < vocab]
        if ids:
            idx = torch.tensor(ids, device=out.device)
            out[idx] += torch.tensor(bias, dtype=out.dtype, device=out.device)
    if history is None or not history.token_ids:
        return out
    seen = torch.tensor(history.token_ids, dtype=torch.int64, device=out.device)
    seen = seen[seen < vocab]
    if p.repetition_penalty != 1.0 and seen.numel():
        idx = seen.unique()
        vals = out[idx]
        out[idx] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if p.presence_penalty or p.frequency_penalty:
        produced = torch.tensor(history.token_ids[history.output_start:], dtype=torch.int64, device=out.device)
        produced = produced[produced < vocab]
        if produced.numel():
            # sparse: only the produced ids, not a vocabulary-wide count vector
            ids, counts = produced.unique(return_counts=True)
            out[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(out.dtype)
    return out


def needs_history(p: SamplingParams) -> bool:
    """Whether the row's processors read its tokens (repetition / presence / frequency)."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def truncate(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k, the top-p nucleus and the min-p floor of
    one temperature-scaled row. The most likely token always survives."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    if min_p > 0.0:
        # p < min_p * p_max  <=>  logit < max_logit + log(min_p): no softmax needed
        floor = logits.max() + math.log(min_p)
        logits = logits.masked_fill(logits < floor, NEG_INF)
    return logits
