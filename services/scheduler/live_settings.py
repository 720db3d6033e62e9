"""The scheduler's live settings: apply the ``scheduler`` section of the router's document
(services/mesh/live_settings.py) by swapping whole objects the request path holds.

    policy, priority_weights     AgentPlane.prioritizer (+ the re-prioritisation loop, weft only)
    pause_policy, pause costs    AgentPlane.pause_policy
    tenant_quotas                ContractBook.tenant_quotas (one dict, replaced)
    prefill_ms_per_token         ContractBook.prefill_ms_per_token and the pause costs
    degradation_*                DegradeSteps.ladder (a new ladder: classes start at full quality)
    executor_overcommit          Dispatcher.executor_overcommit

A hop that already began keeps the objects it was planned with (its priority function,
its pause plan); the next hop gets the new ones. The overrides are checked by building a
whole ``SchedulerConfig`` (its own ``__post_init__``) over the start-up one, so the
scheduler refuses exactly what its flags would refuse, and nothing is swapped unless
everything is valid.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping

import structlog

from services.scheduler.config import SchedulerConfig
from services.scheduler.dispatch.dispatcher import Dispatcher
from services.scheduler.policy.contracts import parse_tenant_quotas
from services.scheduler.policy.degradation import DegradationLadder
from services.scheduler.policy.pause import make_pause_policy
from services.scheduler.policy.priority import make_prioritizer

log = structlog.get_logger(__name__)


class SchedulerLiveSettings:
    """Owns the running config; ``apply(overrides)`` is the follower's callback."""

    def __init__(self, base: SchedulerConfig, dispatcher: Dispatcher,
                 reprioritize: Callable[[float], asyncio.Task] | None = None) -> None:
        """``reprioritize(period_s)`` starts the weft policy's re-prioritisation loop."""
        self.base = base
        self.config = base
        self.dispatcher = dispatcher
        self._start_reprioritize = reprioritize
        self.reprioritize_task: asyncio.Task | None = None
        if base.policy == "weft" and reprioritize is not None:
            self.reprioritize_task = reprioritize(base.priority_interval_s)

    def candidate(self, overrides: Mapping[str, object]) -> SchedulerConfig:
        """The start-up config with ``overrides``; ValueError naming the field when invalid."""
        names = {f.name for f in dataclasses.fields(SchedulerConfig)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"{unknown[0]}: not a scheduler setting")
        try:
            return dataclasses.replace(self.base, **overrides)
        except TypeError as exc:
            raise ValueError(str(exc)) from None

    def apply(self, overrides: Mapping[str, object]) -> None:
        new = self.candidate(overrides)
        # Build every object first: a failure here leaves the running ones untouched.
        prioritizer = make_prioritizer(new.policy, new.weft_weights)
        pause_policy = make_pause_policy(new.resolved_pause_policy, new.pause_costs)
        quotas = parse_tenant_quotas(new.tenant_quotas)
        ladder = DegradationLadder(new.ladder_config) if new.ladder_config != self.config.ladder_config else None
        plane = self.dispatcher.agent.plane
        plane.prioritizer = prioritizer
        plane.pause_policy = pause_policy
        plane.contracts.tenant_quotas = quotas
        plane.contracts.prefill_ms_per_token = new.prefill_ms_per_token
        if ladder is not None:
            self.dispatcher.degrade.ladder = ladder
        self.dispatcher.executor_overcommit = new.executor_overcommit
        self._follow_policy(new)
        self.config = new
        log.info("scheduler_settings_in_force", policy=new.policy, pause_policy=new.resolved_pause_policy,
                 tenant_quotas=quotas, degradation_rungs=new.degradation_rungs,
                 degradation_thresholds=new.degradation_thresholds, executor_overcommit=new.executor_overcommit)

    def _follow_policy(self, new: SchedulerConfig) -> None:
        """Run the re-prioritisation loop exactly while the policy is weft."""
        if new.policy == "weft" and self.reprioritize_task is None and self._start_reprioritize is not None:
            self.reprioritize_task = self._start_reprioritize(new.priority_interval_s)
        elif new.policy != "weft" and self.reprioritize_task is not None:
            self.reprioritize_task.cancel()
            self.reprioritize_task = None

    def stop(self) -> None:
        if self.reprioritize_task is not None:
            self.reprioritize_task.cancel()
