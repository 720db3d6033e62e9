"""Sampler logits processors against hand-computed references on small tensors:
logit_bias, repetition / presence / frequency penalties, min_p, the order they run in,
raw top_logprobs, stuck rows (nothing allowed) and seeded draws whatever shares the batch."""
from __future__ import annotations

import pytest
import torch

from services.executor.engine.sampling_params import SamplingParams
from services.executor.model.logits_processors import TokenHistory, apply_penalties, truncate
from services.executor.model.sampler import sample

NEG = float("-inf")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_logit_bias_forces_a_token_greedy_and_sampled():
    logits = torch.tensor([[4.0, 1.0, 0.0, -1.0]] * 2)
    params = [SamplingParams(temperature=0.0, logit_bias={3: 100.0}),
              SamplingParams(temperature=1.0, seed=1, logit_bias={3: 100.0})]
    assert sample(logits, params, [None, _gen(1)]).token_ids == [3, 3]
    banned = SamplingParams(temperature=0.0, logit_bias={0: -100.0})
    assert sample(logits[:1], [banned], [None]).token_ids == [1]


def test_logit_bias_adds_to_the_logit_and_skips_ids_outside_the_vocabulary():
    out = apply_penalties(torch.tensor([1.0, 2.0, 3.0]), SamplingParams(logit_bias={1: 0.5, 7: 9.0}), None)
    assert out.tolist() == [1.0, 2.5, 3.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([2.0, -2.0, 3.0, -1.0, 0.5])
    p = SamplingParams(repetition_penalty=2.0)
    # token 0 in the prompt, token 1 in the output (twice: counted once), 4 never seen
    out = apply_penalties(logits, p, TokenHistory.of([0, 2, 1, 1, 3], num_prompt_tokens=3, resumed_output_tokens=0))
    assert out.tolist() == [1.0, -4.0, 1.5, -2.0, 0.5]


def test_presence_and_frequency_count_output_tokens_only():
    logits = torch.zeros(5)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # prompt [1, 1, 4]; output [2, 2, 2, 3]
    out = apply_penalties(logits, p, TokenHistory.of([1, 1, 4, 2, 2, 2, 3], num_prompt_tokens=3,
                                                     resumed_output_tokens=0))
    assert out.tolist() == [0.0, 0.0, -(0.5 + 3 * 0.25), -(0.5 + 0.25), 0.0]


def test_a_resumed_attempt_penalises_its_replayed_tokens_as_output():
    """A migrated attempt's prompt ends with the tokens the first attempt sent: presence /
    frequency see them exactly as the first attempt did."""
    p = SamplingParams(presence_penalty=1.0, frequency_penalty=1.0, resumed_output_tokens=2)
    first = apply_penalties(torch.zeros(6), p, TokenHistory.of([5, 5, 1, 2], num_prompt_tokens=2,
                                                               resumed_output_tokens=0))
    resumed = apply_penalties(torch.zeros(6), p, TokenHistory.of([5, 5, 1, 2], num_prompt_tokens=4,
                                                                 resumed_output_tokens=2))
    assert resumed.tolist() == first.tolist() == [0.0, -2.0, -2.0, 0.0, 0.0, 0.0]


def test_greedy_with_penalties_is_the_argmax_of_the_processed_logits():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    p = SamplingParams(temperature=0.0, frequency_penalty=0.2)
    hist = TokenHistory.of([2, 0], num_prompt_tokens=1, resumed_output_tokens=0)  # token 0 produced once
    assert sample(logits, [p], [None], histories=[hist]).token_ids == [1]
    assert sample(logits, [SamplingParams(temperature=0.0)], [None]).token_ids == [0]


def test_bias_runs_before_the_repetition_penalty():
    # bias makes token 0's logit positive, then the penalty divides it (not multiplies)
    p = SamplingParams(logit_bias={0: 3.0}, repetition_penalty=2.0)
    out = apply_penalties(torch.tensor([-1.0, 0.0]), p, TokenHistory.of([0], 1, 0))
    assert out.tolist() == [1.0, 0.0]


def test_min_p_drops_tokens_below_min_p_times_the_top_probability():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = truncate(probs.log(), top_k=0, top_p=1.0, min_p=0.25)  # floor 0.125
    assert torch.isfinite(kept).tolist() == [True, True, True, False]
    out = sample(probs.log().repeat(400, 1), [SamplingParams(temperature=1.0, min_p=0.5)] * 400, [_gen(3)] * 400)
    assert set(out.token_ids) == {0, 1}  # 0.15 < 0.25


def test_min_p_applies_to_the_temperature_scaled_distribution():
    # p = [0.5, 0.3, 0.2]; at T = 0.5 the ratios square: 0.2/0.5 = 0.4 -> 0.16 < 0.3
    logits = torch.tensor([0.5, 0.3, 0.2]).log().repeat(400, 1)
    p = SamplingParams(temperature=0.5, min_p=0.3)
    assert set(sample(logits, [p] * 400, [_gen(4)] * 400).token_ids) == {0, 1}
    p1 = SamplingParams(temperature=1.0, min_p=0.3)
    assert set(sample(logits, [p1] * 400, [_gen(4)] * 400).token_ids) == {0, 1, 2}


def test_processed_rows_leave_the_raw_logits_and_other_rows_untouched():
    logits = torch.randn(3, 10, generator=_gen(0))
    before = logits.clone()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logit_bias={9: 100.0}),
              SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2, logit_bias={9: 100.0})]
    out = sample(logits, params, [None] * 3)
    assert torch.equal(logits, before)
    assert out.token_ids == [int(before[0].argmax()), 9, 9]
    # logprobs are the RAW distribution's: the bias is not in them
    raw = before.log_softmax(-1)
    assert out.logprobs[2] == pytest.approx(raw[2, 9].item(), abs=1e-6)


