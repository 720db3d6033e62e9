"""Ending a session through real processes (NATS, an executor, a scheduler with the keep
pause policy, loopback): Scheduler.EndSession releases the blocks the executor pinned for
the session at once and leaves another session (and another tenant's same id) pinned. The
executor's own ReleaseSession answers how many blocks were still pinned: 0 for the ended
session, more for the one left alone. (One hop at a time is tested with gated fakes in
tests/unit/{scheduler,router}/test_session_lifecycle*.py: a real engine's hop length would
make it a race here.)"""
from __future__ import annotations

import grpc
import pytest

from tests.integration.conftest import ProcessGroup, wait_for
from weft.v1 import common_pb2, executor_pb2, executor_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def mesh(module_nats, module_processes: ProcessGroup, tiny_model_dir):
    common = ["--nats-url", module_nats.url]
    executor = module_processes.start(
        "executor", *common, "--model-dir", str(tiny_model_dir), "--name", "ex-life", "--num-kv-blocks", "96",
        "--block-size", str(BLOCK_SIZE), "--num-threads", "1", "--heartbeat-interval-s", "0.3", "--grace-s", "1",
        name="ex-life", wait=False)
    scheduler = module_processes.start("scheduler", *common, "--policy", "weft", "--pause-policy", "keep",
                                       "--grace-s", "1", name="scheduler-life", wait=False)
    for proc in (executor, scheduler):
        proc.wait_healthy(60)
    channel = grpc.insecure_channel(scheduler.address)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)

    def sees_executor():
        reply = stub.ListExecutors(scheduler_pb2.ListExecutorsRequest(), timeout=2)
        return any(e.heartbeat.state == 2 for e in reply.executors)  # SERVING

    wait_for(sees_executor, 30, "the scheduler to see the executor SERVING")
    try:
        yield stub, executor.address
    finally:
        channel.close()


def _hop(rid: str, session_id: str, tenant: str = "acme", hop_index: int = 0, max_tokens: int = 4):
    return scheduler_pb2.ScheduleRequest(
        request_id=rid, prompt_token_ids=[(7 * i + len(session_id)) % 900 for i in range(40)], tenant=tenant,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        session=common_pb2.SessionInfo(session_id=session_id, hop_index=hop_index, expected_tool_ms=60_000,
                                       request_class=common_pb2.REQUEST_CLASS_AGENTIC))


def _still_pinned(executor_address: str, scoped_session_id: str) -> int:
    """Release on the executor directly and return how many blocks were still pinned."""
    with grpc.insecure_channel(executor_address) as ch:
        reply = executor_pb2_grpc.ExecutorStub(ch).ReleaseSession(
            executor_pb2.ReleaseSessionRequest(session_id=scoped_session_id), timeout=5)
    return reply.num_unpinned_blocks


def test_ending_a_session_releases_its_pinned_blocks_on_the_executor_at_once(mesh):
    stub, executor_address = mesh
    for sid in ("ended", "kept"):
        chunks = list(stub.Generate(_hop(f"life-{sid}", sid), timeout=60))
        assert chunks[-1].pause_decision == common_pb2.PAUSE_DECISION_KEEP
    with pytest.raises(grpc.RpcError) as theirs:
        stub.EndSession(scheduler_pb2.SchedulerEndSessionRequest(tenant="other", session_id="kept"), timeout=5)
    end = stub.EndSession(scheduler_pb2.SchedulerEndSessionRequest(tenant="acme", session_id="ended"), timeout=5)
    assert theirs.value.code() == grpc.StatusCode.NOT_FOUND
    assert (end.ended_now, end.num_executors_released) == (True, 1)
    assert _still_pinned(executor_address, "acme/ended") == 0
    assert _still_pinned(executor_address, "acme/kept") > 0  # the other session (and tenant's id) untouched

