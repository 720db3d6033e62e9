"""The resume point used by both the scheduler's migration and the router's continuation."""
from __future__ import annotations

from services.shared.stream_resume import (
    StallRule, StallWatch, budget_spent, continuation_seed, resume_point,
)


def test_the_continuation_prompt_is_the_prompt_then_every_sent_token():
    point = resume_point((1, 2, 3), [7, 8], max_tokens=5, min_tokens=3, seed=None)
    assert point.prompt_token_ids == (1, 2, 3, 7, 8)
    assert (point.max_tokens, point.min_tokens, point.seed) == (3, 1, None)


def test_an_unlimited_request_stays_unlimited_and_min_tokens_never_goes_negative():
    point = resume_point((1,), [4, 5, 6], max_tokens=0, min_tokens=1, seed=None)
    assert (point.max_tokens, point.min_tokens) == (0, 0)


def test_a_seeded_stream_is_reseeded_per_failure_point_and_unchanged_before_any_token():
    assert resume_point((1,), [], 4, 0, seed=42).seed == 42
    after_two = resume_point((1,), [5, 6], 4, 0, seed=42).seed
    assert after_two == continuation_seed(42, 2) != continuation_seed(42, 3)
    assert 0 <= after_two < 2 ** 63


def test_the_budget_is_spent_only_when_a_limit_was_reached():
    assert budget_spent(3, 3) and not budget_spent(3, 2) and not budget_spent(0, 10 ** 6)


def test_the_stall_ceiling_follows_the_mean_gap_with_a_floor():
    now = [0.0]
    watch = StallWatch(StallRule(stall_factor=10, min_stall_s=0.5, first_token_timeout_s=30), lambda: now[0])
    assert watch.timeout_s() == 30  # before the first token: prefill may take long
    watch.observe()
    assert watch.timeout_s() == 7.5  # one token, no gap yet: a quarter of the first-token ceiling
    now[0] = 0.2
    watch.observe()
    assert watch.timeout_s() == 2.0  # 10 x 0.2 s
    now[0] = 0.21
    watch.observe()
    assert watch.timeout_s() == 10 * 0.105
    watch.restart()
    assert watch.timeout_s() == 30
