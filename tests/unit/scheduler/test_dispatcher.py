"""The dispatcher as domain code: jobs in, chunks out, executors behind a fake
ExecutorPort (no protobuf, no gRPC, no processes). The request path: an unreachable
executor is skipped before the first token, a broken stream migrates from the shared
resume point, and the priority an executor is told is the agent plan's, higher first."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from services.scheduler.agent_plane import AgentPlane, HopRequest
from services.scheduler.dispatch.agent_steps import AgentSteps
from services.scheduler.dispatch.dispatcher import Dispatcher
from services.scheduler.dispatch.job import Chunk, ExecutorCall, ExecutorCallError, Job
from services.scheduler.policy.admission import Admission
from services.scheduler.policy.contracts import ContractBook
from services.scheduler.policy.pause import make_pause_policy
from services.scheduler.policy.placement import InflightTracker, Placement, Placer
from services.scheduler.policy.priority import make_prioritizer
from services.scheduler.state.kv_index import KvIndex
from services.scheduler.state.membership import ExecutorRecord, ExecutorState, Membership
from services.shared.vocabulary import RequestClass


class ByName(Placer):
    def rank(self, candidates):
        return [Placement(c.name, c.address, c.num_matched_blocks, 0.0) for c in sorted(candidates, key=lambda c: c.name)]


class FakeStream:
    def __init__(self, behaviour: str, call: ExecutorCall, executor: str) -> None:
        self.behaviour, self.call, self.executor = behaviour, call, executor
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    async def __aiter__(self):
        if self.behaviour == "down":
            raise ExecutorCallError("UNAVAILABLE", "connection refused", unavailable=True)
        n = self.call.max_tokens
        for i in range(n):
            if self.behaviour == "dies" and i == 1:
                raise ExecutorCallError("UNAVAILABLE", "socket closed", unavailable=True)
            yield Chunk((100 + len(self.call.prompt_token_ids),), i == n - 1, self.executor,
                        num_prompt_tokens=len(self.call.prompt_token_ids), num_output_tokens=i + 1)


class FakePort:
    def __init__(self, behaviours: dict[str, str]) -> None:
        self.behaviours = behaviours
        self.calls: list[tuple[str, ExecutorCall]] = []

    def generate(self, address, call, timeout_s, traceparent):
        self.calls.append((address, call))
        return FakeStream(self.behaviours[address], call, address)


def mesh(*names: str) -> SimpleNamespace:
    membership = Membership()
    for name in names:
        membership.heartbeat(ExecutorRecord(name=name, address=name, model_id="m", block_size=4,
                                            state=ExecutorState.SERVING, num_blocks=100))
    return SimpleNamespace(membership=membership, kv_index=KvIndex())


def run(dispatcher: Dispatcher, job: Job) -> list[Chunk]:
    async def main():
        dispatcher.screen(job.request_id, job.prompt_token_ids)
        return [c async for c in dispatcher.generate(job, lambda spans: None)]
    return asyncio.run(asyncio.wait_for(main(), 10))


def test_an_unreachable_executor_is_skipped_before_the_first_token():
    port = FakePort({"a": "down", "b": "ok"})
    chunks = run(Dispatcher(mesh("a", "b"), ByName(), Admission(4, 4), port),
                 Job("r", [1, 2, 3], "m", "t", max_tokens=2))
    assert [a for a, _ in port.calls] == ["a", "b"]
    assert [c.executor for c in chunks] == ["b", "b"] and chunks[-1].finished
    assert chunks[0].rung is not None and chunks[1].rung is None  # the served rung, once


def test_a_stream_broken_mid_way_continues_elsewhere_from_the_resume_point():
    port = FakePort({"a": "dies", "b": "ok"})
    chunks = run(Dispatcher(mesh("a", "b"), ByName(), Admission(4, 4), port, placement_attempts=1),
                 Job("r", [1, 2, 3], "m", "t", max_tokens=3))
    (_, first), (_, second) = port.calls
    assert second.prompt_token_ids == (1, 2, 3, 103) and second.max_tokens == 2
    assert [t for c in chunks for t in c.token_ids] == [103, 104, 104]
    assert chunks[-1].num_migrations == 1 and chunks[-1].num_output_tokens == 3
    assert chunks[-1].num_prompt_tokens == 3  # the client's prompt, not the continuation's


def test_the_executor_is_told_the_plans_priority_higher_first():
    view = mesh("a")
    port = FakePort({"a": "ok"})
    admission, inflight = Admission(4, 4), InflightTracker()
    plane = AgentPlane(make_prioritizer("priority"), make_pause_policy("drop"), ContractBook())
    dispatcher = Dispatcher(view, ByName(), admission, port, inflight=inflight,
                            agent=AgentSteps(plane, view.membership, port, admission, inflight))
    for rid, cls in (("chat", RequestClass.INTERACTIVE), ("bulk", RequestClass.BATCH)):
        hop = HopRequest(rid, "t", [1, 2, 3], request_class=cls)
        chunks = run(dispatcher, Job(rid, [1, 2, 3], "m", "t", max_tokens=1, request_class=cls, hop=hop))
        assert chunks[0].request_class is cls
    chat, bulk = (call.priority for _, call in port.calls)
    assert chat > bulk  # class first: interactive runs before batch, one sign end to end


def test_a_just_restarted_scheduler_waits_for_its_first_executor_heartbeat():
    """A scheduler restarted under load hears no heartbeat for about one interval; a
    router's retry or continuation in that window failed UNAVAILABLE "no serving executor"
    (seen in CI under n=8 streams). It now waits for the first executor within the grace."""
    view, port = mesh(), FakePort({"late": "ok"})
    dispatcher = Dispatcher(view, ByName(), Admission(4, 4), port, startup_grace_s=30.0)
    rank = dispatcher.rank

    def rank_then_heartbeat(*args):
        ranked = rank(*args)
        if not view.membership.all():  # the executor's first heartbeat arrives after this look
            view.membership.heartbeat(ExecutorRecord(name="late", address="late", model_id="m", block_size=4,
                                                     state=ExecutorState.SERVING, num_blocks=100))
        return ranked
    dispatcher.rank = rank_then_heartbeat
    chunks = run(dispatcher, Job("r", [1, 2, 3], "m", "t", max_tokens=2))
    assert [c.executor for c in chunks] == ["late", "late"] and chunks[-1].finished


def test_past_the_grace_no_executor_is_refused_at_once():
    import pytest

    from services.scheduler.errors import NoExecutorError

    dispatcher = Dispatcher(mesh(), ByName(), Admission(4, 4), FakePort({}), startup_grace_s=0.0)
    with pytest.raises(NoExecutorError, match="no serving executor"):
        run(dispatcher, Job("r", [1, 2, 3], "m", "t", max_tokens=2))
