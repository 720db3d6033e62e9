"""The scheduler applies a live-settings section by swapping whole objects, and refuses a
bad one without swapping anything (services/scheduler/live_settings.py). No processes."""
import asyncio

import pytest
from structlog.testing import capture_logs

from services.scheduler.api.events import MeshView
from services.scheduler.api.executor_port import ChannelPool
from services.scheduler.app import build_dispatcher
from services.scheduler.config import SchedulerConfig
from services.scheduler.live_settings import SchedulerLiveSettings
from services.scheduler.policy.pause import CostPausePolicy, NeverKeepPolicy
from services.scheduler.policy.priority import FcfsPrioritizer, WeftPrioritizer
from services.scheduler.state.kv_index import KvIndex
from services.scheduler.state.membership import Membership


@pytest.fixture(autouse=True)
def _logs():
    with capture_logs() as logs:  # another test may have bound structlog to a closed stream
        yield logs


def _live():
    config = SchedulerConfig(tenant_quotas="acme=64")
    dispatcher = build_dispatcher(config, MeshView(Membership(3), KvIndex(0)), ChannelPool(1 << 20))
    return SchedulerLiveSettings(config, dispatcher), dispatcher


def test_policy_quotas_ladder_and_overcommit_are_swapped_and_null_returns_to_the_flags():
    live, dispatcher = _live()
    plane, ladder = dispatcher.agent.plane, dispatcher.degrade.ladder
    assert isinstance(plane.prioritizer, WeftPrioritizer) and isinstance(plane.pause_policy, CostPausePolicy)
    live.apply({"policy": "fcfs", "tenant_quotas": "acme=8", "degradation_thresholds": "shed=0:0",
                "executor_overcommit": 3})
    assert isinstance(plane.prioritizer, FcfsPrioritizer)
    assert isinstance(plane.pause_policy, NeverKeepPolicy)  # auto: drop under fcfs
    assert plane.contracts.tenant_quotas == {"acme": 8} and dispatcher.executor_overcommit == 3
    assert dispatcher.degrade.ladder is not ladder
    live.apply({})
    assert isinstance(plane.prioritizer, WeftPrioritizer) and plane.contracts.tenant_quotas == {"acme": 64}
    assert dispatcher.executor_overcommit == 1.25


@pytest.mark.parametrize("overrides", [{"policy": "fcfs", "executor_overcommit": 0.5},
                                       {"policy": "fcfs", "tenant_quotas": "acme"},
                                       {"policy": "fcfs", "no_such_setting": 1}])
def test_a_bad_section_swaps_nothing(overrides):
    live, dispatcher = _live()
    prioritizer = dispatcher.agent.plane.prioritizer
    with pytest.raises(ValueError):
        live.apply(overrides)
    assert dispatcher.agent.plane.prioritizer is prioritizer and live.config is live.base


def test_the_reprioritisation_loop_runs_exactly_while_the_policy_is_weft():
    async def scenario():
        config = SchedulerConfig()
        dispatcher = build_dispatcher(config, MeshView(Membership(3), KvIndex(0)), ChannelPool(1 << 20))
        live = SchedulerLiveSettings(config, dispatcher, lambda period_s: asyncio.create_task(asyncio.sleep(3600)))
        assert live.reprioritize_task is not None
        live.apply({"policy": "priority"})
        assert live.reprioritize_task is None
        live.apply({"policy": "weft"})
        assert live.reprioritize_task is not None
        live.stop()

    asyncio.run(scenario())
