"""Picks the next token of each sampling row: greedy, temperature, top-k, top-p, seeds."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from services.executor.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampledTokens:
    token_ids: list[int]
    logprobs: list[float] | None  # logprob of each chosen token under the raw model distribution
    # Mean entropy (nats) of each row's raw distribution: the intent-entropy signal.
    entropies: list[float] | None = None
    # (token id, logprob) alternatives of each row, most likely first (rows whose params ask
    # for top_logprobs; other rows hold an empty tuple); None when no row asked.
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k and the top-p nucleus of one row."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor,  # [rows, vocab] fp32
    params: Seq[SamplingParams],
    generators: Seq[torch.Generator | None],
    entropy_rows: Seq[bool] = (),
) -> SampledTokens:
    """One token per row. Greedy rows are batched; sampled rows use their own generator
    (seeded requests are reproducible whatever else is in the batch)."""
    greedy = logits.argmax(dim=-1).tolist()
    token_ids = list(greedy)
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        row_logits = _filter_top_k_top_p(logits[row] / p.temperature, p.top_k, p.top_p)
        probs = row_logits.softmax(-1)
        token_ids[row] = int(torch.multinomial(probs, 1, generator=gen).item())
    logprobs = None
    if any(p.logprobs for p in params):
        lp = logits.log_softmax(-1)
        logprobs = lp.gather(1, torch.tensor(token_ids, device=logits.device)[:, None]).squeeze(1).tolist()
    entropies = None
    if any(entropy_rows):
        # Only rows that asked (agent sessions): one log_softmax over those rows.
        rows = [i for i, want in enumerate(entropy_rows) if want]
        lp = logits[rows].log_softmax(-1)  # [len(rows), vocab]
        ent = (-(lp.exp() * lp).sum(-1)).tolist()
        entropies = [0.0] * len(token_ids)
        for i, e in zip(rows, ent):
            entropies[i] = e
    return SampledTokens(token_ids, logprobs, entropies)