def test_top_logprobs_are_the_raw_top_k_most_likely_first_for_the_rows_that_ask():
    logits = torch.randn(3, 30, generator=_gen(1)) * 2
    params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, seed=2, logprobs=True, top_logprobs=5, repetition_penalty=1.5)]
    out = sample(logits, params, [None, None, _gen(2)], histories=[None, None, TokenHistory.of([1, 2], 2, 0)])
    raw = logits.log_softmax(-1)
    assert out.top_logprobs[1] == ()
    for row, k in ((0, 3), (2, 5)):
        values, ids = raw[row].topk(k)
        assert [t for t, _ in out.top_logprobs[row]] == ids.tolist()
        assert [lp for _, lp in out.top_logprobs[row]] == pytest.approx(values.tolist(), abs=1e-6)
    assert sample(logits, [SamplingParams(temperature=0.0, logprobs=True)] * 3, [None] * 3).top_logprobs is None


class _BanAll:
    """A stand-in grammar state; the masking itself is mocked below."""


def test_a_row_that_allows_no_token_gets_its_fallback_not_nan(monkeypatch):
    import services.executor.model.sampler as sampler_mod
    import sys
    import types

    def mask_logits(logits, states):  # in place, like services/executor/grammar's
        for i, s in enumerate(states):
            if s is not None:
                logits[i] = NEG

    monkeypatch.setitem(sys.modules, "services.executor.grammar", types.SimpleNamespace(mask_logits=mask_logits))
    logits = torch.randn(3, 8, generator=_gen(5))
    params = [SamplingParams(temperature=1.0, seed=1, logprobs=True), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=True)]
    out = sampler_mod.sample(logits, params, [_gen(1), None, None], grammars=[_BanAll(), None, _BanAll()],
                             fallback_ids=[7, 6, 5])
    assert out.stuck_rows == (0, 2)
    assert out.token_ids == [7, int(logits[1].argmax()), 5]
    assert all(torch.isfinite(torch.tensor(out.logprobs)))


