"""The restart policy of `weft up` (weft/launcher/restart_policy.py) on a fake clock: backoff grows
exponentially with jitter inside its band, is capped, starts over after a quiet window,
and the max_deaths-th death within a window is a crash loop."""
from __future__ import annotations

import random

import pytest

from weft.launcher.restart_policy import RestartConfig, RestartPolicy


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def advance(self, seconds: float) -> float:
        self.now_s += seconds
        return self.now_s


def test_first_death_restarts_after_the_base_delay_within_the_jitter_band():
    cfg = RestartConfig(base_delay_s=1.0, jitter=0.2)
    for seed in range(50):
        decision = RestartPolicy(cfg, random.Random(seed)).on_death(0.0)
        assert decision.restart and 0.8 <= decision.delay_s <= 1.0


def test_backoff_doubles_per_recent_death_up_to_the_cap():
    cfg = RestartConfig(base_delay_s=1.0, max_delay_s=5.0, jitter=0.0, max_deaths=100, window_s=1e6)
    policy, clock = RestartPolicy(cfg), FakeClock()
    delays = [policy.on_death(clock.advance(1.0)).delay_s for _ in range(6)]
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0]


def test_jitter_spreads_simultaneous_restarts():
    cfg = RestartConfig(base_delay_s=1.0, jitter=0.5)
    delays = {RestartPolicy(cfg, random.Random(seed)).on_death(0.0).delay_s for seed in range(20)}
    assert len(delays) > 1


def test_the_max_deaths_th_death_within_the_window_is_a_crash_loop():
    cfg = RestartConfig(max_deaths=5, window_s=60.0)
    policy, clock = RestartPolicy(cfg), FakeClock()
    decisions = [policy.on_death(clock.advance(5.0)) for _ in range(5)]
    assert [d.restart for d in decisions] == [True, True, True, True, False]
    assert decisions[-1].num_recent_deaths == 5


def test_deaths_spread_wider_than_the_window_never_crash_loop_and_backoff_starts_over():
    cfg = RestartConfig(base_delay_s=1.0, jitter=0.0, max_deaths=3, window_s=60.0)
    policy, clock = RestartPolicy(cfg), FakeClock()
    for _ in range(20):
        decision = policy.on_death(clock.advance(61.0))
        assert decision.restart and decision.num_recent_deaths == 1 and decision.delay_s == 1.0


def test_old_deaths_leave_the_window():
    cfg = RestartConfig(max_deaths=3, window_s=60.0)
    policy, clock = RestartPolicy(cfg), FakeClock()
    policy.on_death(clock.advance(0.0))
    policy.on_death(clock.advance(10.0))
    assert policy.on_death(clock.advance(55.0)).num_recent_deaths == 2  # the first one left the window
    assert not policy.on_death(clock.advance(1.0)).restart


def test_reset_forgives_a_crash_loop():
    cfg = RestartConfig(max_deaths=2, window_s=60.0)
    policy, clock = RestartPolicy(cfg), FakeClock()
    policy.on_death(clock.advance(1.0))
    assert not policy.on_death(clock.advance(1.0)).restart
    policy.reset()
    assert policy.on_death(clock.advance(1.0)).restart


@pytest.mark.parametrize("kwargs, field", [
    (dict(base_delay_s=-1.0), "delays"), (dict(base_delay_s=5.0, max_delay_s=1.0), "delays"),
    (dict(jitter=1.0), "jitter"), (dict(max_deaths=0), "max_deaths"), (dict(window_s=0.0), "window_s"),
])
def test_bad_restart_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RestartConfig(**kwargs)
