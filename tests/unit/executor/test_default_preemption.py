"""Executors follow the scheduler's priority by default (issue 17): the waiting queue is
admitted in priority order and the lowest-priority running sequence loses its blocks,
so the order the scheduler's scored queue chose is the order the engine keeps."""
from __future__ import annotations

import dataclasses
from collections import deque
from types import SimpleNamespace

from services.executor.config import ExecutorConfig
from services.executor.engine.config import EngineConfig
from services.executor.policy.preemption import make_preemption_policy


class NoBorrowing:
    def is_borrowing(self, partition: str) -> bool:
        return False


def seq(name: str, priority: float, arrival_time: float) -> SimpleNamespace:
    return SimpleNamespace(request_id=name, priority=priority, arrival_time=arrival_time, partition="default")


def test_default_policy_admits_higher_priority_first_and_preempts_the_lowest():
    policy = make_preemption_policy(EngineConfig().preemption_policy)
    waiting = deque([seq("batch", -3.0, 1.0), seq("interactive", 0.0, 2.0), seq("hop", -1.0, 3.0)])
    policy.order_waiting(waiting)
    assert [s.request_id for s in waiting] == ["interactive", "hop", "batch"]  # FCFS would keep arrival order
    running = [seq("batch", -3.0, 1.0), seq("interactive", 0.0, 2.0)]
    assert policy.pick_victim(running, NoBorrowing()).request_id == "batch"  # FCFS would pick the newest


def test_equal_priorities_keep_arrival_order_and_the_executor_flag_defaults_to_it():
    policy = make_preemption_policy(EngineConfig().preemption_policy)
    waiting = deque([seq("a", 0.0, 1.0), seq("b", 0.0, 2.0)])
    policy.order_waiting(waiting)
    assert [s.request_id for s in waiting] == ["a", "b"]
    assert policy.pick_victim(list(waiting), NoBorrowing()).request_id == "b"
    default = {f.name: f.default for f in dataclasses.fields(ExecutorConfig)}["preemption_policy"]
    assert default == "priority"