def test_a_bias_of_minus_100_on_every_token_still_leaves_a_distribution():
    logits = torch.zeros(1, 3)
    p = SamplingParams(temperature=1.0, logit_bias={0: -100.0, 1: -100.0, 2: -100.0})
    out = sample(logits, [p], [_gen(0)])  # -100 is a finite logit: still a distribution
    assert out.stuck_rows == () and out.token_ids[0] in (0, 1, 2)


def test_seeded_penalised_rows_are_reproducible_whatever_shares_the_batch():
    steps = [torch.randn(1, 40, generator=_gen(100 + i))[0] * 2 for i in range(15)]
    p = SamplingParams(temperature=1.0, seed=7, presence_penalty=0.7, min_p=0.05, logit_bias={3: 2.0})

    def run(companions: bool) -> list[int]:
        gen, hist, toks = _gen(7), [1, 2, 3], []
        for i, row in enumerate(steps):
            h = TokenHistory.of(list(hist), 3, 0)
            if companions:
                logits = torch.stack([torch.randn(40, generator=_gen(900 + i)), row, row])
                params = [SamplingParams(temperature=0.0, repetition_penalty=1.3), p,
                          SamplingParams(temperature=0.9, seed=3, top_k=5)]
                out = sample(logits, params, [None, gen, _gen(i)], histories=[TokenHistory.of([0], 1, 0), h, None])
                tok = out.token_ids[1]
            else:
                tok = sample(row[None], [p], [gen], histories=[h]).token_ids[0]
            hist.append(tok)
            toks.append(tok)
        return toks

    alone = run(False)
    assert run(True) == alone
    assert len(set(alone)) > 1


def test_the_real_grammar_mask_runs_after_the_bias_and_before_truncation(tmp_path):
    """With xgrammar: a bias toward a token the grammar forbids cannot force it, and sampled
    rows (temperature, top-k, min-p) draw only what the grammar allows; the unconstrained
    row in the same batch keeps its bias."""
    from services.executor.engine.sampling_params import GrammarSpec
    from services.executor.grammar import GrammarCache, GrammarState, load_tokenizer_info
    from services.executor.model.config import ModelConfig
    from weft.testing.tiny_model import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "tiny", preset="tiny", arch="llama")
    config = ModelConfig.from_dir(path)
    info = load_tokenizer_info(path, config.vocab_size, config.eos_token_ids)
    cache = GrammarCache(info)
    try:
        digits = cache.get(GrammarSpec("regex", "[0-9]+"))
        non_digit = next(t for t, b in enumerate(info.decoded_vocab) if b and not b.isdigit())
        logits = torch.randn(3, config.vocab_size, generator=_gen(8))
        params = [SamplingParams(temperature=0.0, logit_bias={non_digit: 100.0}),
                  SamplingParams(temperature=1.5, top_k=50, min_p=0.01, seed=1, logit_bias={non_digit: 100.0}),
                  SamplingParams(temperature=0.0, logit_bias={non_digit: 100.0})]
        drawn = set()
        for i in range(30):
            states = [GrammarState(digits), GrammarState(digits), None]
            out = sample(logits, params, [None, _gen(i), None], grammars=states)
            assert out.stuck_rows == ()
            assert out.token_ids[2] == non_digit
            drawn.update(out.token_ids[:2])
        assert all(info.decoded_vocab[t].isdigit() for t in drawn) and len(drawn) > 2
    finally:
        cache.close()


def test_a_batch_without_processors_is_not_copied():
    from services.executor.model.sampler import _process

    logits = torch.randn(4, 10)
    plain = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=3, min_p=0.1)] * 2
    assert _process(logits, plain, (), [None] * 4) is logits
    biased = plain[:3] + [SamplingParams(logit_bias={1: 1.0})]
    assert _process(logits, biased, (), [None] * 4) is not logits
