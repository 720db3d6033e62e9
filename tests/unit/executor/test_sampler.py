"""Sampler: greedy, temperature, top-k, top-p, per-request seeds, logprobs. No model."""
from __future__ import annotations

import math

import torch

from services.executor.model.sampler import sample
from services.executor.engine.sampling_params import SamplingParams

VOCAB = 50
GREEDY = SamplingParams(temperature=0.0)


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3.0  # [rows, vocab]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_picks_the_argmax_of_every_row():
    logits = _logits(6, seed=0)
    out = sample(logits, [GREEDY] * 6, [None] * 6)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_a_seeded_row_draws_the_same_tokens_whatever_shares_its_batch():
    params = SamplingParams(temperature=1.0, seed=7)
    steps = [_logits(1, seed=100 + i)[0] for i in range(20)]

    alone_gen = _gen(7)
    alone = [sample(row[None], [params], [alone_gen]).token_ids[0] for row in steps]

    batched_gen = _gen(7)
    companion = _gen(123)
    batched = []
    for i, row in enumerate(steps):
        # companions: a greedy row, an unseeded row (global RNG), another seeded row
        logits = torch.stack([_logits(1, seed=900 + i)[0], row, _logits(1, seed=950 + i)[0], row])
        out = sample(
            logits,
            [GREEDY, params, SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, seed=123)],
            [None, batched_gen, None, companion],
        )
        batched.append(out.token_ids[1])
    assert batched == alone
    assert len(set(alone)) > 1  # really sampled, not a disguised argmax


def test_top_k_1_equals_greedy():
    logits = _logits(16, seed=1)
    out = sample(logits, [SamplingParams(temperature=1.0, top_k=1)] * 16, [_gen(i) for i in range(16)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_equals_greedy():
    logits = _logits(16, seed=2)
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 16, [_gen(i) for i in range(16)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_never_samples_outside_the_k_most_likely_tokens():
    logits = _logits(1, seed=3).repeat(400, 1)
    top2 = set(torch.topk(logits[0], 2).indices.tolist())
    out = sample(logits, [SamplingParams(temperature=2.0, top_k=2)] * 400, [_gen(5)] * 400)
    assert set(out.token_ids) == top2


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().repeat(400, 1)
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=0.6)] * 400, [_gen(6)] * 400)
    assert set(out.token_ids) == {0, 1}  # 0.5 < 0.6, so token 1 is needed; 0.8 >= 0.6 stops


def test_logprobs_are_the_log_softmax_of_the_raw_logits_at_the_chosen_ids():
    logits = _logits(4, seed=4)
    params = [
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=0.7, logprobs=True, seed=1),
        SamplingParams(temperature=1.3, top_k=5, logprobs=True, seed=2),
        SamplingParams(temperature=1.0, top_p=0.5, logprobs=True, seed=3),
    ]
    out = sample(logits, params, [None, _gen(1), _gen(2), _gen(3)])
    expected = torch.log_softmax(logits, -1)[torch.arange(4), torch.tensor(out.token_ids)]
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-6)


def _count_ones(probs: list[float], temperature: float, n: int, seed: int) -> int:
    logits = torch.tensor(probs).log().repeat(n, 1)
    out = sample(logits, [SamplingParams(temperature=temperature)] * n, [_gen(seed)] * n)
    return sum(out.token_ids)


def _within_binomial(count: int, n: int, p: float, sigmas: float = 5.0) -> bool:
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def test_temperature_one_samples_the_model_distribution():
    # fixed seed: deterministic, so the wide bound cannot flake
    n = 2000
    ones = _count_ones([0.3, 0.7], temperature=1.0, n=n, seed=11)
    assert _within_binomial(ones, n, 0.7), ones


def test_lower_temperature_sharpens_the_distribution():
    n = 2000
    # p ~ softmax(log p / T): at T = 0.5 the 0.3/0.7 split becomes 0.09/0.49 -> 0.845
    ones = _count_ones([0.3, 0.7], temperature=0.5, n=n, seed=12)
    assert _within_binomial(ones, n, 0.49 / 0.58), ones
    assert not _within_binomial(ones, n, 0.7)
