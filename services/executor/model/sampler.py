"""Picks the next token of each sampling row and reports its log-probabilities.

Per row, in order (vLLM's / OpenAI's semantics): logit_bias -> repetition penalty ->
presence / frequency penalties -> grammar mask (services/executor/grammar) -> greedy
argmax of the processed logits, or temperature -> top-k -> top-p -> min-p -> a draw with
the row's own generator (a seeded request is reproducible whatever shares its batch).
Rows without a processor pay nothing: the greedy rows of a plain batch are one argmax,
and a batch of only such rows (``is_plain_greedy``) goes through ``sample_greedy``, which
takes no per-row arguments at all.

Log-probabilities (the chosen token's and the ``top_logprobs`` alternatives) are taken
from the RAW model distribution, the log_softmax of the unprocessed logits, before bias,
penalties, grammar, temperature or truncation: vLLM's default ("raw_logprobs"), so a
number means the same whatever sampling settings produced the token.

A row whose processed logits allow no token at all (a grammar that forbids everything,
a bias of -100 on every candidate) is never sampled from (that would be NaN): it gets its
fallback token (its first stop token, else the model's EOS) and is listed in
``SampledTokens.stuck_rows`` so the scheduler can finish it.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from services.executor.engine.sampling_params import SamplingParams
from services.executor.model.logits_processors import TokenHistory, apply_penalties, truncate

TopLogprobs = tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class SampledTokens:
    token_ids: list[int]
    logprobs: list[float] | None  # logprob of each chosen token under the raw model distribution
    # Mean entropy (nats) of each row's raw distribution: the intent-entropy signal.
    entropies: list[float] | None = None
    # (token id, logprob) alternatives of each row, most likely first (rows whose params ask
    # for top_logprobs; other rows hold an empty tuple); None when no row asked.
    top_logprobs: list[TopLogprobs] | None = None
    # Rows whose processed logits allowed no token: they got their fallback token.
    stuck_rows: tuple[int, ...] = ()


def sample(
    logits: torch.Tensor,  # [rows, vocab] fp32, raw from the model
    params: Seq[SamplingParams],
    generators: Seq[torch.Generator | None],
    entropy_rows: Seq[bool] = (),
    histories: Seq[TokenHistory | None] = (),  # rows whose penalties read their tokens
    grammars: Seq[object | None] = (),  # each row's grammar state (services/executor/grammar)
    fallback_ids: Seq[int] = (),  # per row: the token a stuck row gets (default 0)
) -> SampledTokens:
    """One token per row (see the module docstring for the order of the processors)."""
    processed = _process(logits, params, histories, grammars)
    token_ids = processed.argmax(dim=-1).tolist()
    stuck = _stuck_rows(processed) if processed is not logits else ()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy or row in stuck:
            continue
        row_logits = truncate(processed[row] / p.temperature, p.top_k, p.top_p, p.min_p)
        token_ids[row] = int(torch.multinomial(row_logits.softmax(-1), 1, generator=gen).item())
    for row in stuck:
        token_ids[row] = fallback_ids[row] if row < len(fallback_ids) else 0
    logprobs, top = _logprobs(logits, params, token_ids)
    return SampledTokens(token_ids, logprobs, _entropies(logits, entropy_rows, len(token_ids)), top, stuck)


def is_plain_greedy(p: SamplingParams) -> bool:
    """Whether ``sample`` would do nothing for this row but an argmax and return no
    logprobs: greedy, no bias or penalty, no logprobs asked (grammar and entropy are the
    caller's to check: they are not sampling params)."""
    return (p.greedy and not p.logit_bias and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and not p.logprobs and not p.top_logprobs)


def sample_greedy(logits: torch.Tensor) -> SampledTokens:  # logits: [rows, vocab]
    """``sample`` for a batch whose every row ``is_plain_greedy`` (no grammar, no entropy):
    the argmax of each row, nothing else."""
    return SampledTokens(logits.argmax(dim=-1).tolist(), None)


def _process(logits: torch.Tensor, params: Seq[SamplingParams], histories: Seq[TokenHistory | None],
             grammars: Seq[object | None]) -> torch.Tensor:
    """The logits after bias, penalties and the grammar mask: ``logits`` itself when no
    row has any (the common case costs nothing), else a copy (the raw logits stay raw)."""
    rows = [i for i, p in enumerate(params) if p.logit_bias or p.repetition_penalty != 1.0
            or p.presence_penalty or p.frequency_penalty]
    has_grammar = any(g is not None for g in grammars)
    if not rows and not has_grammar:
        return logits
    out = logits.clone()
    for i in rows:
        out[i] = apply_penalties(logits[i], params[i], histories[i] if i < len(histories) else None)
    if has_grammar:
        # Imported here: a batch without a grammar never loads xgrammar.
        from services.executor.grammar import mask_logits
        mask_logits(out, list(grammars))  # in place: disallowed tokens -> -inf
    return out


def _stuck_rows(processed: torch.Tensor) -> tuple[int, ...]:
    """Rows where every processed logit is -inf (or NaN): nothing may be sampled."""
    allowed = processed > float("-inf")  # False for NaN too
    return tuple(torch.nonzero(~allowed.any(dim=-1)).flatten().tolist())


def _logprobs(logits: torch.Tensor, params: Seq[SamplingParams],
              token_ids: list[int]) -> tuple[list[float] | None, list[TopLogprobs] | None]:
    """The chosen tokens' raw logprobs (when any row asked) and each asking row's top-k
    alternatives, most likely first."""
    want_top = [i for i, p in enumerate(params) if p.top_logprobs]
    if not want_top and not any(p.logprobs for p in params):
        return None, None
    lp = logits.log_softmax(-1)
    chosen = lp.gather(1, torch.tensor(token_ids, device=logits.device)[:, None]).squeeze(1).tolist()
    if not want_top:
        return chosen, None
    top: list[TopLogprobs] = [()] * len(token_ids)
    k_max = max(params[i].top_logprobs for i in want_top)
    values, ids = torch.topk(lp[want_top], min(k_max, lp.shape[-1]), dim=-1)
    for j, i in enumerate(want_top):
        k = params[i].top_logprobs
        top[i] = tuple(zip(ids[j, :k].tolist(), values[j, :k].tolist()))
    return chosen, top


def _entropies(logits: torch.Tensor, entropy_rows: Seq[bool], num_rows: int) -> list[float] | None:
    if not any(entropy_rows):
        return None
    # Only rows that asked (agent sessions): one log_softmax over those rows.
    rows = [i for i, want in enumerate(entropy_rows) if want]
    lp = logits[rows].log_softmax(-1)  # [len(rows), vocab]
    # a -inf logit has p = 0 and adds nothing (0 * -inf would be NaN): clamp its log first
    ent = (-(lp.exp() * lp.clamp_min(torch.finfo(lp.dtype).min)).sum(-1)).tolist()
    entropies = [0.0] * num_rows
    for i, e in zip(rows, ent):
        entropies[i] = e
    return entropies
