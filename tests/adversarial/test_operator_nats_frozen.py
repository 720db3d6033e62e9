"""The unlucky operator: NATS frozen (``kill -STOP``, or a partition that leaves the TCP
connections open) for longer than the executors' heartbeat expiry. The scheduler's bus
still counts as connected, every heartbeat stops arriving, and the old scheduler dropped
every executor after ``missed_heartbeats`` intervals: each new request got 503 "no serving
executor" from a mesh whose executors were all alive and serving. Silence on the bus is
not death: an executor that still answers its health probe stays placeable, and the mesh
keeps serving through the freeze and after NATS is resumed."""
from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from tests.integration.conftest import wait_for
from tests.integration.launched_mesh import launched_mesh
from weft.v1 import common_pb2, router_pb2, router_pb2_grpc

HEARTBEAT_INTERVAL_S = 0.25
ENV = {"WEFT_EXECUTOR_NUM_THREADS": "1", "WEFT_EXECUTOR_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_INTERVAL_S)}
# The scheduler drops an executor silent for 3 intervals (0.75 s); the freeze lasts
# many times that, measured as the time the assertion covers, not slept.
FROZEN_FOR_S = 20 * HEARTBEAT_INTERVAL_S


def _generate(address: str) -> tuple[bool, str]:
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[20, 21, 22, 23]),
                                         sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0))
    try:
        with grpc.insecure_channel(address) as channel:
            chunks = list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=20))
    except grpc.RpcError as exc:
        return False, f"{exc.code().name}: {exc.details()}"
    return bool(chunks) and chunks[-1].finish_reason != 0, "no final chunk"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    state_dir = tmp_path_factory.mktemp("nats-frozen-mesh")
    with launched_mesh(state_dir, tiny_model_dir, 1, ENV) as (process, state):
        yield state


def test_a_frozen_nats_does_not_make_the_scheduler_drop_serving_executors(mesh):
    address = mesh.grpc_address
    assert _generate(address)[0]
    nats_pid = mesh.instance("nats").pid
    os.kill(nats_pid, signal.SIGSTOP)
    try:
        failures: list[str] = []
        started = time.monotonic()
        while time.monotonic() - started < FROZEN_FOR_S:
            ok, why = _generate(address)
            if not ok:
                failures.append(why)
                break
        assert not failures, f"the mesh stopped serving while NATS was frozen: {failures}"
    finally:
        os.kill(nats_pid, signal.SIGCONT)
    wait_for(lambda: _generate(address)[0], 60, "the mesh to serve after NATS resumed")
